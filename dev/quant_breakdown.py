"""GPU time of each quantization a GPT-2-small FP4 linear layer runs per micro-step:
the six operands of Fprop / Dgrad / Wgrad plus the dequantize of Wgrad's packed x (x and dy each
one kernel for both orientations, as the layer runs them, and each half alone), at the four
linear shapes of a 12 x 768 block (16384 tokens), timed from CUDA-graph replays (no host cost),
as effective bandwidth over the device copy.

    python dev/quant_breakdown.py [--recipe=ufp4] [--tokens=16384]
"""
import argparse
import contextlib
import datetime
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4  # noqa: E402
import kernels  # noqa: E402
from bench_kernels import graphed  # noqa: E402
from model import GPT  # noqa: E402

SHAPES = {"qkv": (768, 2304), "proj": (768, 768), "fc": (768, 3072), "fc2": (3072, 768)}
# layers that keep x for Wgrad and quantize it in backward (GPT.fp4_keep_x: attention's proj,
# whose input SDPA saves anyway); the others save it packed, quantized in forward
KEEPS_X = {name.rsplit(".", 1)[-1] for name in GPT.fp4_keep_x}


def graph_ms(fn, reps=20):
    """GPU ms per call of fn: reps calls captured in one CUDA graph, replays timed with events."""
    replay = graphed(lambda: [fn() for _ in range(reps)])
    replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (5 * reps)


def tiles(r, T, seeds, copy_bw):
    """dy's two SR quantizations (Dgrad row-wise, Wgrad column-wise), alone and from one kernel,
    under other tile configs (BM, BN, num_warps): which shape the kernels' default should take."""
    fmt = fp4.get_format(r.dgrad.fmt)
    cfgs = [None, (32, 128, 8), (16, 128, 4), (64, 128, 4), (32, 64, 4), (64, 128, 8),
            (8, 256, 2, 0), (16, 256, 4, 0), (8, 512, 4, 0)]  # 4th: row load mode (see kernels._tile)
    print("| shape | side | cfg (BM, BN, warps) | us | xcopy |\n|---|---|---|---|---|")
    for n_out in (2304, 3072):
        dy = torch.randn(T, n_out, device="cuda", dtype=torch.bfloat16)
        for dim, gemm in ((1, r.dgrad), (0, r.wgrad)):
            rht = r.rht_size if gemm.rht else None
            for cfg in cfgs:
                if dim == 0 and cfg and len(cfg) == 4:
                    continue
                try:
                    ms = graph_ms(lambda: kernels.fake_quant(dy, fmt, dim, "sr", rht, seeds[2], _cfg=cfg))
                except Exception as e:  # noqa: BLE001 -- a config the kernel cannot take
                    print(f"| {tuple(dy.shape)} | dim {dim} | {cfg} | {type(e).__name__} | |")
                    continue
                eff = dy.numel() * 4 / (ms * 1e-3) / 1e12 / copy_bw
                print(f"| {tuple(dy.shape)} | dim {dim} | {cfg or 'default'} | {ms * 1e3:.1f} | {eff:.2f} |")
        rr, rc = (r.rht_size if gm.rht else None for gm in (r.dgrad, r.wgrad))
        for cfg in [None, (64, 64, 4), (16, 128, 4), (32, 128, 4, 0), (16, 256, 4, 0), (32, 256, 8, 0),
                    (16, 512, 8, 0)]:
            ms = graph_ms(lambda: kernels.quantize_both(dy, fmt, rounding="sr", rht=rr, rht_col=rc, seed=seeds[2],
                                                        seed_col=seeds[4], dtype=torch.bfloat16, _cfg=cfg))
            eff = dy.numel() * 6 / (ms * 1e-3) / 1e12 / copy_bw
            print(f"| {tuple(dy.shape)} | both, one kernel | {cfg or 'default'} | {ms * 1e3:.1f} | {eff:.2f} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="ufp4")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--philox_rounds", type=int, default=None, help="override kernels.PHILOX_ROUNDS")
    p.add_argument("--tiles", action="store_true", help="try tile configs on dy's SR quantizations")
    p.add_argument("--sr_only", action="store_true", help="only the SR operands (dy)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: quant_breakdown.py times CUDA kernels and needs a CUDA GPU")
    rounds = args.philox_rounds
    with kernels.philox_rounds(rounds) if rounds is not None else contextlib.nullcontext():
        breakdown(args)


