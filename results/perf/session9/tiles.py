"""Tile sweeps for the 8192^2 bf16 rows of bench_kernels.py that sit near or below their targets,
timed from CUDA-graph replays (quant_breakdown.graph_ms: 20 calls per graph, no host time, the
method whose runs agree to 1 %, spread.txt): each kernels._tile default against other
(BM, BN, num_warps, row load mode) tiles. Three timings per tile, median.
Run from the repo root: python results/perf/session9/tiles.py [SET]
  SET 1 (tiles1.txt): the first sweep, row and column tiles of the rows near their targets;
  SET 2 (tiles2.txt): rows of one row per warp (4 x 1024, 2 x 2048) for every format's row kernels.
  SET 3 (tiles3.txt): wider column-side tiles (16 rows x 256-1024): UFP4's training calls at
  16384 x 768 / 2304 / 3072 (dy pair with SR, x pair with a packed column side, each column side
  alone) and the 8192^2 column rows.
"""
import datetime, os, statistics, sys
import torch, triton
sys.path[:0] = [".", "scripts"]
import fp4, kernels
from quant_breakdown import graph_ms

print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
      f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
S = 8192
x = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
n = x.numel()
dst = torch.empty_like(x)
cbw = 4 * n / graph_ms(lambda: dst.copy_(x)) / 1e9
print(f"copy {cbw:.3f} TB/s", flush=True)
ROW = [(8, 512, 4, 0), (8, 512, 8, 0), (16, 512, 8, 0), (16, 256, 4, 0), (8, 512, 4, 2), (8, 512, 8, 2),
       (16, 256, 4, 2), (16, 512, 8, 2), (32, 128, 4, 1), (64, 128, 8, 1), (4, 1024, 4, 0), (4, 1024, 4, 2)]
COL = [(32, 128, 4, 1), (32, 128, 8, 1), (64, 128, 8, 1), (64, 128, 4, 1), (16, 128, 4, 1), (32, 64, 4, 1),
       (64, 64, 4, 1), (16, 256, 4, 1), (32, 256, 8, 1), (128, 64, 4, 1), (128, 64, 8, 1)]
fake, packed = 4 * n, 2 * n + n // 2
SETS = {}
SETS["1"] = [  # (label, fn(cfg), bytes, tiles)
    ("mxfp4 fake RHT16 row", lambda c: kernels.fake_quant(x, "mxfp4", rht=16, _cfg=c), fake, ROW),
    ("mxfp4 fake row", lambda c: kernels.fake_quant(x, "mxfp4", _cfg=c), fake, ROW),
    ("e2m1 fake RHT16 row", lambda c: kernels.fake_quant(x, "e2m1", rht=16, _cfg=c), fake, ROW),
    ("e2m1 fake row", lambda c: kernels.fake_quant(x, "e2m1", _cfg=c), fake, ROW),
    ("mxfp4 packed row", lambda c: kernels.quantize(x, "mxfp4", _cfg=c), packed + n // 8, ROW),
    ("ufp4 fake RHT16 col", lambda c: kernels.fake_quant(x, "ufp4", dim=0, rht=16, _cfg=c), fake, COL),
    ("ufp4 SR RHT16 col", lambda c: kernels.fake_quant(x, "ufp4", dim=0, rht=16, rounding="sr", seed=1, _cfg=c), fake, COL),
    ("nvfp4 fake RHT16 col", lambda c: kernels.fake_quant(x, "nvfp4", dim=0, rht=16, _cfg=c), fake, COL),
    ("nvfp4 SR RHT16 col", lambda c: kernels.fake_quant(x, "nvfp4", dim=0, rht=16, rounding="sr", seed=1, _cfg=c), fake, COL),
    ("mxfp4 packed col", lambda c: kernels.quantize(x, "mxfp4", dim=0, _cfg=c), packed + n // 8, COL),
]
W = [(8, 512, 4, 0), (4, 1024, 4, 0), (2, 2048, 4, 0), (8, 1024, 8, 0), (4, 2048, 8, 0)]
W2 = W + [(8, 512, 4, 2), (4, 1024, 4, 2), (2, 2048, 4, 2), (8, 1024, 8, 2)]
SR = dict(rounding="sr", seed=1)
SETS["2"] = [(f"{f} {what} row", (lambda f, kw, pk: lambda c: (kernels.quantize if pk else kernels.fake_quant)(
                 x, f, _cfg=c, **kw))(f, kw, pk), packed + 4 * n // fp4.get_format(f).block if pk else fake, W2 if f == "mxfp4" else W)
             for f in ("ufp4", "e2m1", "nvfp4", "mxfp4", "nvint4")
             for what, kw, pk in (("fake RHT16", dict(rht=16), False), ("fake", {}, False),
                                  ("SR RHT16", dict(rht=16, **SR), False), ("packed", {}, True))]
WIDE = [(16, 256, 4, 1), (16, 512, 8, 1), (16, 1024, 16, 1), (32, 256, 8, 1), (32, 512, 16, 1)]
SETS["3"] = []
for width in (768, 2304, 3072):
    t = torch.randn(16384, width, device="cuda", dtype=torch.bfloat16)
    tn = t.numel()
    SETS["3"] += [
        (f"dy pair SR 16384x{width}", (lambda t: lambda c: kernels.quantize_both(
            t, "ufp4", rounding="sr", rht=16, rht_col=16, seed=1, seed_col=2, _cfg=c))(t), 6 * tn,
         [(16, 256, 4, 0), (16, 512, 8, 0), (16, 1024, 16, 0), (32, 256, 8, 0)] + WIDE),
        (f"x pair fake + packed 16384x{width}", (lambda t: lambda c: kernels.quantize_both(
            t, "ufp4", rht=16, rht_col=16, packed=(False, True), _cfg=c))(t), 4 * tn + tn // 2 + tn // 4,
         [(64, 64, 4, 1), (32, 128, 4, 1)] + WIDE),
        (f"dy col SR alone 16384x{width}", (lambda t: lambda c: kernels.fake_quant(
            t, "ufp4", dim=0, rounding="sr", rht=16, seed=1, _cfg=c))(t), 4 * tn, [(32, 128, 4, 1)] + WIDE),
        (f"x col packed alone 16384x{width}", (lambda t: lambda c: kernels.quantize(
            t, "ufp4", dim=0, rht=16, _cfg=c))(t), 2 * tn + tn // 2 + tn // 4, [(128, 64, 4, 1), (64, 128, 8, 1)] + WIDE),
    ]
SETS["3"] += [(label, fn, nb, [c for c in cfgs if c[0] <= 32] + WIDE) for label, fn, nb, cfgs in SETS["1"]
              if "col" in label]
CASES = SETS[sys.argv[1] if len(sys.argv) > 1 else "1"]
print("| case | tile | ms | xcopy | vs default |")
print("|---|---|---|---|---|")
for label, fn, nbytes, cfgs in CASES:
    base = None
    for cfg in [None] + cfgs:
        try:
            ms = statistics.median(graph_ms(lambda: fn(cfg)) for _ in range(3))
        except Exception as e:  # noqa: BLE001 (a tile a case cannot take)
            print(f"| {label} | {cfg} | error {type(e).__name__}: {str(e)[:80]} | | |", flush=True)
            continue
        base = base or ms
        print(f"| {label} | {cfg or 'default'} | {ms:.4f} | {nbytes / ms / 1e9 / cbw:.3f} | {ms / base:.3f} |", flush=True)
