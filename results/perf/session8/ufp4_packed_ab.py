import sys, torch
from triton.testing import do_bench
sys.path[:0] = ["."]
import kernels, tmp_kernels_old as old
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
n = x.numel(); cb = 4 * n / do_bench(lambda: x.clone(), rep=200) / 1e9
nb = 2 * n + n // 2 + 4 * n // 16
for rep in range(3):
    for nm, k in (("old", old), ("new", kernels)):
        t = do_bench(lambda: k.quantize(x, "ufp4"), rep=200)
        t2 = do_bench(lambda: k.quantize(x, "mxfp4"), rep=200)
        print(rep, nm, f"ufp4 packed row {t:.4f} ms xcopy {nb / t / 1e9 / cb:.3f}; mxfp4 {t2:.4f} ms", flush=True)
