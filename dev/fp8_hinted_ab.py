"""One-off A/B (GPU), run at tree ed0db86 with 19d72d9's kernels.py beside it as tmp_kernels_old.py: the quantize launches of the FP8 layer before (amax pass, then quantize) and
after (hinted first pass + persistent second pass), and the ufp4 dy pair's kernel, in CUDA-graph
replay: microseconds per call."""
import sys
import torch
import fp4
import kernels as new
import tmp_kernels_old as old

def graph_us(fn, reps=20):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(5):
        t0.record(); g.replay(); t1.record(); torch.cuda.synchronize()
        best = min(best, t0.elapsed_time(t1) * 1000 / reps)
    return best

dev = "cuda"
rows = []
E4, E5 = fp4.E4M3, fp4.E5M2
for kind, shape in (("x", (16384, 768)), ("x", (16384, 3072)), ("dy", (16384, 2304)), ("dy", (16384, 768)), ("dy", (16384, 3072))):
    t = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
    seeds = torch.randint(0, 2**31, (2,), device=dev)
    if kind == "x":
        kw = dict(fmt="mxfp4", rht_col=16, packed=(False, True), fp8=(E4, None))
    else:
        kw = dict(fmt="mxfp4", rounding="sr", rht_col=16, seed=seeds[0], seed_col=seeds[1], fp8=(E5, E5))
    h = fp4.new_fp8_hint(dev)
    def hinted():
        out = new.quantize_both(t, hint=h, **kw)
        h.copy_(out[-1])
    t_old = graph_us(lambda: old.quantize_both(t, **kw))
    t_new_exact = graph_us(lambda: new.quantize_both(t, **kw))
    t_new = graph_us(hinted)
    rows.append((f"mxfp4 FP8 {kind} pair {shape}", t_old, t_new_exact, t_new, h.tolist()))
for shape in ((16384, 2304), (16384, 3072)):
    t = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
    seeds = torch.randint(0, 2**31, (2,), device=dev)
    kw = dict(fmt="ufp4", rounding="sr", rht=16, seed=seeds[0], seed_col=seeds[1])
    rows.append((f"ufp4 dy pair SR {shape}", graph_us(lambda: old.quantize_both(t, **kw)),
                 graph_us(lambda: new.quantize_both(t, **kw)), float("nan"), ""))
    kw = dict(fmt="ufp4", rht_col=16, packed=(False, True))
    rows.append((f"ufp4 x pair {shape}", graph_us(lambda: old.quantize_both(t, **kw)),
                 graph_us(lambda: new.quantize_both(t, **kw)), float("nan"), ""))
print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__)
print("| launch set | before us | now, exact scale us | now, hinted us | hint state after |")
print("|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.1f} | {r[4]} |")
