"""NVFP4's quantize kernel taking its tiles in reverse launch order (this tree's kernels.py: the
tensor-amax pass has just read x in launch order, so the first tiles are still in L2) against
launch order (tmp_kernels_old.py = `git show 01d358b:kernels.py`, in the repo root), in one
process on one GPU, timed from CUDA-graph replays (quant_breakdown.graph_ms), old and new
interleaved over three rounds (median). Each call's outputs are compared bit for bit first.
Then FP4Linear nvfp4 fwd+bwd (bf16 autocast) with each module as fp4.py's `kernels`.
Run from the repo root: python results/perf/session12/nvfp4_reverse_ab.py
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
n = big.numel()
cases = [("8192^2 nvfp4 row fake RHT16", 4 * n, lambda k: k.fake_quant(big, "nvfp4", rht=16)),
         ("8192^2 nvfp4 row fake", 4 * n, lambda k: k.fake_quant(big, "nvfp4")),
         ("8192^2 nvfp4 col fake", 4 * n, lambda k: k.fake_quant(big, "nvfp4", dim=0)),
         ("8192^2 nvfp4 row packed", 2.5625 * n, lambda k: k.quantize(big, "nvfp4")),
         ("8192^2 nvint4 row fake RHT16", 4 * n, lambda k: k.fake_quant(big, "nvint4", rht=16))]
for w in (768, 2304, 3072):
    t = torch.randn(16384, w, device="cuda", dtype=torch.bfloat16)
    cases += [(f"16384x{w} nvfp4 x pair (row fake, col packed RHT16)", (4 + 0.5625) * t.numel(),
               (lambda t: lambda k: k.quantize_both(t, "nvfp4", rht=None, rht_col=16, packed=(False, True)))(t)),
              (f"16384x{w} nvfp4 dy pair (SR; col RHT16)", 6 * t.numel(),
               (lambda t: lambda k: k.quantize_both(t, "nvfp4", rounding="sr", rounding_col="sr", rht=None,
                                                    rht_col=16, seed=1, seed_col=2))(t))]
def outputs(r):
    """Every tensor of a result: fake values, or a QTensor's codes, scales and tensor scale."""
    if isinstance(r, (tuple, list)):
        return [t for x in r for t in outputs(x)]
    if isinstance(r, torch.Tensor):
        return [r]
    return [r.codes, r.scales] + ([r.tensor_scale] if r.tensor_scale is not None else [])


for label, _, fn in cases:
    a, b = outputs(fn(old)), outputs(fn(kernels))
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), label
print(f"every output (fake values; codes, scales, tensor scale) equal in all {len(cases)} cases", flush=True)
print("| case | launch order us | reverse us | new / old | xcopy old | xcopy new |\n|---|---|---|---|---|---|")
for label, nbytes, fn in cases:
    ts = {old: [], kernels: []}
    for _ in range(3):
        for k in (old, kernels):
            ts[k].append(graph_ms(lambda: fn(k)))
    o, nw = statistics.median(ts[old]) * 1000, statistics.median(ts[kernels]) * 1000
    print(f"| {label} | {o:.1f} | {nw:.1f} | {nw / o:.3f} | {nbytes / (o * 1e-6) / 1e12 / cbw:.3f} | "
          f"{nbytes / (nw * 1e-6) / 1e12 / cbw:.3f} |", flush=True)

print("\n| FP4Linear fwd+bwd (graph replay) | bf16 nn.Linear us | launch order x bf16 | reverse x bf16 |\n|---|---|---|---|")
for T, IN, OUT in ((16384, 4096, 4096), (16384, 768, 3072), (16384, 3072, 768)):
    torch.manual_seed(0)
    xin = torch.randn(T, IN, device="cuda").bfloat16().requires_grad_(True)
    dy = torch.randn(T, OUT, device="cuda").bfloat16()

    def step(mod):
        def f():
            xin.grad = None
            mod.weight.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = mod(xin)
            y.backward(dy)
        return f
    ref = torch.nn.Linear(IN, OUT, bias=False, device="cuda")
    lin = fp4.FP4Linear(IN, OUT, bias=False, recipe="nvfp4", device="cuda")
    ts = {"bf16": [], old: [], kernels: []}
    for _ in range(3):
        ts["bf16"].append(graph_ms(step(ref), reps=5))
        for k in (old, kernels):
            sys.modules["kernels"] = k
            ts[k].append(graph_ms(step(lin), reps=5))
    sys.modules["kernels"] = kernels
    bf, o, nw = (statistics.median(ts[k]) for k in ("bf16", old, kernels))
    print(f"| {T}x{IN}->{OUT} | {bf * 1000:.0f} | {bf / o:.3f} | {bf / nw:.3f} |", flush=True)
