"""Session 6's experiment (mm_lookahead.txt, runs 1 and 2; run 2 is this variant list, run 1 had
(128|256, 256|128, 64|128) tiles): the packed GEMM with the next K step dequantized before this
step's dot, against kernels.fp4_matmul of 36adc70 and cuBLAS. Run from the repo root:
python results/perf/session6/mm_lookahead.py"""
import sys, datetime, torch, triton, triton.language as tl
sys.path[:0] = ["."]
import fp4, kernels
from kernels import _unpack_operand

@triton.jit
def mm_v4(a_codes, a_scales, b_codes, b_scales, c_ptr, M, N, K,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
          BLOCK: tl.constexpr, NSEG: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, ST0: tl.constexpr,
          ST1: tl.constexpr, ST2: tl.constexpr, I1: tl.constexpr, I2: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gm = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gm
    pid_n = (pid % group) // gm
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    a = _unpack_operand(a_codes, a_scales, rm, M, K, 0, BM, BK, BLOCK, False, NSEG, S1, S2, ST0, ST1, ST2, I1, I2, False)
    b = _unpack_operand(b_codes, b_scales, rn, N, K, 0, BN, BK, BLOCK, False, NSEG, S1, S2, ST0, ST1, ST2, I1, I2, False)
    for k0 in range(BK, K + BK, BK):
        an = _unpack_operand(a_codes, a_scales, rm, M, K, k0, BM, BK, BLOCK, False, NSEG, S1, S2, ST0, ST1, ST2, I1, I2, False)
        bn = _unpack_operand(b_codes, b_scales, rn, N, K, k0, BN, BK, BLOCK, False, NSEG, S1, S2, ST0, ST1, ST2, I1, I2, False)
        acc = tl.dot(a, tl.trans(b), acc)
        a = an
        b = bn
    off = rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(c_ptr + off, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

def ms(fn, n=10):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n

print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
S = 8192
fmt = fp4.get_format("ufp4")
a = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
w = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
qa, qw = kernels.quantize(a, fmt), kernels.quantize(w, fmt)
ab, wb = a.clone(), w.clone()
t_cublas = ms(lambda: ab @ wb.t())
print(f"cuBLAS bf16 {t_cublas:.3f} ms")
ref = kernels.fp4_matmul(qa, qw, torch.bfloat16)
t_cur = ms(lambda: kernels.fp4_matmul(qa, qw, torch.bfloat16))
print(f"fp4_matmul now {t_cur:.3f} ms = {t_cublas / t_cur:.3f}x cuBLAS")
g = kernels._grid_meta(fmt.grid)
for BM, BN, BK, nw, ns in ((256, 128, 64, 8, 3), (256, 128, 64, 8, 2), (256, 128, 64, 8, 4), (256, 128, 32, 8, 3), (256, 64, 64, 8, 3), (256, 128, 64, 4, 3)):
    c = torch.empty(S, S, device="cuda", dtype=torch.bfloat16)
    grid = (triton.cdiv(S, BM) * triton.cdiv(S, BN),)
    run = lambda: mm_v4[grid](qa.codes, qa.scales, qw.codes, qw.scales, c, S, S, S, BM=BM, BN=BN, BK=BK, GROUP_M=8,
                              BLOCK=fmt.block, num_warps=nw, num_stages=ns, **g)
    try:
        t = ms(run)
    except Exception as ex:
        print(f"v4 {BM}x{BN}x{BK} w{nw} s{ns}: {type(ex).__name__} {str(ex)[:100]}"); continue
    same = torch.equal(c, ref)
    err = (c.float() - ref.float()).abs().max().item()
    print(f"v4 {BM}x{BN}x{BK} w{nw} s{ns}: {t:.3f} ms = {t_cublas / t:.3f}x cuBLAS; equal to fp4_matmul: {same} (max diff {err:.3g})", flush=True)
