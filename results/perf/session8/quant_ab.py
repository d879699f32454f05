"""Session 8's quantize A/B: this tree's kernels.py against tmp_kernels_old.py (`git show
<commit>:kernels.py`, run from the repo root) on one GPU in one process, 8192 x 8192 bf16, timed
with triton.testing.do_bench (median, L2 cleared) as bench_kernels.py does; xcopy = the bytes the
op must read + write per second / the device copy's (torch clone) in the same run. Column tiles:
COL_TILES="BM,BN,warps ..." (the column side's tile override, new kernels only); row load mode 2
forced on RTNE fake rows (new kernels only)."""
import datetime, os, sys, torch, triton
from triton.testing import do_bench
sys.path[:0] = ["."]
import kernels, tmp_kernels_old as old

print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC {torch.cuda.get_device_name()} "
      f"torch {torch.__version__} triton {triton.__version__}")
S = 8192
n = S * S
x = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
ms_copy = do_bench(lambda: x.clone(), rep=200)
cbw = 4 * n / ms_copy / 1e9
print(f"copy {ms_copy:.4f} ms = {cbw:.3f} TB/s")
fake_b = 4 * n  # bytes: bf16 in + out; packed: bf16 in + codes + 4-byte-counted scales, as bench_kernels
packed_b = {16: 2 * n + n // 2 + 4 * n // 16, 32: 2 * n + n // 2 + 4 * n // 32}
cases = [  # (what, bytes, fn(module)): bench_kernels.py's rows, then RHT / SR variants
    ("mxfp4 row fake RHT16", fake_b, lambda k: k.fake_quant(x, "mxfp4", rht=16)),
    ("mxfp4 row fake no RHT", fake_b, lambda k: k.fake_quant(x, "mxfp4")),
    ("mxfp4 row packed", packed_b[32], lambda k: k.quantize(x, "mxfp4")),
    ("mxfp4 col packed", packed_b[32], lambda k: k.quantize(x, "mxfp4", dim=0)),
    ("mxfp4 col fake RHT32", fake_b, lambda k: k.fake_quant(x, "mxfp4", dim=0, rht=32)),
    ("nvfp4 row packed (amax pass incl.)", packed_b[16], lambda k: k.quantize(x, "nvfp4")),
    ("nvfp4 col packed (amax pass incl.)", packed_b[16], lambda k: k.quantize(x, "nvfp4", dim=0)),
    ("e2m1 row fake RHT16", fake_b, lambda k: k.fake_quant(x, "e2m1", rht=16)),
    ("ufp4 row fake RHT16", fake_b, lambda k: k.fake_quant(x, "ufp4", rht=16)),
    ("mxfp4 row packed RHT16", packed_b[32], lambda k: k.quantize(x, "mxfp4", rht=16)),
    ("mxfp4 row SR RHT16", fake_b, lambda k: k.fake_quant(x, "mxfp4", rounding="sr", rht=16, seed=1)),
    ("mxfp4 col fake RHT16", fake_b, lambda k: k.fake_quant(x, "mxfp4", dim=0, rht=16)),
    ("mxfp4 col SR RHT16", fake_b, lambda k: k.fake_quant(x, "mxfp4", dim=0, rounding="sr", rht=16, seed=1)),
]
rows = []
for what, nbytes, fn in cases:
    t_old = do_bench(lambda: fn(old), rep=200)
    t_new = do_bench(lambda: fn(kernels), rep=200)
    rows.append((what, t_old, t_new, nbytes))
    print(f"{what}: old {t_old:.4f} ms new {t_new:.4f} ms", flush=True)
mode2 = (8, 512, 4, 2)  # row load mode 2 forced (whole 32-groups per thread), new kernels only
for what, nbytes, fn in (("mxfp4 row fake RHT16, mode 2", fake_b, lambda: kernels.fake_quant(x, "mxfp4", rht=16, _cfg=mode2)),
                         ("mxfp4 row fake no RHT, mode 2", fake_b, lambda: kernels.fake_quant(x, "mxfp4", _cfg=mode2))):
    t = do_bench(fn, rep=200)
    rows.append((what, None, t, nbytes))
    print(f"{what}: {t:.4f} ms", flush=True)
for tile in os.environ.get("COL_TILES", "").split():
    cfg = tuple(int(v) for v in tile.split(","))
    for what, nbytes, fn in (("mxfp4 col fake RHT16", fake_b, lambda: kernels.fake_quant(x, "mxfp4", dim=0, rht=16, _cfg=cfg)),
                             ("mxfp4 col SR RHT16", fake_b, lambda: kernels.fake_quant(x, "mxfp4", dim=0, rounding="sr", rht=16, seed=1, _cfg=cfg))):
        t = do_bench(fn, rep=200)
        rows.append((f"{what} tile {cfg}", None, t, nbytes))
        print(f"{what} tile {cfg}: {t:.4f} ms", flush=True)
print(f"\n| what | old ms | new ms | old xcopy | new xcopy | new / old time |\n|---|---|---|---|---|---|")
for what, t_old, t_new, nb in rows:
    xo = f"{nb / t_old / 1e9 / cbw:.3f}" if t_old else ""
    print(f"| {what} | {t_old or 0:.4f} | {t_new:.4f} | {xo} | {nb / t_new / 1e9 / cbw:.3f} | "
          f"{(t_new / t_old) if t_old else float('nan'):.3f} |")
