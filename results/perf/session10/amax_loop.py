"""NVFP4's tensor-amax pass: does it run at read bandwidth? The pass launches one program per
quantize tile (4096 elements) and one atomic max each. Here a copy of kernels._amax_kernel loops
over TILES tiles along M per program (one atomic per program) and is timed from CUDA-graph replays
against the kernel as it is, with a no-RHT read of the same bytes as the bandwidth reference.
Every variant's amax is compared bit for bit with kernels._tensor_amax.
Run from the repo root: python results/perf/session10/amax_loop.py
"""
import datetime, statistics, sys
import torch, triton
import triton.language as tl
sys.path[:0] = [".", "scripts"]
import fp4, kernels
from kernels import _load_rows, _load_cols, _rht, _amax
from quant_breakdown import graph_ms


@triton.jit
def _amax_loop(x_ptr, r_part, c_part, M, N, r_signs, c_signs, BM: tl.constexpr, BN: tl.constexpr,
               DO_ROW: tl.constexpr, R_G: tl.constexpr, R_RHT: tl.constexpr, R_INV: tl.constexpr,
               R_SMASK: tl.constexpr, DO_COL: tl.constexpr, C_G: tl.constexpr,
               C_RHT: tl.constexpr, C_INV: tl.constexpr, C_SMASK: tl.constexpr,
               ROWLOAD: tl.constexpr, EVEN: tl.constexpr, TILES: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    a = tl.program_id(2)
    base = a.to(tl.int64) * M * N
    mr = tl.zeros([BM, BN], tl.float32)
    mc = tl.zeros([BN, BM], tl.float32)
    for t in range(TILES):
        m0 = (pid_m * TILES + t) * BM
        if DO_ROW:
            x = _load_rows(x_ptr, base, m0, pid_n * BN, M, N, BM, BN, R_G, ROWLOAD, EVEN)
            if R_RHT > 0:
                x = _rht(x, r_signs, BM, BN, R_RHT, R_INV, R_SMASK)
            mr = tl.maximum(mr, tl.abs(x))  # (experiment: NaN handling not kept)
        if DO_COL:
            x = _load_cols(x_ptr, base, m0, pid_n * BN, M, N, BM, BN, C_G, EVEN)
            if C_RHT > 0:
                x = _rht(x, c_signs, BN, BM, C_RHT, C_INV, C_SMASK)
            mc = tl.maximum(mc, tl.abs(x))
    if DO_ROW:
        m = _amax(_amax(mr, 1), 0)
        tl.atomic_max(r_part, tl.where(m != m, 0x7FC00000, m.to(tl.int32, bitcast=True)))
    if DO_COL:
        m = _amax(_amax(mc, 1), 0)
        tl.atomic_max(c_part, tl.where(m != m, 0x7FC00000, m.to(tl.int32, bitcast=True)))


def run_loop(x3, sides, groups, BM, BN, nw, mode, tiles):
    A, M, N = x3.shape
    outs = [torch.zeros(1, device=x3.device, dtype=torch.int32) for _ in range(2)]
    meta, _ = kernels._amax_meta(sides, groups, BM, BN, True, mode, nw)
    signs = [kernels._signs(n, x3.device, outs[0]) if on and n else outs[0] for on, n in sides]
    _amax_loop[(M // (BM * tiles), N // BN, A)](x3, outs[0], outs[1], M, N, *signs, TILES=tiles, **meta)
    return outs


def main():
    print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
          f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(big)
    cbw = 4 * big.numel() / graph_ms(lambda: dst.copy_(big)) / 1e9
    print(f"copy {cbw:.3f} TB/s (read + write); read-only rows below: bytes read / time / copy bw", flush=True)
    cases = []  # (label, x, sides, groups, tile (BM, BN, nw, mode), reference call)
    x3 = big.view(1, 8192, 8192)
    cases.append(("8192^2 row RHT16", x3, ((True, 16), (False, None)), (16, 16), (2, 2048, 4, 0),
                  lambda: kernels._tensor_amax(x3, fp4.get_format("nvfp4"), 16, False, 2, 2048, 4, 0)))
    cases.append(("8192^2 row", x3, ((True, None), (False, None)), (16, 16), (2, 2048, 4, 0),
                  lambda: kernels._tensor_amax(x3, fp4.get_format("nvfp4"), None, False, 2, 2048, 4, 0)))
    for w in (768, 3072, 4096):
        t3 = torch.randn(1, 16384, w, device="cuda", dtype=torch.bfloat16)
        # x of an NVFP4 layer: row side plain (Fprop), column side RHT16 (Wgrad), tile of the x pair
        cases.append((f"16384x{w} x pair (row, col RHT16)", t3, ((True, None), (True, 16)), (16, 16), (64, 64, 4, 1),
                      (lambda t3: lambda: kernels._tensor_amax(t3, fp4.get_format("nvfp4"), None, False, 64, 64, 4, 1,
                                                                col_rht=16))(t3)))
        cases.append((f"16384x{w} dy pair (row, col RHT16)", t3, ((True, None), (True, 16)), (16, 16), (16, 256, 4, 0),
                      (lambda t3: lambda: kernels._tensor_amax(t3, fp4.get_format("nvfp4"), None, False, 16, 256, 4, 0,
                                                                col_rht=16))(t3)))
    print("| case | tile | variant | us | read xcopy | amax equal |\n|---|---|---|---|---|---|")
    for label, t3, sides, groups, (BM, BN, nw, mode), ref in cases:
        r = ref()
        want = [int(v) for v in (r if isinstance(r, tuple) else (r,))]
        nbytes = t3.numel() * 2
        rows = [("as is", ref, True)]
        for tiles in (2, 4, 8, 16, 32):
            if t3.shape[1] % (BM * tiles) == 0:
                rows.append((f"loop {tiles}", (lambda tiles: lambda: run_loop(t3, sides, groups, BM, BN, nw, mode, tiles))(tiles), None))
        for name, fn, _ in rows:
            out = fn()
            got = [int(v) for v in (out if isinstance(out, tuple) else out)]
            eq = got[:len(want)] == want if name != "as is" else True
            if name != "as is" and not (sides[0][0] and sides[1][0]):
                eq = got[0] == want[0]
            us = statistics.median(graph_ms(fn) for _ in range(3)) * 1e3
            print(f"| {label} | {BM}x{BN}x{nw} m{mode} | {name} | {us:.1f} | {nbytes / us / 1e6 / cbw:.3f} | {eq} |", flush=True)


if __name__ == "__main__":
    main()
