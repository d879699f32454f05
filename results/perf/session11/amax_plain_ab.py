"""NVFP4's amax pass with the plain side's max reduced per tile (this tree) against an elementwise
accumulator for it (tmp_kernels_old.py = `git show bb89b95:kernels.py`, in the repo root), in one
process on one GPU, timed from CUDA-graph replays (quant_breakdown.graph_ms), old and new
interleaved over three rounds (median). First every RTNE call's outputs are compared bit for bit.
Rows: the pair passes (row side plain, column side RHT16: an NVFP4 layer's x and dy) at GPT-2 and
16k x 4096 shapes and 8192^2, the pair calls themselves, and FP4Linear nvfp4 fwd+bwd at
16k x 4096 -> 4096 (against nn.Linear bf16 replayed the same way).
Run from the repo root: python results/perf/session11/amax_plain_ab.py
(amax_plain_ab.txt was run with the per-tile reduction beside row loads too; 9d1a420 keeps that
side elementwise, as before, so its "row RHT16 + col plain" rows would now read about 1.00.)
"""
import datetime, statistics, sys
import torch, triton
sys.path[:0] = [".", "scripts"]
import fp4, kernels, tmp_kernels_old as old
from quant_breakdown import graph_ms

print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
      f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
nv = fp4.FORMATS["nvfp4"]
big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
dst = torch.empty_like(big)
cbw = 4 * big.numel() / graph_ms(lambda: dst.copy_(big)) / 1e9
print(f"copy {cbw:.3f} TB/s (read + write)", flush=True)
n = big.numel()
SR = dict(rounding="sr", seed=1)
cases = []  # (label, bytes or None, fn(module), compare outputs)
for shape in ((16384, 768), (16384, 2304), (16384, 3072), (16384, 4096), (8192, 8192)):
    t = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    t3 = t.view(1, *t.shape)
    tn = t.numel()
    w = "x".join(map(str, shape))
    cases += [
        (f"{w} amax pass, pair (row plain, col RHT16)", 2 * tn,
         (lambda t3: lambda k: k._tensor_amax(t3, nv, None, False, col_rht=16))(t3), True),
        (f"{w} amax pass, row RHT16 + col plain (from the row loads)", 2 * tn,
         (lambda t3: lambda k: k._tensor_amax(t3, nv, 16, False, col_rht=0))(t3), True),
        (f"{w} x pair (fake row, packed col RHT16)", None, (lambda t: lambda k: k.quantize_both(
            t, "nvfp4", rht=None, rht_col=16, packed=(False, True)))(t), True),
        (f"{w} dy pair (SR row, SR col RHT16)", None, (lambda t: lambda k: k.quantize_both(
            t, "nvfp4", rounding="sr", rht=None, rht_col=16, seed=1, seed_col=2))(t), True),
    ]


def flat(v):
    if isinstance(v, (tuple, list)):
        return [u for e in v for u in flat(e)]
    if isinstance(v, fp4.QTensor):
        return [v.codes, v.scales] + ([v.tensor_scale] if v.tensor_scale is not None else [])
    return [v]


bad = 0
for label, _, fn, cmp in cases:
    if cmp:
        a, b = flat(fn(old)), flat(fn(kernels))
        ok = len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
        bad += not ok
        print(f"equal {ok}: {label}", flush=True)
print(f"outputs differing: {bad}", flush=True)


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
lin = fp4.FP4Linear(4096, 4096, bias=False, recipe="nvfp4", device="cuda")
fp4.set_backend("triton")


def lin_ms(k):
    sys.modules["kernels"] = k  # fp4.py imports kernels at call time
    try:
        return graph_ms(lin_step(lin, xin, dyl), reps=4)
    finally:
        sys.modules["kernels"] = kernels


times = {label: ([], []) for label, *_ in cases}
times["FP4Linear nvfp4 16k x 4096 fwd+bwd"] = ([], [])
bf = []
for rnd in range(3):
    for label, _, fn, _ in cases:
        for i, k in enumerate((old, kernels)):
            times[label][i].append(graph_ms(lambda: fn(k)))
    for i, k in enumerate((old, kernels)):
        times["FP4Linear nvfp4 16k x 4096 fwd+bwd"][i].append(lin_ms(k))
    bf.append(graph_ms(lin_step(ref, xin, dyl), reps=4))
ms_bf = statistics.median(bf)
nbytes = {label: b for label, b, *_ in cases}
print(f"\nnn.Linear bf16 fwd+bwd 16k x 4096: {ms_bf:.4f} ms\n")
print("| call | old us | new us | new / old | old xcopy | new xcopy |\n|---|---|---|---|---|---|")
for label, (o, nw) in times.items():
    mo, mn = statistics.median(o), statistics.median(nw)
    b = nbytes.get(label)
    if label.startswith("FP4Linear"):
        xc = f"{ms_bf / mo:.3f} x bf16 | {ms_bf / mn:.3f} x bf16"
    elif b:
        xc = f"{b / mo / 1e9 / cbw:.3f} | {b / mn / 1e9 / cbw:.3f}"
    else:
        xc = " | "
    print(f"| {label} | {mo * 1e3:.1f} | {mn * 1e3:.1f} | {mn / mo:.3f} | {xc} |", flush=True)
