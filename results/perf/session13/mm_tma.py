"""The packed GEMM with its code and scale tiles loaded by TMA (host tensor descriptors), so that
Triton's pipeliner can prefetch them into shared memory num_stages K steps ahead, against
kernels.fp4_matmul (pointer loads into registers, dequantize one step ahead). Variants:
  look:  kernels.py's loop (dequantize the next step before this step's dot), TMA loads
  plain: load, dequantize, dot in one step; the pipeliner prefetches the loads
  ws:    plain under tl.range(warp_specialize=True) (Hopper automatic warp specialization)
Outputs are compared bit for bit with kernels.fp4_matmul; times are CUDA-graph replays against
cuBLAS bf16 in the same process, interleaved over rounds (median).
Run from the repo root: python results/perf/session13/mm_tma.py [formats] [variants]
"""
import datetime, statistics, sys, traceback
import torch, triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
sys.path[:0] = [".", "scripts"]
import kernels
from kernels import _dequant_operand
from quant_breakdown import graph_ms

_DEQ_INT4_FMA = tl.constexpr("""{
.reg .b32 m0, m1, u, t;
.reg .f32 f0, f1;
lop3.b32 m0, $2, 0x07, 0x4B000000, 0xEA;
lop3.b32 m1, $2, 0x70, 0x49000000, 0xEA;
mov.b32 f0, m0;
mov.b32 f1, m1;
fma.rn.f32 f0, f0, $3, $4;
fma.rn.f32 f1, f1, $3, $5;
cvt.rn.bf16x2.f32 t, f1, f0;
mul.lo.u32 u, $2, 0x01001000;
and.b32 u, u, 0x80008000;
or.b32 t, t, u;
mov.b32 {$0, $1}, t;
}""")


