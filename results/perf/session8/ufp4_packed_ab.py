"""UFP4's and MXFP4's packed row quantize at 8192^2 bf16 (bench_kernels.py's 'quantize -> codes+scales'
rows), e0ac88a's kernels (tmp_kernels_old.py = `git show e0ac88a:kernels.py`) against this tree's,
three rounds in one process (triton.testing.do_bench, median): the spread of one kernel's time.
Run from the repo root: python results/perf/session8/ufp4_packed_ab.py"""
import datetime
import sys, torch, triton
from triton.testing import do_bench
sys.path[:0] = ["."]
import kernels, tmp_kernels_old as old
print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC {torch.cuda.get_device_name()} "
      f"torch {torch.__version__} triton {triton.__version__}")
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
n = x.numel(); cb = 4 * n / do_bench(lambda: x.clone(), rep=200) / 1e9
nb = 2 * n + n // 2 + 4 * n // 16
for rep in range(3):
    for nm, k in (("old", old), ("new", kernels)):
        t = do_bench(lambda: k.quantize(x, "ufp4"), rep=200)
        t2 = do_bench(lambda: k.quantize(x, "mxfp4"), rep=200)
        print(rep, nm, f"ufp4 packed row {t:.4f} ms xcopy {nb / t / 1e9 / cb:.3f}; mxfp4 {t2:.4f} ms", flush=True)
