"""One-off: the FP8 sides' plain amax, the 2-D _amax_kernel against the flat _flat_amax_kernel by
(BLOCK, TILES, warps), us per call in CUDA-graph replay of 20 calls (each with its zero fill)."""
import torch, fp4, kernels
from bench_kernels import graphed
from triton.testing import do_bench

def t(fn, reps=20):
    g = graphed(lambda: [fn() for _ in range(reps)])
    return do_bench(g, warmup=10, rep=200, return_mode="median") / reps * 1000  # us per call

fmt = fp4.FORMATS["mxfp4"]
cfgs = [(2048, 4, 4), (4096, 4, 4), (4096, 2, 4), (4096, 8, 4), (8192, 4, 8), (8192, 2, 8), (4096, 4, 8),
        (2048, 8, 4), (8192, 8, 8), (16384, 2, 8), (4096, 16, 4)]
print("shape | 2-D amax us | copy us | " + " | ".join(map(str, cfgs)))
for M, N in ((16384, 768), (16384, 2304), (16384, 3072), (8192, 768), (4096, 2048), (4096, 8192)):
    x = torch.randn(1, M, N, device="cuda", dtype=torch.bfloat16)
    want = x.float().abs().amax().item()
    old = t(lambda: kernels._tensor_amax(x, fmt, None, False))
    cp = t(lambda: x.clone())
    row = []
    for c in cfgs:
        assert kernels._flat_amax(x, c).view(torch.float32).item() == want
        row.append(t(lambda: kernels._flat_amax(x, c)))
    gbs = 2 * M * N / 1e3
    print(f"{M}x{N} | {old:.1f} ({gbs/old:.0f} GB/s) | {cp:.1f} | " + " | ".join(f"{v:.1f}" for v in row), flush=True)
