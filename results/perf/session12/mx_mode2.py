"""MXFP4 row-wise RTNE fake quant (bf16 8192^2) with RHT16 and without, in mode 2 (each thread
loads its whole 32-groups as four 16-byte pieces) against the default tile (mode 0), timed from
CUDA-graph replays (median of three), outputs compared bit for bit.
Run from the repo root: python results/perf/session12/mx_mode2.py
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
CFGS = [None, (2, 2048, 4, 2), (4, 1024, 4, 2), (8, 512, 4, 2), (1, 4096, 4, 2), (1, 4096, 8, 2),
        (2, 2048, 8, 2), (1, 2048, 2, 2), (2, 1024, 2, 2), (1, 1024, 1, 2)]
print("| format | RHT | rounding | tile | us | xcopy |\n|---|---|---|---|---|---|")
for f in ("mxfp4",):
    for rht in (16, None):
        for rnd in ("rtne", "sr"):
            kw = dict(rounding=rnd, seed=3, rht=rht)
            ref = kernels.fake_quant(x, f, **kw)
            for cfg in CFGS:
                fn = lambda: kernels.fake_quant(x, f, _cfg=cfg, **kw)
                assert torch.equal(fn(), ref), (f, rht, cfg)
                us = statistics.median(graph_ms(fn) for _ in range(3)) * 1000
                xc = 4 * x.numel() / (us * 1e-6) / 1e12 / cbw
                print(f"| {f} | {rht} | {rnd} | {cfg or 'default'} | {us:.1f} | {xc:.3f} |", flush=True)
