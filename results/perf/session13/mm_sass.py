"""The packed GEMM's main loop in SASS, compiled for sm_90 by the local Triton (no GPU needed):
instructions per dequantized element, registers, and the loop's loads, shared-memory traffic,
barriers and register spills (LDL / STL), per format at kernels.fp4_matmul's 8192^3 tile.
Run from the repo root: python results/perf/session13/mm_sass.py"""
import sys
import triton
sys.path.insert(0, "scripts")
import sass_count as S

print(f"`python {' '.join(sys.argv)}` triton {triton.__version__}, sm_90")
print("| format | tile (BM, BN, BK, GROUP_M, warps, stages) | per element | registers | LDG | UTMALDG | LDS | STS | BAR | HGMMA | LDL | STL | shared memory KB |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for fmt in ("ufp4", "nvfp4", "mxfp4", "nvint4", "mxint4"):
    cfg = S.mm_config(fmt)
    k = S.compile_mm(fmt, *cfg)
    ops, regs = S.sass(k, loop=True)
    BM, BN, BK, _, nw, _ = cfg
    per = (BM + BN) * BK / (nw * 32)
    cols = " | ".join(str(ops[o]) for o in ("LDG", "UTMALDG", "LDS", "STS", "BAR", "HGMMA", "LDL", "STL"))
    print(f"| {fmt} | {cfg} | {sum(ops.values()) / per:.1f} | {regs} | {cols} | {k.metadata.shared / 1024:.0f} |")
