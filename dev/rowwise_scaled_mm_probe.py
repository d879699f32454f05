"""One-off: torch._scaled_mm with per-row scales against per-tensor scales and bf16, dense GPT-2-small shapes."""
import torch
from bench_kernels import graphed
from triton.testing import do_bench
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2

def t(fn, reps=10):
    g = graphed(lambda: [fn() for _ in range(reps)])
    return do_bench(g, warmup=10, rep=200, return_mode="median") / reps * 1000

print("M K N | bf16 us | tensor e4e4 | row e4e4 | tensor e5e4 | row e5e4 (vs bf16 speedups)")
for M, K, N in ((16384, 768, 2304), (16384, 768, 768), (16384, 768, 3072), (16384, 3072, 768)):
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    bf = t(lambda: a @ b.t())
    res = [f"{bf:.1f}"]
    one = torch.ones((), device="cuda")
    for fa in (E4, E5):
        a8, b8 = a.to(fa), b.to(E4).t()
        sa, sb = torch.rand(M, 1, device="cuda") + 0.5, torch.rand(1, N, device="cuda") + 0.5
        for name, args in (("tensor", (one, one)), ("row", (sa, sb))):
            try:
                f = lambda: torch._scaled_mm(a8, b8, args[0], args[1], out_dtype=torch.bfloat16, use_fast_accum=False)
                ref = (a8.float() * args[0]) @ (b8.float() * args[1])
                err = ((f().float() - ref).abs().max() / ref.abs().max()).item()
                us = t(f)
                res.append(f"{name} {fa}: {us:.1f} ({bf/us:.2f}x, err {err:.1e})")
            except Exception as e:
                res.append(f"{name} {fa}: FAIL {type(e).__name__}: {str(e)[:80]}")
    print(f"{M} {K} {N} | " + " | ".join(res), flush=True)
