"""GPU time of each quantization a GPT-2-small FP4 linear layer runs per micro-step:
the six operands of Fprop / Dgrad / Wgrad plus the dequantize of Wgrad's packed x (x and dy each
one kernel for both orientations, as the layer runs them, and each half alone), at the four
linear shapes of a 12 x 768 block (16384 tokens), timed from CUDA-graph replays (no host cost),
as effective bandwidth over the device copy. --moe: the MoE's four instead (attention's two,
and the experts' two as grouped layers on twice the tokens' rows). --fp8: the recipe on FP8
GEMMs (its amax passes, the packed x made FP8 in backward, the weights' FP8 pair once per
optimizer step). The last line sums the calls as if each moved its bytes at copy speed (one
already faster, reading from L2, as measured): how far faster kernels of this data flow could
take the quantization (docs/performance.md, how far this design can go).

    python dev/quant_breakdown.py [--recipe=ufp4] [--tokens=16384] [--fp8 [--fp8_x_scale=unit]] [--moe]
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

# (in, out, rows per token, experts: 0 for a plain linear) of a block's four linears
SHAPES = {"qkv": (768, 2304, 1, 0), "proj": (768, 768, 1, 0), "fc": (768, 3072, 1, 0), "fc2": (3072, 768, 1, 0)}
# --moe: the MoE of configs/gpu/moe_gpt2_small_*.py, its experts' linears (8 experts of hidden
# 1536, top-2: twice the tokens' rows, grouped) beside attention's
MOE_SHAPES = {"qkv": (768, 2304, 1, 0), "proj": (768, 768, 1, 0), "w_in": (768, 1536, 2, 8),
              "w_down": (1536, 768, 2, 8)}
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
    p.add_argument("--fp8", action="store_true", help="the recipe on FP8 GEMMs (power-of-two scales)")
    p.add_argument("--fp8_x_scale", default=None, help="with --fp8: 'unit' for Fprop's x at scale 1")
    p.add_argument("--accum", type=int, default=8, help="micro-steps per optimizer step (--fp8's weights)")
    p.add_argument("--moe", action="store_true", help="the MoE's layers (configs/gpu/moe_gpt2_small_*.py)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: quant_breakdown.py times CUDA kernels and needs a CUDA GPU")
    rounds = args.philox_rounds
    with kernels.philox_rounds(rounds) if rounds is not None else contextlib.nullcontext():
        breakdown(args)


def breakdown(args):
    r = fp4.make_recipe(args.recipe, fp8_gemm=args.fp8 or None, fp8_x_scale=args.fp8_x_scale)
    T = args.tokens
    src = torch.randn(T * 4096, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 2 / graph_ms(lambda: dst.copy_(src)) / 1e9  # TB/s
    seeds = torch.randint(0, 2**31 - 8, (6,), device="cuda")
    print(f"`python {' '.join(sys.argv)}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {copy_bw:.2f} TB/s; recipe {r.name}{' on FP8 GEMMs' if r.fp8_gemm else ''}, {T} tokens, "
          f"Philox rounds {kernels.PHILOX_ROUNDS}")
    if args.tiles:
        return tiles(r, T, seeds, copy_bw)
    print("| layer | operand | shape | us | xcopy |\n|---|---|---|---|---|")
    total = at_copy = 0.0
    for name, (n_in, n_out, per_token, experts) in (MOE_SHAPES if args.moe else SHAPES).items():
        x = torch.randn(T * per_token, n_in, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T * per_token, n_out, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(*([experts] if experts else []), n_out, n_in, device="cuda") * 0.02
        if r.fp8_gemm:  # the experts' weights are quantized in every call (GroupedLinear caches none)
            calls = fp8_calls(r, seeds, x, dy, w, name in KEEPS_X, args.accum, cached_w=not experts)
        else:
            calls = bf16_calls(r, seeds, x, dy, w, name in KEEPS_X)
        for op, t, fn, bytes_per_el, share in calls:  # share: calls a micro-step (a bool: 1 or 0)
            if args.sr_only and "dy" not in op:
                continue
            ms = graph_ms(fn)
            total += ms * share
            # at copy speed from HBM; a call that already beats it (its tensor read again from L2)
            # counts as measured
            at_copy += min(ms, t.numel() * bytes_per_el / (copy_bw * 1e9)) * share
            eff = t.numel() * bytes_per_el / (ms * 1e-3) / 1e12 / copy_bw
            note = " (alone)" if share == 0 else f" (1/{round(1 / share)} a micro-step)" if share < 1 else ""
            print(f"| {name} | {op}{note} | {tuple(t.shape)} | {ms * 1e3:.1f} | {eff:.2f} |")
    print(f"\nsum over one block's four layers, as the layer runs them: {total * 1e3:.0f} us; "
          f"x 12 blocks = {total * 12:.2f} ms")
    print(f"the same bytes at copy speed (what kernels of this data flow could reach; a call already "
          f"faster, reading from L2, as measured): {at_copy * 1e3:.0f} us; x 12 blocks = "
          f"{at_copy * 12:.2f} ms ({at_copy / total:.2f} of the measured)")


def _packed_bytes(r):
    """Bytes per element of Wgrad's packed x: codes and the stored block scales."""
    fmt = fp4.get_format(r.wgrad.fmt)
    return 0.5 + fp4.SCALE_DTYPES[fmt.scale].itemsize / fmt.block