@triton.jit
def _deq(c, sc, BR: tl.constexpr, BK: tl.constexpr, BLOCK: tl.constexpr,
         SCALE: tl.constexpr, E2M1: tl.constexpr, NSEG: tl.constexpr, S1: tl.constexpr,
         S2: tl.constexpr, ST0: tl.constexpr, ST1: tl.constexpr, ST2: tl.constexpr, I1: tl.constexpr,
         I2: tl.constexpr, DOT_FP32: tl.constexpr, FMA: tl.constexpr):
    """_dequant_operand, or for int4 codes one fma per element: f = 2^23 + m by its bits (2^19 + m
    for the high nibble), fma(f, s, -2^23 s) = RN(m s) (session12/mm_fma.patch)."""
    if FMA and not DOT_FP32 and not E2M1 and NSEG == 1 and ST0 == 1.0:
        NB: tl.constexpr = BK // BLOCK
        s0 = tl.reshape(tl.broadcast_to(sc[:, :, None], [BR, NB, BLOCK // 2]), [BR, BK // 2])
        s1 = tl.reshape(tl.broadcast_to((sc * -8388608.0)[:, :, None], [BR, NB, BLOCK // 2]), [BR, BK // 2])
        s2 = tl.reshape(tl.broadcast_to((sc * -524288.0)[:, :, None], [BR, NB, BLOCK // 2]), [BR, BK // 2])
        lo, hi = tl.inline_asm_elementwise(_DEQ_INT4_FMA, "=h,=h,r,r,r,r",
                                           [c.to(tl.int32), s0, s1, s2],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        return tl.reshape(tl.join(lo, hi), [BR, BK])
    return _dequant_operand(c, sc, BR, BK, BLOCK, SCALE, E2M1, NSEG, S1, S2, ST0, ST1, ST2, I1, I2, DOT_FP32)


@triton.jit
def _mm_tma(a_c, a_s, a_ts, b_c, b_s, b_ts, c_ptr, M, N, K,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
            A_BLOCK: tl.constexpr, A_B2D: tl.constexpr, A_TS: tl.constexpr, A_SCALE: tl.constexpr,
            A_E2M1: tl.constexpr, A_NSEG: tl.constexpr, A_S1: tl.constexpr, A_S2: tl.constexpr,
            A_ST0: tl.constexpr, A_ST1: tl.constexpr, A_ST2: tl.constexpr, A_I1: tl.constexpr, A_I2: tl.constexpr,
            B_BLOCK: tl.constexpr, B_B2D: tl.constexpr, B_TS: tl.constexpr, B_SCALE: tl.constexpr,
            B_E2M1: tl.constexpr, B_NSEG: tl.constexpr, B_S1: tl.constexpr, B_S2: tl.constexpr,
            B_ST0: tl.constexpr, B_ST1: tl.constexpr, B_ST2: tl.constexpr, B_I1: tl.constexpr, B_I2: tl.constexpr,
            DOT_FP32: tl.constexpr, DOT_FIRST: tl.constexpr, VARIANT: tl.constexpr, NS: tl.constexpr, FMA: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gm = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gm
    pid_n = (pid % group) // gm
    m0 = pid_m * BM
    n0 = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if VARIANT == 0:
        a = _dequant_operand(a_c.load([m0, 0]), a_s.load([m0, 0]), BM, BK, A_BLOCK, A_SCALE, A_E2M1, A_NSEG, A_S1, A_S2, A_ST0, A_ST1, A_ST2, A_I1, A_I2, DOT_FP32)
        b = _dequant_operand(b_c.load([n0, 0]), b_s.load([n0, 0]), BN, BK, B_BLOCK, B_SCALE, B_E2M1, B_NSEG, B_S1, B_S2, B_ST0, B_ST1, B_ST2, B_I1, B_I2, DOT_FP32)
        for k0 in range(BK, K + BK, BK):
            if DOT_FIRST:
                acc = tl.dot(a, tl.trans(b), acc)
            ca = a_c.load([m0, k0 // 2])
            sa = a_s.load([m0, k0 // A_BLOCK])
            cb = b_c.load([n0, k0 // 2])
            sb = b_s.load([n0, k0 // B_BLOCK])
            a_next = _dequant_operand(ca, sa, BM, BK, A_BLOCK, A_SCALE, A_E2M1, A_NSEG, A_S1, A_S2, A_ST0, A_ST1, A_ST2, A_I1, A_I2, DOT_FP32)
            b_next = _dequant_operand(cb, sb, BN, BK, B_BLOCK, B_SCALE, B_E2M1, B_NSEG, B_S1, B_S2, B_ST0, B_ST1, B_ST2, B_I1, B_I2, DOT_FP32)
            if not DOT_FIRST:
                acc = tl.dot(a, tl.trans(b), acc)
            a, b = a_next, b_next
    else:
        for k0 in tl.range(0, K, BK, num_stages=NS, warp_specialize=VARIANT == 2):
            ca = a_c.load([m0, k0 // 2])
            sa = a_s.load([m0, k0 // A_BLOCK])
            cb = b_c.load([n0, k0 // 2])
            sb = b_s.load([n0, k0 // B_BLOCK])
            a = _deq(ca, sa, BM, BK, A_BLOCK, A_SCALE, A_E2M1, A_NSEG, A_S1, A_S2, A_ST0, A_ST1, A_ST2, A_I1, A_I2, DOT_FP32, FMA)
            b = _deq(cb, sb, BN, BK, B_BLOCK, B_SCALE, B_E2M1, B_NSEG, B_S1, B_S2, B_ST0, B_ST1, B_ST2, B_I1, B_I2, DOT_FP32, FMA)
            acc = tl.dot(a, tl.trans(b), acc)
    if A_TS:
        acc = acc * (1.0 / tl.load(a_ts))
    if B_TS:
        acc = acc * (1.0 / tl.load(b_ts))
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    off = rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(c_ptr + off, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def fmt_is_e2m1(f):
    return kernels._grid_meta(kernels.fp4.get_format(f).grid)["E2M1"]


def mm_tma(qa, qb, variant, cfg, dot_first=None, fma=False):
    BM, BN, BK, GM, nw, ns = cfg
    M, K = qa.shape
    N, _ = qb.shape
    c = torch.empty((M, N), device=qa.codes.device, dtype=torch.float32 if kernels.INTERPRET else torch.bfloat16)
    meta = kernels._mm_meta(qa.fmt, qb.fmt, qa.tensor_scale is not None, qb.tensor_scale is not None)
    if dot_first is not None:
        meta["DOT_FIRST"] = dot_first
    sa, sb = kernels._mm_scales(qa), kernels._mm_scales(qb)
    ba, bb = meta["A_BLOCK"], meta["B_BLOCK"]
    d = lambda t, r, w: TensorDescriptor.from_tensor(t, [r, w])
    args = (d(qa.codes, BM, BK // 2), d(sa, BM, BK // ba),
            qa.tensor_scale if qa.tensor_scale is not None else sa,
            d(qb.codes, BN, BK // 2), d(sb, BN, BK // bb),
            qb.tensor_scale if qb.tensor_scale is not None else sb)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _mm_tma[grid](*args, c, M, N, K, BM=BM, BN=BN, BK=BK, GROUP_M=GM, DOT_FP32=kernels.INTERPRET, VARIANT=variant,
                  NS=ns, FMA=fma, num_warps=nw, num_stages=ns, **meta)
    return c


if __name__ == "__main__":
    print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
          f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    fmts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["ufp4", "mxfp4", "nvfp4"]
    want = sys.argv[2].split(",") if len(sys.argv) > 2 else None  # names, or a prefix ending in *
    S = 8192
    torch.manual_seed(0)
    x = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    print("| format | variant | cfg (BM, BN, BK, GM, warps, stages) | ms | x cuBLAS bf16 | equal |\n|---|---|---|---|---|---|", flush=True)
    big = (128, 256, 64, 8, 8, 3)
    variants = [("look", 0, big, None), ("look dotfirst", 0, big, True), ("look dotlast", 0, big, False),
                ("plain", 1, big, None), ("plain s4", 1, (128, 256, 64, 8, 8, 4), None),
                ("plain bk128", 1, (128, 256, 128, 8, 8, 3), None),
                ("ws", 2, big, None), ("ws 128x128", 2, (128, 128, 64, 8, 8, 3), None),
                ("ws 128x256 w4", 2, (128, 256, 64, 8, 4, 3), None)]
    # second sweep: BK 128 and 256 (names: variant BM BN BK GROUP_M warps stages)
    for var, nm in ((1, "plain"), (2, "ws")):
        for cfg in ((128, 256, 128, 8, 8, 2), (128, 256, 128, 8, 8, 3), (128, 256, 128, 8, 8, 4),
                    (128, 256, 128, 4, 8, 3), (128, 256, 128, 16, 8, 3),
                    (128, 128, 128, 8, 8, 3), (128, 128, 128, 8, 8, 4), (128, 128, 128, 8, 4, 3),
                    (256, 128, 128, 8, 8, 3), (128, 256, 256, 8, 8, 2), (128, 128, 256, 8, 8, 3),
                    (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4)):
            variants.append((nm + " " + " ".join(map(str, cfg)), var, cfg, None))
    for cfg in ((128, 128, 128, 8, 4, 2), (128, 128, 128, 8, 4, 3), (128, 128, 128, 8, 4, 4),
                (128, 128, 128, 4, 4, 3), (128, 128, 128, 16, 4, 3), (128, 128, 64, 8, 4, 3),
                (128, 128, 64, 8, 4, 5), (128, 128, 64, 8, 4, 6), (128, 128, 256, 8, 4, 2),
                (64, 256, 128, 8, 4, 3), (64, 128, 128, 8, 4, 3), (128, 64, 128, 8, 4, 3),
                (64, 256, 64, 8, 4, 4)):
        variants.append(("w4 " + " ".join(map(str, cfg)), 1, cfg, None))
        variants.append(("w4 fma " + " ".join(map(str, cfg)), 1, cfg, "fma"))
    variants.append(("w4 ws 128 128 128 8 4 3", 2, (128, 128, 128, 8, 4, 3), None))
    if want:
        variants = [v for v in variants if any(v[0] == n or (n.endswith("*") and v[0].startswith(n[:-1])) for n in want)]
    for f in fmts:
        qa, qb = kernels.quantize(x, f, rht=16), kernels.quantize(w, f, rht=16)
        ref = kernels.fp4_matmul(qa, qb)
        ok = []
        for name, var, cfg, df in variants:
            if df == "fma" and fmt_is_e2m1(f):
                continue
            try:
                out = mm_tma(qa, qb, var, cfg, *((None, True) if df == "fma" else (df, False)))
                torch.cuda.synchronize()
                ok.append((name, var, cfg, df, torch.equal(out, ref),
                           (out.float() - ref.float()).abs().max().item()))
            except Exception as e:
                print(f"| {f} | {name} | {cfg} | failed: {type(e).__name__}: {str(e)[:300]!r} | | |", flush=True)
        ts = {v[0]: [] for v in ok}
        ts["kernels.fp4_matmul"], ts["cublas"] = [], []
        for _ in range(3):
            ts["cublas"].append(graph_ms(lambda: x @ w.t(), reps=5))
            ts["kernels.fp4_matmul"].append(graph_ms(lambda: kernels.fp4_matmul(qa, qb), reps=5))
            for name, var, cfg, df, _, _ in ok:
                ts[name].append(graph_ms(lambda: mm_tma(qa, qb, var, cfg, *((None, True) if df == "fma" else (df, False))), reps=5))
        cb = statistics.median(ts["cublas"])
        ms = statistics.median(ts["kernels.fp4_matmul"])
        print(f"| {f} | kernels.fp4_matmul | default | {ms:.3f} | {cb / ms:.3f} | ref |", flush=True)
        for name, var, cfg, df, eq, err in ok:
            ms = statistics.median(ts[name])
            print(f"| {f} | {name} | {cfg} | {ms:.3f} | {cb / ms:.3f} | {eq} (max diff {err:.3g}) |", flush=True)
        print(f"| {f} | cuBLAS bf16 | | {cb:.3f} | 1.000 ({2 * S ** 3 / cb / 1e9:.0f} TFLOP/s) | |", flush=True)
