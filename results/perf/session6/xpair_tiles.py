"""Session 6's one-off tile sweep (xpair_tiles.txt): UFP4's x pair (fake row + packed column, RHT 16)
and the packed column side alone, under several (BM, BN, num_warps, load mode), from CUDA-graph
replays. Run from the repo root: python results/perf/session6/xpair_tiles.py"""
import sys, torch, datetime, triton
sys.path[:0] = [".", "scripts"]
import fp4, kernels
from quant_breakdown import graph_ms
r = fp4.get_recipe("ufp4") if hasattr(fp4, "get_recipe") else fp4.RECIPES["ufp4"]
fmt = fp4.get_format(r.fprop.fmt)
rr = r.rht_size if r.fprop.rht else None
rc = r.rht_size if r.wgrad.rht else None
print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; fmt {fmt.name} rht row {rr} col {rc}")
a = torch.empty(2**28, device="cuda", dtype=torch.uint8); b = torch.empty_like(a)
ms = graph_ms(lambda: b.copy_(a)); bw = 2 * a.numel() / (ms * 1e-3) / 1e12
print(f"copy {bw:.2f} TB/s")
for n in (768, 3072):
    x = torch.randn(16384, n, device="cuda", dtype=torch.bfloat16)
    for cfg in [None, (64, 64, 4, 1), (128, 32, 4, 1), (128, 64, 4, 1), (128, 64, 8, 1), (64, 128, 8, 1),
                (64, 64, 2, 1), (32, 64, 2, 1), (128, 128, 8, 1), (256, 32, 8, 1)]:
        try:
            ms = graph_ms(lambda: kernels.quantize_both(x, fmt, rounding="rtne", rht=rr, rht_col=rc,
                                                        packed=(False, True), dtype=torch.bfloat16, _cfg=cfg))
            ms2 = graph_ms(lambda: kernels.quantize(x, fmt, dim=0, rounding="rtne", rht=rc, _cfg=cfg))
        except Exception as e:
            print(f"| {n} | {cfg} | {type(e).__name__}: {str(e)[:80]} |"); continue
        pair_bytes = x.numel() * (2 + 2 + 0.5 + 0.25)
        col_bytes = x.numel() * (2 + 0.5 + 0.25)
        print(f"| {n} | {cfg} | pair {ms*1e3:.1f} us {pair_bytes/(ms*1e-3)/1e12/bw:.2f} | col packed alone {ms2*1e3:.1f} us {col_bytes/(ms2*1e-3)/1e12/bw:.2f} |", flush=True)
