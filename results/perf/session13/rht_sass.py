"""SASS instructions per element of the row-wise quantize kernels behind bench_kernels' RHT on/off
and packed rows (8192^2, 2 x 2048 tiles; row load mode 0, and mode 2 for MXFP4 packed as kernels._run
takes it), compiled for sm_90 by the local Triton (no
GPU): what the RHT adds, and the packed kernels' counts. The H200 issues 4 warp instructions per
clock per SM (132 SMs, 1.98 GHz): at the measured copy bandwidth (3.93 TB/s) that is about 34
instructions per element for a bf16 -> bf16 op (4 bytes) and 22 for a packed quantize (2.625
bytes for MXFP4), before stalls.
Run from the repo root: python results/perf/session13/rht_sass.py"""
import sys
import triton
sys.path.insert(0, "scripts")
import sass_count as S

print(f"`python {' '.join(sys.argv)}` triton {triton.__version__}, sm_90")
print("| format | output | RHT | load mode | instructions / element | registers | top opcodes / element |\n|---|---|---|---|---|---|---|")
per = 2 * 2048 / 128
for fmt, packed in (("ufp4", False), ("e2m1", False), ("mxfp4", False), ("ufp4", True), ("mxfp4", True)):
    for rht in ((16, None) if not packed else (None,)):
        mode = 2 if fmt == "mxfp4" and packed else 0
        ops, regs = S.sass(S.compile_quant((fmt, "rtne", rht, packed), None, 2, 2048, 4, mode))
        top = ", ".join(f"{k} {v / per:.1f}" for k, v in ops.most_common(6))
        print(f"| {fmt} | {'packed' if packed else 'fake bf16'} | {rht or '-'} | {mode} | {sum(ops.values()) / per:.1f} | {regs} | {top} |")