def breakdown(args):
    r = fp4.make_recipe(args.recipe)
    T = args.tokens
    src = torch.randn(T * 4096, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 2 / graph_ms(lambda: dst.copy_(src)) / 1e9  # TB/s
    seeds = torch.randint(0, 2**31 - 8, (6,), device="cuda")
    print(f"`python {' '.join(sys.argv)}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {copy_bw:.2f} TB/s; recipe {r.name}, {T} tokens, Philox rounds {kernels.PHILOX_ROUNDS}")
    if args.tiles:
        return tiles(r, T, seeds, copy_bw)
    print("| layer | operand | shape | us | xcopy |\n|---|---|---|---|---|")
    total = 0.0
    for name, (n_in, n_out) in SHAPES.items():
        x = torch.randn(T, n_in, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T, n_out, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n_out, n_in, device="cuda") * 0.02
        op = fp4._operands(r, seeds)
        q = lambda t, o, dim, packed=False: fp4._quantize_operand(  # noqa: E731
            t, o, r, dim, torch.bfloat16, "", packed=packed)
        pair = lambda t, a, b, packed_col=False: fp4._quantize_operand_pair(  # noqa: E731
            t, a, b, r, torch.bfloat16, "", packed_col)
        qx = q(x, op.wgrad_x, 0, packed=True)
        wfmt = fp4.get_format(r.wgrad.fmt)
        packed_x = 0.5 + fp4.SCALE_DTYPES[wfmt.scale].itemsize / wfmt.block  # codes + stored scales
        # (what, tensor, call, bytes per element, run by the layer: the one-kernel pairs, not
        # their two halves)
        keeps = name in KEEPS_X
        ops = [("fprop x (row)", x, lambda: q(x, op.fprop_x, -1), 2 + 2, keeps),
               ("wgrad x (col, packed)", x, lambda: q(x, op.wgrad_x, 0, packed=True), 2 + packed_x, False),
               ("x row + col packed, one kernel", x, lambda: pair(x, op.fprop_x, op.wgrad_x, True),
                2 + 2 + packed_x, not keeps),
               ("wgrad x (col, fake, in backward)", x, lambda: q(x, op.wgrad_x, 0), 2 + 2, keeps),
               ("fprop W (row, fp32)", w, lambda: q(w, op.fprop_w, -1), 4 + 2, True),
               ("dgrad dy (row)", dy, lambda: q(dy, op.dgrad_dy, -1), 2 + 2, False),
               ("wgrad dy (col)", dy, lambda: q(dy, op.wgrad_dy, 0), 2 + 2, False),
               ("dy row + col, one kernel", dy, lambda: pair(dy, op.dgrad_dy, op.wgrad_dy), 2 + 2 + 2, True),
               ("dgrad W (col, fp32)", w, lambda: q(w, op.dgrad_w, -2), 4 + 2, True),
               ("wgrad x dequantize", x, lambda: fp4.dequantize(qx, torch.bfloat16), 2 + packed_x, not keeps)]
        for op, t, fn, bytes_per_el, run in ops:
            if args.sr_only and "dy" not in op:
                continue
            ms = graph_ms(fn)
            total += ms if run else 0.0
            eff = t.numel() * bytes_per_el / (ms * 1e-3) / 1e12 / copy_bw
            print(f"| {name} | {op}{'' if run else ' (alone)'} | {tuple(t.shape)} | {ms * 1e3:.1f} | {eff:.2f} |")
    print(f"\nsum over one block's four layers, as the layer runs them: {total * 1e3:.0f} us; "
          f"x 12 blocks = {total * 12:.2f} ms")


if __name__ == "__main__":
    main()
