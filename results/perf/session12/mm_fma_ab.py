"""The packed GEMM's int4 dequantize (UFP4, nvint4) as one FMA per element: f = 2^23 + m by its
bits, then fma(f, s, -2^23 s) = RN(m s) (tmp_kernels_fma.py, in the repo root: kernels.py with
that change and a switch UFP4_DOT_FIRST) against subtract + multiply (this tree's kernels.py).
fp4_matmul at 8192^3, outputs compared bit for bit, timed from CUDA-graph replays against
cuBLAS bf16 in the same process, old and new interleaved over three rounds (median).
Run from the repo root: python results/perf/session12/mm_fma_ab.py
"""
import datetime, statistics, sys
import torch, triton
sys.path[:0] = [".", "scripts"]
import kernels, tmp_kernels_fma as fma
from quant_breakdown import graph_ms

print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
      f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
S = 8192
torch.manual_seed(0)
a = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
b = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
flops = 2 * S ** 3
print("| format | variant | ms | x cuBLAS bf16 |\n|---|---|---|---|", flush=True)
for f in ("ufp4", "nvint4"):
    qa, qb = kernels.quantize(a, f, rht=16), kernels.quantize(b, f, rht=16)
    ref = kernels.fp4_matmul(qa, qb)
    variants = [("sub + mul (kernels.py)", kernels, False), ("fma", fma, False), ("fma, dot first", fma, True)]
    for name, mod, df in variants:
        if mod is fma:
            fma.UFP4_DOT_FIRST = df
        out = mod.fp4_matmul(qa, qb)
        assert torch.equal(out, ref), (f, name)
    ts = {name: [] for name, _, _ in variants}
    ts["cublas"] = []
    for _ in range(3):
        ts["cublas"].append(graph_ms(lambda: a @ b.t(), reps=5))
        for name, mod, df in variants:
            if mod is fma:
                fma.UFP4_DOT_FIRST = df
            ts[name].append(graph_ms(lambda: mod.fp4_matmul(qa, qb), reps=5))
    cb = statistics.median(ts["cublas"])
    for name, _, _ in variants:
        ms = statistics.median(ts[name])
        print(f"| {f} | {name} | {ms:.3f} | {cb / ms:.3f} |", flush=True)
    print(f"| {f} | cuBLAS bf16 | {cb:.3f} | 1.000 ({flops / cb / 1e9:.0f} TFLOP/s) |", flush=True)
print("outputs bit-equal to kernels.py's in every variant")
