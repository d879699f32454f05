"""Row-wise fake quant (bf16 8192^2, RTNE) with and without RHT16 for ufp4 / e2m1 / mxfp4 over
row tiles (BM, BN, warps, row load mode), timed from CUDA-graph replays (quant_breakdown.graph_ms,
median of three rounds). The default tile is kernels._tile's. Outputs of every tile are compared
bit for bit with the default's first.
Run from the repo root: python results/perf/session12/row_tiles.py
"""
import datetime, statistics, sys
import torch, triton
sys.path[:0] = [".", "scripts"]
import kernels
from quant_breakdown import graph_ms

print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
      f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
dst = torch.empty_like(x)
cbw = 4 * x.numel() / graph_ms(lambda: dst.copy_(x)) / 1e9
print(f"copy {cbw:.3f} TB/s (read + write)", flush=True)
CFGS = [None, (2, 2048, 4, 0), (4, 1024, 4, 0), (8, 512, 4, 0), (2, 2048, 8, 0), (4, 1024, 8, 0),
        (2, 2048, 4, 1), (4, 1024, 4, 1), (8, 512, 4, 1), (16, 256, 4, 1), (32, 128, 4, 1),
        (1, 4096, 4, 0), (1, 4096, 8, 0), (1, 2048, 2, 0), (2, 1024, 2, 0)]
print("| format | RHT | tile | us | xcopy |\n|---|---|---|---|---|")
best = {}
for f in ("ufp4", "e2m1", "mxfp4"):
    for rht in (16, None):
        ref = kernels.fake_quant(x, f, rht=rht)
        for cfg in CFGS:
            fn = lambda: kernels.fake_quant(x, f, rht=rht, _cfg=cfg)
            try:
                out = fn()
            except Exception as e:  # a tile this format's groups do not fit
                print(f"| {f} | {rht} | {cfg} | failed: {type(e).__name__} | |", flush=True)
                continue
            assert torch.equal(out, ref), (f, rht, cfg)
            us = statistics.median(graph_ms(fn) for _ in range(3)) * 1000
            xc = 4 * x.numel() / (us * 1e-6) / 1e12 / cbw
            best.setdefault((f, rht), []).append((us, cfg))
            print(f"| {f} | {rht} | {cfg or 'default'} | {us:.1f} | {xc:.3f} |", flush=True)
print("\n| format | best RHT16 tile | us | best no-RHT tile | us | RHT on / off (best each) | default on / off |\n|---|---|---|---|---|---|---|")
for f in ("ufp4", "e2m1", "mxfp4"):
    on, off = min(best[(f, 16)]), min(best[(f, None)])
    d_on = [u for u, c in best[(f, 16)] if c is None][0]
    d_off = [u for u, c in best[(f, None)] if c is None][0]
    print(f"| {f} | {on[1]} | {on[0]:.1f} | {off[1]} | {off[0]:.1f} | {on[0] / off[0]:.3f} | {d_on / d_off:.3f} |")
