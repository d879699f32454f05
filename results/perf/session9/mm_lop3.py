"""The packed GEMM's UFP4 dequantize at 8192^3: the kernel before (tmp_kernels_old.py =
`git show afc1c98:kernels.py`: and + or per nibble, 7.6 SASS instructions per dequantized
element) against this tree's (one lop3 per nibble, 6.6) and an experiment (tmp_kernels_ffma.py:
fma(2^23 + m, s, -2^23 s) instead of sub + mul, 5.7; wrong for block scales above 2^104, so not
for kernels.py), each with the dot before or after the next step's loads (DOT_FIRST); NVFP4 and
MXFP4, whose code is unchanged, as controls. Every variant's output is compared bit for bit with
the old kernel's. Timed from CUDA-graph replays (do_bench median, three interleaved rounds).
Run from the repo root at 7ccd0e9, after `python results/perf/session9/mm_sass.py --write .`
(which writes both tmp_kernels_*.py): python results/perf/session9/mm_lop3.py"""
import datetime, statistics, sys
import torch, triton
from triton.testing import do_bench
sys.path[:0] = ["."]
import kernels, tmp_kernels_old as old, tmp_kernels_ffma as ffma
from bench_kernels import graphed

print(f"`python {' '.join(sys.argv)}` {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
      f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
S = 8192
a = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
w = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)


def timed(f):
    return do_bench(graphed(f), warmup=25, rep=300, return_mode="median")


def dot_first(mod, flag):
    """mod.fp4_matmul with DOT_FIRST forced to flag (None: the module's own choice)."""
    orig = mod._mm_meta

    def call(qa, qb):
        if flag is not None:
            mod._mm_meta = lambda *x: {**orig(*x), "DOT_FIRST": flag}
        try:
            return mod.fp4_matmul(qa, qb, torch.bfloat16)
        finally:
            mod._mm_meta = orig
    return call


VARIANTS = [("old", old, None), ("lop3", kernels, None), ("lop3, dot first", kernels, True),
            ("ffma", ffma, None), ("ffma, dot first", ffma, True)]
times = {}
for rnd in range(3):
    times.setdefault("cuBLAS", []).append(timed(lambda: a @ w.t()))
    for name in ("ufp4", "nvfp4", "mxfp4"):
        qa, qw = kernels.quantize(a, name), kernels.quantize(w, name)
        ref = old.fp4_matmul(qa, qw, torch.bfloat16)
        for label, mod, flag in (VARIANTS if name == "ufp4" else VARIANTS[:2]):
            f = dot_first(mod, flag)
            if rnd == 0:
                eq = torch.equal(f(qa, qw).view(torch.int16), ref.view(torch.int16))
                times.setdefault((name, label, "equal"), eq)
            times.setdefault((name, label), []).append(timed(lambda: f(qa, qw)))
            print(rnd, name, label, f"{times[(name, label)][-1]:.4f} ms", flush=True)
cub = statistics.median(times["cuBLAS"])
print(f"\ncuBLAS bf16 {S}^3: {cub:.4f} ms (median of {times['cuBLAS']})")
print("| format | variant | ms (median of 3) | x cuBLAS | vs old | bit-equal to old |\n|---|---|---|---|---|---|")
for key, v in times.items():
    if key == "cuBLAS" or key[-1] == "equal":
        continue
    t, t_old = statistics.median(v), statistics.median(times[(key[0], "old")])
    print(f"| {key[0]} | {key[1]} | {t:.4f} | {cub / t:.3f} | {t_old / t:.3f} | {times[key + ('equal',)]} |")
