"""One-off: kernels.fp8_grouped_mm's Wgrad form (groups along the tokens) by tile (BM, BN, BK,
warps, stages), fast and promoted every 128, at an uneven and an even split of 32800 routed rows
over 8 experts, against torch's bf16 grouped GEMM as the bf16 recipe calls it (CUDA-graph replay).
Usage: python dev/grouped_fp8_wgrad_tiles.py"""
import importlib.util

import torch
import triton

import kernels

spec = importlib.util.spec_from_file_location("base", "dev/grouped_fp8_vs_bf16.py")
base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(base)

TILES = [(128, 128, 128, 4, 3), (128, 128, 128, 8, 3), (128, 128, 128, 4, 4), (128, 128, 64, 4, 4),
         (128, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3),
         (64, 64, 128, 4, 4)]


def main():
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| split | GEMM | tile | fast us | x bf16 | promoted us | x bf16 |")
    print("|---|---|---|---|---|---|---|")
    for split, counts in base.COUNTS.items():
        offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        for name, a, b, ab, bb, _, out in base.gemms("mxfp4", offs, sum(counts)):
            if "wgrad" not in name:
                continue
            bf = base.graph_ms(lambda: torch._grouped_mm(ab, bb, offs=offs)) * 1e3
            for cfg in TILES:
                res = []
                for fast in (True, False):
                    try:
                        fn = lambda: kernels.fp8_grouped_mm(a, b, offs, out, fast=fast, _cfg=cfg + (128,))
                        us = base.graph_ms(fn) * 1e3
                        res.append(f"{us:.1f} | {bf / us:.2f}x")
                    except Exception as e:
                        res.append(f"{type(e).__name__} | ")
                print(f"| {split} | {name} | {cfg} | {res[0]} | {res[1]} |")
            print(f"| {split} | {name} | bf16 | {bf:.1f} | 1.00x | | |")


if __name__ == "__main__":
    main()
