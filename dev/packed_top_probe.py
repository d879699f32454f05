# one-off probe (GPU): fp8_from_packed over the wide 24 x 2048 model's cached weights, mxfp4, both
# orientations of its four linears, with the largest block scale found in each call (a flat max
# over the block scales) and given (the packed cache keeps it); CUDA-graph replays.
# Run: PYTHONPATH=. python dev/packed_top_probe.py
import torch, fp4, kernels
torch.manual_seed(0)
shapes = [(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)]
qs = []
for s in shapes:
    w = torch.randn(s, device="cuda") * 0.02
    for dim in (-1, 0):
        q = kernels.quantize(w, "mxfp4", dim=dim)
        qs.append((q, fp4.largest_block_scale(q)))
def run(given):
    for q, top in qs:
        kernels.fp8_from_packed(q, fp4.E4M3, top if given else None)
res = {}
for given in (False, True, False, True):
    run(given); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(given)
    for _ in range(5): g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(50): g.replay()
    b.record(); torch.cuda.synchronize()
    res.setdefault(given, []).append(a.elapsed_time(b) / 50 * 1000)
for given, t in res.items():
    print(f"top {'given' if given else 'found'}: {t[0]:.1f}, {t[1]:.1f} us per layer's 8 conversions (4 linears x 2 orientations); x24 layers = {min(t)*24/1000:.3f} ms a micro-step")
