"""
analyze.py: shrinkage analysis, the paper's tensor-level measurements.

  python analyze.py grids                      # the picture at the top of the README
  python analyze.py tensors --ckpt out/x/ckpt.pt [--out results/shrinkage]
      capture the real operands of every quantized GEMM of a trained bf16 checkpoint (inputs of
      qkv/proj/fc1/fc2, weights, and dy from one backward pass) and report alpha, SQNR and
      B_eff per format, with and without RHT (markdown + jsonl); then the depth picture: one
      batch forward under each recipe with the same weights, per-block RMS ratio to bf16 and each
      block's mean per-GEMM Fprop attenuation (json + png)

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


def load_model(ckpt_path, device="cpu"):
    """A trained model (in its checkpoint's recipe-free bf16 form) and a val-batch loader."""
    import data
    import train
    from data.loader import BinLoader
    from model import GPT, GPTConfig
    ckpt, _ = train.load_checkpoint(ckpt_path, map_location=device)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    model.to(device).eval()
    cfg = ckpt["config"]
    path = os.path.join(cfg.get("data_dir", "data"), cfg["dataset"])
    if not os.path.exists(os.path.join(path, "val.bin")):  # a named dataset not prepared here yet
        path = data.prepare_dataset(cfg["dataset"], cfg.get("data_dir", "data"))
    loader = BinLoader(path, "val", model.config.block_size, cfg["batch_size"], seed=0, device=device)
    return model, loader


def tensor_table(model, loader, out_prefix):
    """alpha / SQNR / B_eff of every GEMM operand type, averaged over layers, per format x RHT."""
    x, y = loader.next_batch()
    tensors = capture_operands(model, x, y)
    rows = []
    for name, (t, dim) in tensors.items():
        rows += report_rows(name, t, dim)
    # group by operand type (qkv.x, fc2.x, fc1.W, ...): mean over layers
    groups = {}
    for r in rows:
        kind = ".".join(r["tensor"].split(".")[2:])
        groups.setdefault((kind, r["format"], r["rht"]), []).append(r)
    lines = ["| operand | format | RHT | alpha | SQNR dB | B_eff |", "|---|---|---|---|---|---|"]
    for (kind, fmt, rht), rs in groups.items():
        mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        lines.append(f"| {kind} | {fmt} | {'yes' if rht else 'no'} | {mean('alpha'):.4f} | "
                     f"{mean('sqnr_db'):.2f} | {mean('b_eff'):.3f} |")
    text = "\n".join(lines)
    with open(out_prefix + "_tensors.md", "w") as f:
        f.write(f"Mean over layers of each GEMM operand of ONE val batch (x: layer input, W: "
                f"weight, dy: output gradient), quantized along its Fprop/Dgrad reduction dim with "
                f"round-to-nearest (RTNE) only. mlp.fc2.x is this model's MLP nonlinearity output "
                f"({model.config.mlp}). Per layer, over several batches, with intervals: "
                f"`analyze.py mechanism`.\n\n" + text + "\n")
    with open(out_prefix + "_tensors.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return text


@torch.no_grad()
def depth_profile(model, loader, recipes, out_prefix):
    """One batch forward under each recipe with the same (bf16-trained) weights: per block, the
    RMS of the hidden state relative to bf16's (measured), and the mean over the block's quantized
    linears of their Fprop attenuation alpha_x * alpha_W (each GEMM's own). No running product of
    alphas: the linears are not in series (the residual stream adds the attention and MLP branches
    to an unquantized path; q, k, v and SwiGLU's gate and up run side by side), so a product over
    them predicts nothing (it came out far below the measured RMS ratio)."""
    import copy
    x, _ = loader.next_batch()

    def hidden_states(m):
        hs, hooks = [], [b.register_forward_hook(lambda mod, i, o: hs.append(o.float()))
                         for b in m.blocks]
        m(x)
        for h in hooks:
            h.remove()
        return hs

    ref = hidden_states(model)
    result = {}
    for name in recipes:
        m = fp4.convert(copy.deepcopy(model), fp4.make_recipe(name))
        per_block, hooks = [], []
        for block in m.blocks:
            alphas = []
            for mod in block.modules():
                if isinstance(mod, fp4.FP4Linear):
                    hooks.append(mod.register_forward_hook(
                        lambda mod, inp, out, alphas=alphas: alphas.append(fprop_attenuation(mod, inp[0]))))
            per_block.append(alphas)
        hs = hidden_states(m)
        for h in hooks:
            h.remove()
        result[name] = dict(rms_ratio=[(h.pow(2).mean() / r.pow(2).mean()).sqrt().item()
                                       for h, r in zip(hs, ref)],
                            gemm_attenuation=[sum(a) / len(a) if a else 1.0 for a in per_block])
    with open(out_prefix + "_depth.json", "w") as f:
        json.dump(result, f, indent=1)
    draw_depth(result, out_prefix + "_depth.png")
    return result


def fprop_attenuation(mod, x):
    """alpha_x * alpha_W of one FP4Linear's Fprop GEMM on input x (in its RHT basis if any)."""
    f = mod.recipe.fprop
    if not f.fmt:
        return 1.0
    xi = x.reshape(-1, x.shape[-1])
    rht = mod.recipe.rht_size if f.rht else None
    ref_x = fp4.rht_transform(xi, rht) if rht else xi.float()
    ref_w = fp4.rht_transform(mod.weight, rht) if rht else mod.weight.float()
    fmt_w = fp4.replace(fp4.get_format(f.fmt), block_2d=mod.recipe.weight_2d)
    return (fp4.attenuation(ref_x, fp4.fake_quant(xi, f.fmt, rht=rht, dtype=torch.float32))
            * fp4.attenuation(ref_w, fp4.fake_quant(mod.weight, fmt_w, rht=rht, dtype=torch.float32)))


def draw_depth(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, r) in enumerate(result.items()):
        layers = range(1, len(r["rms_ratio"]) + 1)
        a1.plot(layers, r["rms_ratio"], "o-", color=f"C{i}", label=name)
        a2.plot(layers, r["gemm_attenuation"], "o-", color=f"C{i}", label=name)
    a1.axhline(1, color="k", lw=0.5), a2.axhline(1, color="k", lw=0.5)
    a1.set(xlabel="block", ylabel="RMS(h) / RMS(h_bf16)", title="hidden-state RMS vs bf16 (measured)")
    a2.set(xlabel="block", ylabel="mean alpha_x * alpha_W over the block's linears",
           title="per-GEMM Fprop attenuation (not compounded)")
    a1.legend(fontsize=8), a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def analyze_checkpoint(ckpt_path, out_prefix, device="cpu"):
    model, loader = load_model(ckpt_path, device)
    os.makedirs(os.path.dirname(out_prefix) or ".", exist_ok=True)
    print(tensor_table(model, loader, out_prefix))
    model.zero_grad(set_to_none=True)
    depth = depth_profile(model, loader, ["e2m1", "ufp4", "nvfp4", "mxfp4"], out_prefix)
    for name, r in depth.items():
        print(f"{name:6s} last-block RMS ratio {r['rms_ratio'][-1]:.4f}, mean per-GEMM attenuation "
              f"{sum(r['gemm_attenuation']) / len(r['gemm_attenuation']):.4f}")
    print(f"wrote {out_prefix}_tensors.md, _tensors.jsonl, _depth.json, _depth.png")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grids", help="draw the e2m1 vs int4 grid picture")
    g.add_argument("--out", default="docs/grids.png")
    t = sub.add_parser("tensors", help="alpha/SQNR/B_eff of a checkpoint's real GEMM operands, "
                                        "and the depth profile under each recipe")
    t.add_argument("--ckpt", required=True)
    t.add_argument("--out", default="results/shrinkage", help="prefix of the output files")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.cmd == "grids":
        draw_grids(args.out)
    else:
        analyze_checkpoint(args.ckpt, args.out, args.device)


if __name__ == "__main__":
    main(sys.argv[1:])
