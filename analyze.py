"""
analyze.py: shrinkage analysis, the paper's tensor-level measurements.

  python analyze.py grids                      # the picture at the top of the README
  python analyze.py tensors --ckpt out/x/ckpt.pt [--batches 1]
      capture the real operands of every quantized GEMM of a trained checkpoint (inputs of
      qkv/proj/fc1/fc2, weights, and dy from one backward pass) and report alpha, SQNR and
      B_eff per format, with and without RHT, as a markdown table

All the math lives in fp4.py (attenuation, sqnr_db, bucket_use, bin_bias); this file only
collects tensors and prints or draws.
"""
import argparse
import json
import os
import sys

import torch

import fp4


def draw_grids(path):
    """The e2m1 and int4 grids (both scaled to qmax = 1) on one axis, with their rounding bins and
    the analytic per-bin bias: a newcomer sees why e2m1 shrinks magnitudes and int4 does not."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 4.2), sharex=True)
    for ax, name, color in zip(axes, ("e2m1", "int4"), ("tab:red", "tab:blue")):
        grid = fp4.GRIDS[name]
        q = [v / grid.qmax for v in grid.levels]
        mids = [(a + b) / 2 for a, b in zip(q, q[1:])]
        bias = fp4.bin_bias(grid)
        edges = [0.0] + mids + [1.0]
        for i, level in enumerate(q):   # each level's rounding bin, shaded by its bias
            b = bias.get(grid.levels[i], 0.0)
            ax.axvspan(edges[i], edges[i + 1], color=color, alpha=0.08 + 0.8 * min(abs(b) * 2, 1))
            ax.axvline(level, color=color, lw=2)
            ax.text(level, 1.02, f"{grid.levels[i]:g}", ha="center", va="bottom", fontsize=9,
                    transform=ax.get_xaxis_transform())
            if b:
                ax.annotate(f"bias {bias[grid.levels[i]]:+.3f}", (level, 0.45), ha="center",
                            fontsize=9, color="black", xycoords=("data", "axes fraction"))
        for m in mids:
            ax.axvline(m, color="gray", lw=0.8, ls=":")
        ax.set_yticks([])
        ax.set_ylabel(f"{name}\n(/{grid.qmax:g})", rotation=0, ha="right", va="center")
    axes[-1].set_xlim(0, 1.0)
    axes[-1].set_xlabel("magnitude / qmax   (dotted: rounding boundaries; darker bin = larger "
                        "pull toward zero under round-to-nearest)")
    fig.suptitle("E2M1's bins around 2 and 4 are lopsided (round-to-nearest shrinks them); "
                 "int4's uniform grid has no such bias", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


FORMATS = ("e2m1", "ufp4", "nvfp4", "mxfp4")


def report_rows(name, t, dim):
    """One row per format x RHT for one captured operand t, quantized along `dim`."""
    rows = []
    for fmt in FORMATS:
        for rht in (None, 16):
            if t.shape[dim] % max(fp4.get_format(fmt).block, rht or 1):
                continue
            r = fp4.shrinkage_report(t.float(), fmt, dim=dim, rht=rht)
            rows.append(dict(tensor=name, shape=list(t.shape), format=fmt, rht=bool(rht), **r))
    return rows


def capture_operands(model, x, y):
    """Run one forward and backward; return {name: (tensor, quantization dim)} for every GEMM
    operand of the block linears: inputs x (Fprop, along in), weights W (along in), dy (Dgrad,
    along out)."""
    grabbed = {}

    def hook(name):
        def fwd(mod, inp, out):
            grabbed[f"{name}.x"] = (inp[0].detach().reshape(-1, inp[0].shape[-1]), -1)
            out.register_hook(lambda g: grabbed.__setitem__(
                f"{name}.dy", (g.detach().reshape(-1, g.shape[-1]), -1)))
        return fwd

    handles = []
    for i, block in enumerate(model.blocks):
        for n, mod in block.named_modules():
            if isinstance(mod, torch.nn.Linear) and not n.endswith("router"):
                handles.append(mod.register_forward_hook(hook(f"blocks.{i}.{n}")))
                grabbed[f"blocks.{i}.{n}.W"] = (mod.weight.detach(), -1)
    _, loss = model(x, y)
    loss.backward()
    for h in handles:
        h.remove()
    return grabbed


def analyze_checkpoint(ckpt_path, batches, out_md):
    import train  # reuses the trainer's checkpoint loading and data pipeline
    model, loader = train.load_for_analysis(ckpt_path)
    x, y = loader.next_batch()
    tensors = capture_operands(model, x, y)
    rows = []
    for name, (t, dim) in tensors.items():
        rows += report_rows(name, t, dim)
    lines = ["| tensor | format | RHT | alpha | SQNR dB | B_eff |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tensor']} | {r['format']} | {'yes' if r['rht'] else 'no'} | "
                     f"{r['alpha']:.4f} | {r['sqnr_db']:.2f} | {r['b_eff']:.3f} |")
    text = "\n".join(lines)
    print(text)
    if out_md:
        with open(out_md, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(out_md)[0] + ".jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grids", help="draw the e2m1 vs int4 grid picture")
    g.add_argument("--out", default="docs/grids.png")
    t = sub.add_parser("tensors", help="alpha/SQNR/B_eff of a checkpoint's real GEMM operands")
    t.add_argument("--ckpt", required=True)
    t.add_argument("--batches", type=int, default=1)
    t.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.cmd == "grids":
        draw_grids(args.out)
    else:
        analyze_checkpoint(args.ckpt, args.batches, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
