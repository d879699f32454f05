"""Stochastic rounding with 8 random bits per element (16 draws per Philox call) against 16 (8 per
call): kernels.SR_BITS = 16 and 8 in one process on one GPU, timed from CUDA-graph replays
(quant_breakdown.graph_ms), interleaved over three rounds (median). Rows: bench_kernels.py's SR
rows (with their RTNE calls, for the SR / RTNE ratio), the dy pairs of a GPT-2 layer (ufp4: SR +
RHT16 both sides; nvfp4: SR both sides, RHT16 on the column side), and FP4Linear fwd+bwd at 16k x
4096 -> 4096 against nn.Linear bf16.
Run from the repo root: python results/perf/session10/sr_bits.py
"""
import datetime, statistics, sys
import torch, triton
sys.path[:0] = [".", "scripts"]
import fp4, kernels
from quant_breakdown import graph_ms

print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
      f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
SR = dict(rounding="sr", seed=1)
cases = []  # (label, fn, uses SR)
for f in ("ufp4", "nvfp4"):
    for dim in (1, 0):
        cases.append((f"8192^2 {f} dim={dim} RHT16 RTNE", (lambda f, dim: lambda: kernels.fake_quant(big, f, dim=dim, rht=16))(f, dim), False))
        cases.append((f"8192^2 {f} dim={dim} RHT16 SR", (lambda f, dim: lambda: kernels.fake_quant(big, f, dim=dim, rht=16, **SR))(f, dim), True))
for w in (768, 2304, 3072):
    t = torch.randn(16384, w, device="cuda", dtype=torch.bfloat16)
    cases.append((f"16384x{w} ufp4 dy pair", (lambda t: lambda: kernels.quantize_both(
        t, "ufp4", rounding="sr", rht=16, rht_col=16, seed=1, seed_col=2))(t), True))
    cases.append((f"16384x{w} nvfp4 dy pair", (lambda t: lambda: kernels.quantize_both(
        t, "nvfp4", rounding="sr", rht=None, rht_col=16, seed=1, seed_col=2))(t), True))


def lin_step(mod, xin, dy):
    def f():
        xin.grad = None
        mod.weight.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mod(xin)
        y.backward(dy)
    return f


torch.manual_seed(0)
xin = torch.randn(16384, 4096, device="cuda").bfloat16().requires_grad_(True)
dyl = torch.randn(16384, 4096, device="cuda").bfloat16()
ref = torch.nn.Linear(4096, 4096, bias=False, device="cuda")
fp4.set_backend("triton")
for r in ("ufp4", "nvfp4"):
    lin = fp4.FP4Linear(4096, 4096, bias=False, recipe=r, device="cuda")
    cases.append((f"FP4Linear {r} 16k x 4096 fwd+bwd", lin_step(lin, xin, dyl), "lin"))

times = {label: {16: [], 8: []} for label, *_ in cases}
bf = []
for rnd in range(3):
    for label, fn, kind in cases:
        for bits in (16, 8):
            kernels.SR_BITS = bits
            times[label][bits].append(graph_ms(fn, reps=4 if kind == "lin" else 20))
    bf.append(graph_ms(lin_step(ref, xin, dyl), reps=4))
kernels.SR_BITS = 8
ms_bf = statistics.median(bf)
med = {label: {b: statistics.median(v) for b, v in d.items()} for label, d in times.items()}
print(f"nn.Linear bf16 fwd+bwd 16k x 4096: {ms_bf:.4f} ms\n")
print("| call | 16 bits us | 8 bits us | 8 / 16 | note |\n|---|---|---|---|---|")
for label, fn, kind in cases:
    m = med[label]
    note = ""
    if label.endswith(" SR"):
        rt = med[label[:-3] + " RTNE"]
        note = f"SR / RTNE {m[16] / rt[16]:.3f} -> {m[8] / rt[8]:.3f}"
    elif kind == "lin":
        note = f"x bf16 {ms_bf / m[16]:.3f} -> {ms_bf / m[8]:.3f}"
    print(f"| {label} | {m[16] * 1e3:.1f} | {m[8] * 1e3:.1f} | {m[8] / m[16]:.3f} | {note} |", flush=True)