def _quantizers(r):
    q = lambda t, o, dim, **kw: fp4._quantize_operand(t, o, r, dim, torch.bfloat16, "", **kw)  # noqa: E731
    pair = lambda t, a, b, **kw: fp4._quantize_operand_pair(t, a, b, r, torch.bfloat16, "", **kw)  # noqa: E731
    return q, pair


def bf16_calls(r, seeds, x, dy, w, keeps):
    """The quantize calls of a layer on bf16 GEMMs: (what, tensor, call, bytes moved per element,
    calls a micro-step: 1 for what the layer runs, 0 for the halves of its one-kernel pairs)."""
    op, (q, pair), packed_x = fp4._operands(r, seeds), _quantizers(r), _packed_bytes(r)
    qx = q(x, op.wgrad_x, 0, packed=True)
    return [("fprop x (row)", x, lambda: q(x, op.fprop_x, -1), 2 + 2, keeps),
            ("wgrad x (col, packed)", x, lambda: q(x, op.wgrad_x, 0, packed=True), 2 + packed_x, False),
            ("x row + col packed, one kernel", x, lambda: pair(x, op.fprop_x, op.wgrad_x, packed=(False, True)),
             2 + 2 + packed_x, not keeps),
            ("wgrad x (col, fake, in backward)", x, lambda: q(x, op.wgrad_x, 0), 2 + 2, keeps),
            ("fprop W (row, fp32)", w, lambda: q(w, op.fprop_w, -1), 4 + 2, True),
            ("dgrad dy (row)", dy, lambda: q(dy, op.dgrad_dy, -1), 2 + 2, False),
            ("wgrad dy (col)", dy, lambda: q(dy, op.wgrad_dy, 0), 2 + 2, False),
            ("dy row + col, one kernel", dy, lambda: pair(dy, op.dgrad_dy, op.wgrad_dy), 2 + 2 + 2, True),
            ("dgrad W (col, fp32)", w, lambda: q(w, op.dgrad_w, -2), 4 + 2, True),
            ("wgrad x dequantize", x, lambda: fp4.dequantize(qx, torch.bfloat16), 2 + packed_x, not keeps)]


def fp8_calls(r, seeds, x, dy, w, keeps, accum, cached_w=True):
    """The same on FP8 GEMMs (fp4._forward, _backward): each FP8 side from an amax pass first
    (2 bytes an element read; none for x at unit scale), Wgrad's x packed and made FP8 in
    backward; cached_w: the weights' FP8 pair once per optimizer step (1 / accum calls a
    micro-step), else each GEMM's weight quantized in its call."""
    op, (q, pair), packed_x = fp4._operands(r, seeds), _quantizers(r), _packed_bytes(r)
    scales = packed_x - 0.5
    e4, e5 = fp4.E4M3, fp4.E5M2
    x8, x_amax = (fp4.FP8_UNIT_X, 0) if r.fp8_x_scale == "unit" else (e4, 2)
    qx = q(x, op.wgrad_x, 0, packed=True)
    calls = [("x: the tensor amax alone", x, lambda: kernels._flat_amax(x), 2, False),
             ("dy: the tensor amax alone", dy, lambda: kernels._flat_amax(dy), 2, False),
             ("fprop x (row FP8)", x, lambda: q(x, op.fprop_x, -1, fp8=x8), x_amax + 2 + 1, keeps),
             ("x row FP8 + col packed, one kernel", x,
              lambda: pair(x, op.fprop_x, op.wgrad_x, packed=(False, True), fp8=(x8, None)),
              x_amax + 2 + 1 + packed_x, not keeps),
             ("wgrad x (col FP8, in backward)", x, lambda: q(x, op.wgrad_x, 0, fp8=e4), 2 + 2 + 1, keeps),
             # the largest block scale first (the scales read twice), then the values
             ("wgrad x packed -> FP8", x, lambda: fp4.fp8_from_packed(qx, e4), packed_x + scales + 1, not keeps),
             ("dy row + col FP8, one kernel", dy, lambda: pair(dy, op.dgrad_dy, op.wgrad_dy, fp8=(e5, e5)),
              2 + 2 + 1 + 1, True)]
    if cached_w:  # amax, a read and both FP8 outputs
        return calls + [("W both FP8 from fp32, amax first", w, lambda: fp4._quantize_operand_pair(
            w, op.fprop_w, op.dgrad_w, r, torch.float32, "", fp8=(e4, e4)), 4 + 4 + 1 + 1, 1 / accum)]
    per_call = 4 + 4 + 1  # amax, a read of the fp32 weight and its FP8 output
    return calls + [("fprop W (row FP8 from fp32, amax first)", w, lambda: q(w, op.fprop_w, -1, fp8=e4), per_call, 1),
                    ("dgrad W (col FP8 from fp32, amax first)", w, lambda: q(w, op.dgrad_w, -2, fp8=e4), per_call, 1)]


if __name__ == "__main__":
    main()
