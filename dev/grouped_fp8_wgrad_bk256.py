"""One-off: the grouped FP8 GEMM's Wgrad form with K steps of 256 promoted every 256 products
(half the promotions, so half the waits for the MMAs) against the layer's 128 / 128, fast and
promoted, at an uneven and an even expert split; time (CUDA-graph replay) against torch's bf16
grouped GEMM as the bf16 recipe calls it and relative error against the fp64 product of the same
FP8 operands. Usage: python dev/grouped_fp8_wgrad_bk256.py"""
import math

import torch
import triton

import fp4
import kernels

COUNTS = {"uneven": [5056, 0, 2944, 3168, 4032, 5664, 4960, 6976],
          "even": [4096, 4160, 4032, 4128, 4064, 4096, 4112, 4112]}
# (BM, BN, BK, warps, stages, promotion interval; 0: fast)
CFGS = [(128, 128, 128, 4, 3, 0), (128, 128, 128, 4, 3, 128), (128, 128, 256, 4, 2, 256),
        (128, 128, 256, 8, 2, 256), (64, 128, 256, 4, 3, 256), (128, 64, 256, 4, 3, 256),
        (64, 128, 256, 4, 2, 256), (128, 128, 256, 4, 2, 128), (128, 128, 256, 4, 2, 0)]


def graph_ms(fn, reps=10, rounds=5):
    """ms per call: CUDA-graph replay of `reps` calls, best of `rounds`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    best = math.inf
    for _ in range(rounds):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        best = min(best, t0.elapsed_time(t1) / reps)
    return best


def main():
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| split | format | Wgrad of | (BM, BN, BK, warps, stages, promote) | us | vs bf16 | rel. error vs fp64 |")
    print("|---|---|---|---|---|---|---|")
    for split, counts in COUNTS.items():
        offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        T = sum(counts)
        ends = [0] + offs.tolist()
        for layer, d_in, d_out in (("fc1", 768, 1536), ("fc2", 1536, 768)):
            x = torch.randn(T, d_in, device="cuda").bfloat16()
            rows = torch.exp2(torch.empty(T, 1, device="cuda").uniform_(-8, 8))
            dy = (torch.distributions.StudentT(3.0).sample((T, d_out)).cuda() * rows).bfloat16()
            bf = graph_ms(lambda: torch._grouped_mm(fp4._t(dy), x, offs=offs)) * 1e3
            for fmt in ("mxfp4", "mxint4"):
                a = fp4._t(fp4.to_fp8(dy, fmt, dim=0, fp8=fp4.E5M2))
                b = fp4.to_fp8(x, fmt, dim=0)
                av, bv = a[0].double() * a[1].double(), b[0].double() * b[1].double()
                exact = torch.stack([av[:, s:t] @ bv[s:t] for s, t in zip(ends[:-1], ends[1:])])
                for cfg in CFGS:
                    fast = cfg[5] == 0
                    fn = lambda: kernels.fp8_grouped_mm(a, b, offs, torch.float32, fast=fast,
                                                        _cfg=cfg[:5] + (cfg[5] or 128,))
                    try:
                        err = ((fn().double() - exact).norm() / exact.norm()).item()
                        us = graph_ms(fn) * 1e3
                        print(f"| {split} | {fmt} | {layer} | {cfg} | {us:.1f} | {bf / us:.2f}x | {err:.2e} |")
                    except Exception as e:  # a tile that does not fit is a result too
                        print(f"| {split} | {fmt} | {layer} | {cfg} | {type(e).__name__} | | |")
            print(f"| {split} | bf16 | {layer} | torch._grouped_mm | {bf:.1f} | 1.00x | |")


if __name__ == "__main__":
    main()
