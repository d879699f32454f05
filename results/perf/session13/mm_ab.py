"""kernels.fp4_matmul at this tree (TMA loads, plain loop, 128 x 128 x 128 tiles of 4 warps)
against the tree before it (tmp_kernels_old.py = `git show 15435bd:kernels.py`: pointer loads,
dequantize one step ahead, 128 x 256 x 64 / 128 x 128 x 64 tiles of 8 warps), at 8192^3 and at
GPT-2-small shapes, timed from CUDA-graph replays against cuBLAS bf16 in the same process,
interleaved over three rounds (median). Outputs compared: max relative difference (the K steps
differ, so the fp32 sums' order does).
Run from the repo root: python results/perf/session13/mm_ab.py
"""
import dataclasses, datetime, statistics, sys
import torch, triton
sys.path[:0] = [".", "scripts"]
import fp4, kernels, tmp_kernels_old as old
from quant_breakdown import graph_ms

print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
      f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
print("| M x N x K | format | old ms | new ms | new / old speed | old x cuBLAS | new x cuBLAS | cuBLAS TFLOP/s | max rel diff |\n|---|---|---|---|---|---|---|---|---|", flush=True)
torch.manual_seed(0)
for M, N, K in ((8192, 8192, 8192), (16384, 768, 3072), (16384, 3072, 768), (16384, 2304, 768), (768, 3072, 16384)):
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    for f in ("ufp4", "nvfp4", "mxfp4"):
        qa = kernels.quantize(a, f, rht=16)
        qb = kernels.quantize(b, dataclasses.replace(fp4.FORMATS[f], block_2d=f == "nvfp4"), rht=16)
        o_old, o_new = old.fp4_matmul(qa, qb, torch.float32), kernels.fp4_matmul(qa, qb, torch.float32)
        rel = ((o_new - o_old).abs().max() / o_old.abs().max()).item()
        ts = {"old": [], "new": [], "cublas": []}
        for _ in range(3):
            ts["cublas"].append(graph_ms(lambda: a @ b.t(), reps=5))
            ts["old"].append(graph_ms(lambda: old.fp4_matmul(qa, qb), reps=5))
            ts["new"].append(graph_ms(lambda: kernels.fp4_matmul(qa, qb), reps=5))
        o, n, c = (statistics.median(ts[k]) for k in ("old", "new", "cublas"))
        print(f"| {M} x {N} x {K} | {f} | {o:.3f} | {n:.3f} | {o / n:.2f} | {c / o:.3f} | {c / n:.3f} | "
              f"{2 * M * N * K / c / 1e9:.0f} | {rel:.1e} |", flush=True)
