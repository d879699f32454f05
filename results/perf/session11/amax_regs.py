"""Registers per thread and SASS instructions of NVFP4's amax pass, compiled for sm_90 without a
GPU (scripts/sass_count.py's compile path: arguments aligned and sizes divisible by 16, as the
GPU launch specializes them), for this tree's kernels.py and tmp_kernels_old.py
(`git show bb89b95:kernels.py`, in the repo root): column loads with a plain row side (an NVFP4
pair), column loads alone, row loads with a plain column side, row loads alone.
Run from the repo root: python results/perf/session11/amax_regs.py
"""
import sys
sys.path[:0] = [".", "scripts"]
import triton
import kernels, tmp_kernels_old
from sass_count import compile_sm, _types, disassemble

print(f"`python {' '.join(sys.argv)}`: triton {triton.__version__}, sm_90, 4 warps")
print("| pass | tile (BM, BN, tiles) | old registers | new registers | old SASS lines | new SASS lines |")
print("|---|---|---|---|---|---|")
PLANS = [("column loads RHT16 + plain row side (pair)", ((False, None), (True, 16)), True, 128, 64, 1, 1),
         ("column loads RHT16 alone", ((False, None), (True, 16)), False, 128, 64, 1, 1),
         ("row loads RHT16 + plain column side", ((True, 16), (False, None)), True, 2, 2048, 4, 0),
         ("row loads RHT16 alone", ((True, 16), (False, None)), False, 2, 2048, 4, 0)]
for label, sides, plain, BM, BN, tiles, mode in PLANS:
    got = []
    for k in (tmp_kernels_old, kernels):
        meta, _ = k._amax_meta(sides, (16, 16), plain, BM, BN, tiles, True, mode, 4)
        fn = k._amax_kernel
        ptr = {"x_ptr": "*bf16", "r_part": "*i32", "c_part": "*i32"}
        c = compile_sm(fn, meta, _types(fn, ("M", "N"), ptr, "*fp32"), dict(num_warps=4, enable_fp_fusion=False))
        lines, regs = disassemble(c)
        got.append((regs, len(lines)))
    print(f"| {label} | {BM}, {BN}, {tiles} | {got[0][0]} | {got[1][0]} | {got[0][1]} | {got[1][1]} |")
