"""One-off probe: torch._scaled_mm's fast accumulation against its exact (fp32-promoted) mode, per
GEMM of a GPT-2-small layer (16k tokens) and of the wide 24 x 2048 model (8k tokens): time per
call (CUDA-graph replay) and the error of each mode against the float64 product of the same FP8
operands, in the GEMM's output dtype (bf16 for Fprop and Dgrad, fp32 for Wgrad).

    PYTHONPATH=. python dev/probe_fast_accum.py
"""
import torch

import fp4

DEV = "cuda"
D_SMALL, D_WIDE = 768, 2048


def layer_shapes(tokens, d):
    """(name, in, out) of the four linears of a block."""
    return [("qkv", d, 3 * d), ("proj", d, d), ("fc", d, 4 * d), ("fc2", 4 * d, d)]


def activations(rows, cols, seed, tail=False, binades=4):
    """Gaussian (or Student-t(3)) values, each row scaled by 2^U(-binades, binades): tokens differ."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, cols, device=DEV, generator=g)
    if tail:
        chi = torch.randn(rows, cols, 3, device=DEV, generator=g).pow(2).sum(-1) / 3
        x = x / chi.sqrt()
    e = torch.randint(-binades, binades + 1, (rows, 1), device=DEV, generator=g).float()
    return (x * torch.exp2(e)).bfloat16()


def fp8(t, fmt, dim, f8):
    """(values, scale) as the layer feeds _scaled_mm: the reduction dim contiguous."""
    v, s = fp4.to_fp8(t, fmt, dim=dim, fp8=f8)
    return (v.contiguous() if dim == -1 else v.t().contiguous().t()), s


def gemms(tokens, d, fmt):
    for name, fin, fout in layer_shapes(tokens, d):
        x = activations(tokens, fin, 1)
        w = (torch.randn(fout, fin, device=DEV) * 0.02)
        dy = activations(tokens, fout, 2, tail=True, binades=8) * 1e-5
        xa = fp8(x, fmt, -1, fp4.E4M3)
        wf = fp8(w, fmt, -1, fp4.E4M3)
        yield f"fprop {name}", xa, (wf[0].t(), wf[1]), torch.bfloat16
        dya = fp8(dy, fmt, -1, fp4.E5M2)
        wd = fp8(w.t().contiguous(), fmt, -1, fp4.E4M3)   # W along out, as [in, out] rows
        yield f"dgrad {name}", dya, (wd[0].t(), wd[1]), torch.bfloat16
        dyw = fp8(dy.t().contiguous(), fmt, -1, fp4.E5M2)  # dy^T [out, tokens], along tokens
        xw = fp8(x.t().contiguous(), fmt, -1, fp4.E4M3)    # x^T [in, tokens]
        yield f"wgrad {name}", dyw, (xw[0].t(), xw[1]), torch.float32


def timed(fn, reps=10, trials=5):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    best = float("inf")
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / reps)
    return best


def main():
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    print("| model | GEMM | M, K, N | exact ms | fast ms | fast / exact time | exact rel err | "
          "fast rel err | outputs that differ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, tokens, d in (("dense", 16384, D_SMALL), ("wide", 8192, D_WIDE)):
        for fmt in ("mxfp4", "mxint4"):
            for name, a, b, out in gemms(tokens, d, fmt):
                run = {f: (lambda f=f: torch._scaled_mm(a[0], b[0], a[1], b[1], out_dtype=out,
                                                         use_fast_accum=f)) for f in (False, True)}
                ms = {f: timed(run[f]) for f in run}
                ref = (a[0].double() * a[1].double()) @ (b[0].double() * b[1].double())
                got = {f: run[f]() for f in run}
                err = {f: ((got[f].double() - ref).norm() / ref.norm()).item() for f in run}
                differ = (got[True] != got[False]).float().mean().item()
                M, K = a[0].shape
                print(f"| {model} {fmt} | {name} | {M}, {K}, {b[0].shape[1]} | {ms[False]:.4f} | "
                      f"{ms[True]:.4f} | {ms[True] / ms[False]:.3f} | {err[False]:.2e} | "
                      f"{err[True]:.2e} | {differ:.2e} |", flush=True)


if __name__ == "__main__":
    main()
