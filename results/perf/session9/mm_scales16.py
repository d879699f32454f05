"""The packed GEMM with 32-block operands at 8192^3: the kernel before (tmp_kernels_old.py =
`git show 1d60d8e:kernels.py`: a [rows, K / 32] scale tile per K step, which reached the codes'
layout through shared memory after the wgmma's wait) against this tree's (scales repeated to one
per 16 elements before the call, read like NVFP4's). MXFP4 and MXINT4, with NVFP4 (unchanged) as
the control; outputs compared bit for bit; graph-replay timing (do_bench median, three rounds).
Run from the repo root: python results/perf/session9/mm_scales16.py"""
import datetime, statistics, sys
import torch, triton
from triton.testing import do_bench
sys.path[:0] = ["."]
import kernels, tmp_kernels_old as old
from bench_kernels import graphed

print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
      f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
w = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
t = {}
for rnd in range(3):
    t.setdefault("cuBLAS", []).append(do_bench(graphed(lambda: a @ w.t()), rep=300))
    for name in ("mxfp4", "mxint4", "nvfp4"):
        qa, qw = kernels.quantize(a, name), kernels.quantize(w, name)
        for label, mod in (("old", old), ("new", kernels)):
            if rnd == 0:
                t[(name, label, "out")] = mod.fp4_matmul(qa, qw, torch.bfloat16)
            t.setdefault((name, label), []).append(
                do_bench(graphed(lambda: mod.fp4_matmul(qa, qw, torch.bfloat16)), rep=300))
cub = statistics.median(t["cuBLAS"])
print(f"cuBLAS bf16 8192^3 {cub:.4f} ms\n| format | old ms | new ms | old x cuBLAS | new x cuBLAS | bit-equal |\n|---|---|---|---|---|---|")
for name in ("mxfp4", "mxint4", "nvfp4"):
    o, n = statistics.median(t[(name, "old")]), statistics.median(t[(name, "new")])
    eq = torch.equal(t[(name, "old", "out")].view(torch.int16), t[(name, "new", "out")].view(torch.int16))
    print(f"| {name} | {o:.4f} | {n:.4f} | {cub / o:.3f} | {cub / n:.3f} | {eq} |")
