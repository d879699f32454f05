"""Host (CPU) time per call of the FP4 building blocks on tiny tensors, where the GPU work is
negligible and the wall time per call is the launch path's cost (a compiled FP4 step without
CUDA graphs can be host-bound: docs/performance.md).

    python dev/host_overhead.py              # on the GPU
    python dev/host_overhead.py --cpu-stub   # host code only, kernels stubbed (any machine)
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4  # noqa: E402
import kernels  # noqa: E402


def per_call_us(fn, n=300, sync=True):
    for _ in range(10):
        fn()
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if sync:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def cpu_stub():
    """The same question on a machine without a GPU: the Triton path's host code (fp4.py's layer
    op, kernels.py's wrappers and launch cache) on CPU tensors, with every compiled kernel replaced
    by a no-op. Times are host microseconds of this CPU; compare them with nn.Linear's here."""
    class NoKernel:
        def __getitem__(self, grid):
            return lambda *args: None
    for k in (kernels._quant_kernel, kernels._amax_kernel, kernels._flat_amax_kernel, kernels._dequant_kernel):
        k.run = lambda *a, **kw: NoKernel()
    fp4.kernels_for = lambda x: kernels
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    xq = torch.randn(64, 768, dtype=torch.bfloat16)

    def fwd_bwd(m):
        def f():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = m(x)
            y.backward(torch.ones_like(y))
        return f
    rows = [("torch add (baseline op)", lambda: xq.add(1)),
            ("kernels.fake_quant rtne rht16 row", lambda: kernels.fake_quant(xq, "ufp4", -1, "rtne", 16)),
            ("nn.Linear fwd+bwd, 16x64 -> 64", fwd_bwd(torch.nn.Linear(64, 64, bias=False)))]
    rows += [(f"FP4Linear {r} fwd+bwd, 16x64 -> 64", fwd_bwd(fp4.FP4Linear(64, 64, bias=False, recipe=r)))
             for r in ("ufp4", "nvfp4")]
    print(f"CPU stub (GPU kernels replaced by no-ops), torch {torch.__version__}")
    print("| call | host us per call (best of 3) |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {min(per_call_us(fn, 400, sync=False) for _ in range(3)):.1f} |")


def main():
    if {"-h", "--help"} & set(sys.argv[1:]):
        return print(__doc__)
    if not torch.cuda.is_available() or "--cpu-stub" in sys.argv:
        return cpu_stub()
    dev = "cuda"
    x = torch.randn(64, 768, device=dev, dtype=torch.bfloat16)
    w = torch.randn(768, 768, device=dev, dtype=torch.bfloat16, requires_grad=True)
    xg = x.clone().requires_grad_()
    lin = torch.nn.Linear(768, 768, bias=False, device=dev, dtype=torch.bfloat16)
    fmt = fp4.get_format("ufp4")
    r = fp4.make_recipe("ufp4")

    def fwd_bwd(recipe):
        def f():
            y = fp4.fp4_linear(xg, w, recipe)
            y.backward(torch.ones_like(y))
        return f

    def bf16_fwd_bwd():
        y = lin(xg)
        y.backward(torch.ones_like(y))

    rows = [
        ("torch add (baseline launch)", lambda: x.add(1)),
        ("kernels.fake_quant rtne rht16 row", lambda: kernels.fake_quant(x, fmt, -1, "rtne", 16)),
        ("kernels.fake_quant sr rht16 col", lambda: kernels.fake_quant(x, fmt, 0, "sr", 16, seed=3)),
        ("kernels.quantize packed col", lambda: kernels.quantize(x, fmt, 0, "sr", 16, seed=3)),
        ("kernels.quantize_both fake", lambda: kernels.quantize_both(x, fmt, rht=16)),
        ("fp4._quantize_operand fake row",
         lambda: fp4._quantize_operand(x, fp4._operands(r, torch.ones(6, dtype=torch.long)).fprop_x,
                                       r, -1, torch.bfloat16, "")),
        ("_linear_op (forward op, ufp4)", lambda: fp4._linear_op(x, w, None, fp4.recipe_key(r),
                                                                  torch.bfloat16, "", True, [], False, [])),
        ("fp4_linear fwd+bwd ufp4", fwd_bwd("ufp4")),
        ("fp4_linear fwd+bwd bf16 recipe", fwd_bwd("bf16")),
        ("nn.Linear fwd+bwd", bf16_fwd_bwd),
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| call | host us per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn):.1f} |")


if __name__ == "__main__":
    main()
