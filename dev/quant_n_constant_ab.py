"""One-off A/B (GPU): the quantize kernel with its row length N a compile-time constant (kernels.py
at 2873871) against N a runtime argument (ce62b3f's kernels.py, beside it as tmp_kernels_old.py:
`git show ce62b3f:kernels.py > tmp_kernels_old.py`). Microseconds per call, CUDA-graph replay of 20
calls, best of 5, and whether both give the same bytes."""
import torch
import fp4
import kernels as new
import tmp_kernels_old as old


def graph_us(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(5):
        t0.record(); g.replay(); t1.record(); torch.cuda.synchronize()
        best = min(best, t0.elapsed_time(t1) * 1000 / reps)
    return best


def flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in flat(o)] if isinstance(out, (tuple, list)) else \
        [getattr(out, k) for k in ("codes", "scales") if isinstance(getattr(out, k, None), torch.Tensor)]


def same(a, b):
    fa, fb = flat(a), flat(b)
    return len(fa) == len(fb) and all(x.view(torch.uint8).equal(y.view(torch.uint8)) if x.dtype.itemsize == 1
                                      else torch.equal(x, y) for x, y in zip(fa, fb))


E4, E5 = fp4.E4M3, fp4.E5M2
seeds = torch.randint(0, 2**31, (2,), device="cuda")
cases = []
for n in (768, 3072):
    cases.append((f"mxfp4 FP8 x pair 16384x{n}", (16384, n), torch.bfloat16, "quantize_both",
                  dict(fmt="mxfp4", rht_col=16, packed=(False, True), fp8=(E4, None))))
for n in (768, 2304, 3072):
    cases.append((f"mxfp4 FP8 dy pair 16384x{n}", (16384, n), torch.bfloat16, "quantize_both",
                  dict(fmt="mxfp4", rounding="sr", rht_col=16, seed=seeds[0], seed_col=seeds[1], fp8=(E5, E5))))
for n in (768, 3072):
    cases.append((f"ufp4 x pair 16384x{n}", (16384, n), torch.bfloat16, "quantize_both",
                  dict(fmt="ufp4", rht_col=16, packed=(False, True))))
for n in (2304, 3072):
    cases.append((f"ufp4 dy pair SR 16384x{n}", (16384, n), torch.bfloat16, "quantize_both",
                  dict(fmt="ufp4", rounding="sr", rht=16, seed=seeds[0], seed_col=seeds[1])))
    cases.append((f"e2m1 dy column SR 16384x{n}", (16384, n), torch.bfloat16, "fake_quant",
                  dict(fmt="e2m1", dim=0, rounding="sr", rht=16, seed=seeds[0])))
cases.append(("mxfp4 W pair fp32 3072x768", (3072, 768), torch.float32, "quantize_both",
              dict(fmt="mxfp4", rht_col=16, fp8=(E4, E4))))

rows = []
for name, shape, dtype, fn, kw in cases:
    t = torch.randn(*shape, device="cuda", dtype=dtype)
    f_old, f_new = getattr(old, fn), getattr(new, fn)
    eq = same(f_old(t, **kw), f_new(t, **kw))
    rows.append((name, graph_us(lambda: f_old(t, **kw)), graph_us(lambda: f_new(t, **kw)), eq))
print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__)
print("| launch | N runtime us | N constant us | ratio | same bytes |\n|---|---|---|---|---|")
for name, a, b, eq in rows:
    print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.3f} | {eq} |")
