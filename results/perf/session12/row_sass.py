"""SASS instructions per element of the row-wise RTNE fake-quant kernels at 8192^2's default
tile (2 x 2048, 4 warps), with and without RHT16, for ufp4 / e2m1 / mxfp4, and MXFP4's in load
modes 0 (the default: half-groups joined), 2 (whole 32-groups per thread) and 1 (plain loads);
compiled locally for sm_90 by scripts/sass_count.py. Run from the repo root:
python results/perf/session12/row_sass.py"""
import sys
sys.path[:0] = ["scripts", "."]
import sass_count as s

LAUNCHES = [("ufp4", 16, 0), ("ufp4", None, 0), ("e2m1", 16, 0), ("e2m1", None, 0),
            ("mxfp4", 16, 0), ("mxfp4", None, 0), ("mxfp4", 16, 2), ("mxfp4", None, 2), ("mxfp4", 16, 1)]
print("| format | RHT | load mode | instructions / element | registers | top opcodes per element |")
print("|---|---|---|---|---|---|")
for fmt, rht, mode in LAUNCHES:
    BM, BN, nw = 2, 2048, 4
    ops, regs = s.sass(s.compile_quant((fmt, "rtne", rht, False), None, BM, BN, nw, mode))
    per = BM * BN / (nw * 32)
    print(f"| {fmt} | {rht} | {mode} | {sum(ops.values()) / per:.1f} | {regs} | "
          + ", ".join(f"{k} {v / per:.2f}" for k, v in ops.most_common(18)) + " |")
