"""A fake column side alone on 16-bit input in 16 x 256 tiles (this tree's kernels._tile) against
32 x 128 (tmp_kernels_old.py = `git show f57be95:kernels.py`, in the repo root), in one process on
one GPU, timed from CUDA-graph replays (quant_breakdown.graph_ms), old and new interleaved over
three rounds (median). Every call's outputs are compared bit for bit first (SR too: the counters
depend on the element's position, not the tile).
Run from the repo root: python results/perf/session11/col_tile_ab.py
"""
import datetime, statistics, sys
import torch, triton
sys.path[:0] = [".", "scripts"]
import fp4, kernels, tmp_kernels_old as old
from quant_breakdown import graph_ms

print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
      f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
dst = torch.empty_like(big)
cbw = 4 * big.numel() / graph_ms(lambda: dst.copy_(big)) / 1e9
print(f"copy {cbw:.3f} TB/s (read + write)", flush=True)
SR = dict(rounding="sr", seed=1)
cases = []  # (label, bytes, fn(module))
for f in ("ufp4", "nvfp4", "e2m1"):
    n = big.numel()
    cases += [(f"8192^2 {f} fake RHT16 col", 4 * n, (lambda f: lambda k: k.fake_quant(big, f, dim=0, rht=16))(f)),
              (f"8192^2 {f} SR RHT16 col", 4 * n, (lambda f: lambda k: k.fake_quant(big, f, dim=0, rht=16, **SR))(f))]
for w in (768, 2304, 3072, 4096):
    t = torch.randn(16384, w, device="cuda", dtype=torch.bfloat16)
    for f in ("ufp4", "nvfp4"):
        cases += [(f"16384x{w} {f} dy col SR alone", 4 * t.numel(),
                   (lambda t, f: lambda k: k.fake_quant(t, f, dim=0, rht=16, **SR))(t, f))]
for label, _, fn in cases:
    a, b = fn(old), fn(kernels)
    assert torch.equal(a, b), label
print(f"outputs equal in all {len(cases)} cases", flush=True)
print("| case | 32 x 128 us | 16 x 256 us | new / old | xcopy old | xcopy new |\n|---|---|---|---|---|---|")
for label, nbytes, fn in cases:
    ts = {old: [], kernels: []}
    for _ in range(3):
        for k in (old, kernels):
            ts[k].append(graph_ms(lambda: fn(k)))
    o, nw = statistics.median(ts[old]) * 1e3, statistics.median(ts[kernels]) * 1e3
    print(f"| {label} | {o:.1f} | {nw:.1f} | {nw / o:.3f} | {nbytes / o / 1e6 / cbw:.3f} | {nbytes / nw / 1e6 / cbw:.3f} |", flush=True)
