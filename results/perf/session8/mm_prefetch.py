"""Session 8's GEMM experiment: kernels.fp4_matmul at 8192^3 under variants given as
VARIANTS="fmt:BM,BN,BK,GROUP_M,warps,stages,PREFETCH,LOAD3D ..." (fmt 'all' for the three formats),
against the kernel of the commit before (tmp_kernels_old.py = `git show <commit>:kernels.py`, run
from the repo root) and cuBLAS bf16, timed in one process (event loop, 10 calls after one warm-up);
each variant's output is compared bit for bit with the old kernel's.
PREFETCH (kernel variants of the experiment): 0 = the committed loop (load step k+1, dequantize
it, dot step k); 1 = packed tiles loaded two steps ahead (registers), in that order; 2 = the same
with the dot first in the loop body; 3 = no look-ahead of loads, dot first. LOAD3D: codes and scales loaded as [rows, blocks, ...] tiles."""
import datetime, os, sys, torch, triton
sys.path[:0] = ["."]
import fp4, kernels, tmp_kernels_old as old


def ms(fn, n=10):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n


print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC {torch.cuda.get_device_name()} "
      f"torch {torch.__version__} triton {triton.__version__}")
S = int(os.environ.get("SIZE", 8192))
a = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
w = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
t_cublas = ms(lambda: a @ w.t())
print(f"cuBLAS bf16 {S}^3 {t_cublas:.3f} ms")
variants = []
for v in os.environ["VARIANTS"].split():
    f, cfg = v.split(":")
    vals = [int(x) for x in cfg.split(",")]
    for name in (("ufp4", "nvfp4", "mxfp4") if f == "all" else (f,)):
        variants.append((name, tuple(vals[:6]), vals[6], bool(vals[7])))
rows = []
for name in dict.fromkeys(v[0] for v in variants):
    fmt = fp4.get_format(name)
    qa, qw = kernels.quantize(a, fmt), kernels.quantize(w, fmt)
    ref = old.fp4_matmul(qa, qw, torch.bfloat16)
    t_old = ms(lambda: old.fp4_matmul(qa, qw, torch.bfloat16))
    rows.append((name, "old kernel, default tile", t_old, True))
    print(f"{name}: old kernel {t_old:.3f} ms = {t_cublas / t_old:.3f}x cuBLAS", flush=True)
    for _, cfg, pf, l3 in (v for v in variants if v[0] == name):
        kernels._MM_CFG, kernels.MM_PREFETCH, kernels.MM_LOAD3D = cfg, pf, l3
        what = f"{cfg} prefetch {pf} load3d {int(l3)}"
        try:
            c = kernels.fp4_matmul(qa, qw, torch.bfloat16)
            t = ms(lambda: kernels.fp4_matmul(qa, qw, torch.bfloat16))
            eq = torch.equal(c.view(torch.int16), ref.view(torch.int16))
            rows.append((name, what, t, eq))
            print(f"{name} {what}: {t:.3f} ms = {t_cublas / t:.3f}x cuBLAS, {t_old / t:.2f}x old; "
                  f"equal to old: {eq}", flush=True)
        except Exception as e:
            print(f"{name} {what}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
    kernels._MM_CFG, kernels.MM_PREFETCH, kernels.MM_LOAD3D = None, 0, False
print(f"\n| format | variant | ms | x cuBLAS ({t_cublas:.3f} ms) | bit-equal to old |\n|---|---|---|---|---|")
for name, what, t, eq in rows:
    print(f"| {name} | {what} | {t:.3f} | {t_cublas / t:.3f} | {eq} |")
