"""Grid order A/B: the quantize and amax kernels with their grid as it was (M's tiles first: the
programs that run together read a strip of BN columns down many rows) against kernels.N_FIRST
(N's tiles first: they read whole rows), in one process on one GPU, timed from CUDA-graph replays
(quant_breakdown.graph_ms), the two orders interleaved over three rounds (median). Every call's
outputs are compared first (SR too: the same counters give the same bits).
Run from the repo root, on 60d3977 with the experiment's patch (kernels.N_FIRST; not adopted):
git apply results/perf/session11/nfirst.patch && python results/perf/session11/nfirst.py
"""
import datetime, statistics, sys
import torch, triton
sys.path[:0] = [".", "scripts"]
import fp4, kernels
from quant_breakdown import graph_ms

print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
      f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
dst = torch.empty_like(big)
cbw = 4 * big.numel() / graph_ms(lambda: dst.copy_(big)) / 1e9
print(f"copy {cbw:.3f} TB/s (read + write)", flush=True)
n = big.numel()
SR = dict(rounding="sr", seed=1)
nv = fp4.FORMATS["nvfp4"]
x3 = big.view(1, 8192, 8192)
packed = 2 * n + n // 2 + n // 4
cases = [  # (label, bytes, fn)
    ("8192^2 ufp4 fake RHT16 row", 4 * n, lambda: kernels.fake_quant(big, "ufp4", rht=16)),
    ("8192^2 ufp4 fake RHT16 col", 4 * n, lambda: kernels.fake_quant(big, "ufp4", dim=0, rht=16)),
    ("8192^2 ufp4 SR RHT16 row", 4 * n, lambda: kernels.fake_quant(big, "ufp4", rht=16, **SR)),
    ("8192^2 ufp4 SR RHT16 col", 4 * n, lambda: kernels.fake_quant(big, "ufp4", dim=0, rht=16, **SR)),
    ("8192^2 nvfp4 fake RHT16 row", 4 * n, lambda: kernels.fake_quant(big, "nvfp4", rht=16)),
    ("8192^2 nvfp4 fake RHT16 col", 4 * n, lambda: kernels.fake_quant(big, "nvfp4", dim=0, rht=16)),
    ("8192^2 nvfp4 SR RHT16 col", 4 * n, lambda: kernels.fake_quant(big, "nvfp4", dim=0, rht=16, **SR)),
    ("8192^2 amax pass row RHT16", 2 * n, lambda: kernels._tensor_amax(x3, nv, 16, False)),
    ("8192^2 amax pass col RHT16", 2 * n, lambda: kernels._tensor_amax(x3, nv, 16, True)),
    ("8192^2 ufp4 packed row", packed, lambda: kernels.quantize(big, "ufp4")),
    ("8192^2 ufp4 packed col", packed, lambda: kernels.quantize(big, "ufp4", dim=0)),
    ("8192^2 mxfp4 packed row", packed - n // 8, lambda: kernels.quantize(big, "mxfp4")),
    ("8192^2 nvfp4 packed row", packed, lambda: kernels.quantize(big, "nvfp4")),
    ("8192^2 e2m1 fake RHT16 row", 4 * n, lambda: kernels.fake_quant(big, "e2m1", rht=16)),
    ("8192^2 mxfp4 fake RHT16 row", 4 * n, lambda: kernels.fake_quant(big, "mxfp4", rht=16)),
]
for w in (768, 2304, 3072, 4096):
    t = torch.randn(16384, w, device="cuda", dtype=torch.bfloat16)
    tn = t.numel()
    for f in ("ufp4", "nvfp4"):
        rr = 16 if f == "ufp4" else None
        cases += [
            (f"16384x{w} {f} x pair (fake row, packed col)", 2 * tn + 2 * tn + tn // 2 + tn // 4,
             (lambda t, f, rr: lambda: kernels.quantize_both(t, f, rht=rr, rht_col=16, packed=(False, True)))(t, f, rr)),
            (f"16384x{w} {f} dy pair SR", 6 * tn,
             (lambda t, f, rr: lambda: kernels.quantize_both(t, f, rounding="sr", rht=rr, rht_col=16, seed=1, seed_col=2))(t, f, rr)),
        ]
    cases += [(f"16384x{w} ufp4 x col packed alone", 2 * tn + tn // 2 + tn // 4,
               (lambda t: lambda: kernels.quantize(t, "ufp4", dim=0, rht=16))(t))]


def flat(out):
    if isinstance(out, (tuple, list)):
        return [v for o in out for v in flat(o)]
    if isinstance(out, fp4.QTensor):
        return [out.codes, out.scales] + ([out.tensor_scale] if out.tensor_scale is not None else [])
    return [out]


def run(order, fn):
    kernels.N_FIRST = order
    return fn()


bad = 0
for label, _, fn in cases:
    a, b = flat(run(False, fn)), flat(run(True, fn))
    same = len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
    bad += not same
    if not same:
        print(f"DIFFER: {label}", flush=True)
print(f"outputs equal in {len(cases) - bad} of {len(cases)} cases", flush=True)

print("| case | M first us | N first us | N first / M first | xcopy M first | xcopy N first |")
print("|---|---|---|---|---|---|")
for label, nbytes, fn in cases:
    times = {False: [], True: []}
    for _ in range(3):
        for order in (False, True):
            kernels.N_FIRST = order
            times[order].append(graph_ms(fn))
    m, nf = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
    print(f"| {label} | {m:.1f} | {nf:.1f} | {nf / m:.3f} | {nbytes / m / 1e6 / cbw:.3f} | {nbytes / nf / 1e6 / cbw:.3f} |", flush=True)
kernels.N_FIRST = False
