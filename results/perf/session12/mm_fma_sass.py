"""SASS of the packed GEMM's main loop (ufp4, the 8192^3 tile) for kernels.py and for the FMA
variant (tmp_kernels_fma.py = kernels.py + mm_fma.patch, in the repo root), compiled locally for
sm_90 by scripts/sass_count.py's compile_mm. Run from the repo root:
python results/perf/session12/mm_fma_sass.py"""
import sys
sys.path[:0] = ["scripts", "."]
import sass_count as s
import kernels
import tmp_kernels_fma as kf

for mod in (kernels, kf):
    s.kernels = mod
    for df in (False, True):
        if mod is kf:
            kf.UFP4_DOT_FIRST = df
        elif df:
            continue
        cfg = mod._mm_config(8192, 8192, 8192)
        BM, BN, BK, _, nw, _ = cfg
        ops, regs = s.sass(s.compile_mm("ufp4", *cfg), loop=True)
        per = (BM + BN) * BK / (nw * 32)
        print(mod.__name__, "DOT_FIRST", df, round(sum(ops.values()) / per, 2), regs, ops["HGMMA"],
              ", ".join(f"{k} {v / per:.2f}" for k, v in ops.most_common(12)))
