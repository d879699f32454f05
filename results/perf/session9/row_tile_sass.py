"""Instructions per element and registers of sass_count's row-only launches at the old default row
tile (8 x 512) and the new wide ones (4 x 1024, 2 x 2048; mode 2 for MXFP4's packed and SR), compiled
for sm_90 by the local Triton: the wide tiles run the same code per element.
Run from the repo root (with triton 3.6.0, the GPU's): python results/perf/session9/row_tile_sass.py"""
import sys
sys.path[:0] = ["scripts", "."]
import triton
import sass_count as sc

print(f"`python {' '.join(sys.argv)}`, triton {triton.__version__}, sm_90")
print("| launch | tile | instructions / element | registers |\n|---|---|---|---|")
for name, row, col, _ in sc.LAUNCHES:
    if col is None:
        for t in ((8, 512, 4, 0), (4, 1024, 4, 0), (2, 2048, 4, 0), (8, 512, 4, 2), (4, 1024, 4, 2), (2, 2048, 4, 2)):
            if t[3] == 2 and "mxfp4" not in name:
                continue
            ops, regs = sc.sass(sc.compile_quant(row, col, *t))
            print(f"| {name} | {t} | {sum(ops.values()) / (t[0] * t[1] / (t[2] * 32)):.1f} | {regs} |")
