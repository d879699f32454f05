"""The packed GEMM main loop's barriers, loads, wgmma and waits for one format, from the SASS of the
local Triton (run under triton 3.6.0 for the GPU's compiler). Run from the repo root:
    python results/perf/session7/gemm_loop.py nvfp4"""
import os, re, subprocess, sys, tempfile
sys.path[:0] = ["scripts", "."]
import sass_count as S, kernels
fmt = sys.argv[1]
cfg = kernels._mm_config(8192, 8192, 8192)
k = S.compile_mm(fmt, *cfg)
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(k.asm["cubin"])
text = subprocess.run([S.BIN + "/nvdisasm", "-c", f.name], capture_output=True, text=True).stdout
os.unlink(f.name)
lines = text.splitlines()
ends = [(i, m.group(1)) for i, l in enumerate(lines) if (m := re.search(r"BRA `\((\.L_x_\d+)\)", l))]
back = [(lines.index(lab + ":"), i) for i, lab in ends if lab + ":" in lines and lines.index(lab + ":") < i]
a, b = max(back, key=lambda t: t[1] - t[0])
body = [l for l in lines[a:b + 1] if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
print(fmt, "loop body", len(body), "instructions")
for n, l in enumerate(body):
    if re.search(r"BAR|LDG|HGMMA|DEPBAR|ARRIVE|LDS|STS|BRA", l):
        print(n, l.split("*/")[1].strip()[:70])
