"""The packed GEMM main loop's barriers, loads, wgmma and waits for one format, from the SASS of the
local Triton (run under triton 3.6.0 for the GPU's compiler). Run from the repo root:
    python results/perf/session7/gemm_loop.py nvfp4"""
import re, sys
sys.path[:0] = ["scripts", "."]
import sass_count as S, kernels
fmt = sys.argv[1]
cfg = kernels._mm_config(8192, 8192, 8192)
lines, _ = S.disassemble(S.compile_mm(fmt, *cfg))
body = [l for l in S.main_loop(lines) if S.INSTRUCTION.match(l)]
print(fmt, "loop body", len(body), "instructions")
for n, l in enumerate(body):
    if re.search(r"BAR|LDG|HGMMA|DEPBAR|ARRIVE|LDS|STS|BRA", l):
        print(n, l.split("*/")[1].strip()[:70])
