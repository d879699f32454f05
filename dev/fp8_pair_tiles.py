"""One-off: tiles of the FP8-path pair quantize (quantize_both), x (e4m3 row + packed col RHT16) and dy
(e5m2 both, SR, col RHT16), mxfp4; us per call in graph replay; every tile's output checked bit for bit
against the default tile's."""
import sys, time, torch, fp4, kernels
from bench_kernels import graphed
from triton.testing import do_bench
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
t0 = time.time()
def t(fn, reps=10):
    g = graphed(lambda: [fn() for _ in range(reps)])
    return do_bench(g, warmup=5, rep=60, return_mode="median") / reps * 1000
def flat(out):
    r = []
    for o in out:
        if isinstance(o, tuple): r += [v for v in o]
        elif isinstance(o, fp4.QTensor): r += [o.codes, o.scales]
        else: r.append(o)
    return [v.view(torch.uint8) if v.dtype in (E4, E5) else v for v in r]
sigs = {"x": lambda x, cfg: kernels.quantize_both(x, "mxfp4", "mxfp4", "rtne", "rtne", None, 16, 0, 0, (False, True), torch.bfloat16, (E4, None), _cfg=cfg),
        "dy": lambda x, cfg: kernels.quantize_both(x, "mxfp4", "mxfp4", "sr", "sr", None, 16, 11, 12, False, torch.bfloat16, (E5, E5), _cfg=cfg)}
cfgs = [None, (64, 64, 4), (64, 128, 8), (32, 128, 4), (32, 256, 4), (32, 256, 8), (64, 128, 4), (64, 256, 8), (128, 64, 4), (128, 64, 8), (128, 128, 8)]
print("pair shape | " + " | ".join(map(str, cfgs)), flush=True)
for name, N in (("x", 768), ("dy", 768), ("x", 3072), ("dy", 3072)):
    x = torch.randn(16384, N, device="cuda", dtype=torch.bfloat16)
    ref = flat(sigs[name](x, None))
    row = []
    for cfg in cfgs:
        if time.time() - t0 > float(sys.argv[1]):
            row.append("-"); continue
        got = flat(sigs[name](x, cfg))
        same = all(torch.equal(a, b) for a, b in zip(got, ref))
        row.append(f"{t(lambda: sigs[name](x, cfg)):.1f}{'' if same else ' DIFF'}")
    print(f"{name} 16384x{N} | " + " | ".join(row), flush=True)
