"""
analyze.py: shrinkage analysis, the paper's tensor-level measurements.

  python analyze.py grids                      # the picture at the top of the README
  python analyze.py mechanism --ckpt out/x/ckpt.pt [--ckpt ...] [--batches 8 --draws 8]
                             [--out out/mechanism]
      the mechanism at fixed weights, per quantized layer, mean ± SE over val batches, for e2m1
      and ufp4 with and without RHT: the forward penalty (CE with one Fprop GEMM, or all, quantized
      with RTNE, minus the exact CE), the Wgrad bias over SR draws against the exact dW (alpha_g,
      cosine, draw-corrected |bias|^2, variance ratio), alpha / SQNR / B_eff of the Fprop operands
      and the empirical per-level bias E[Q(t) - t | level]; markdown + json per checkpoint, and
      summary.md: every checkpoint analysed in --out, one row each (steps, training recipes)
  python analyze.py mechanism_summary --out out/mechanism   # summary.md again, from the json
  python analyze.py tensors --ckpt out/x/ckpt.pt [--out out/shrinkage]
      capture the real operands of every quantized GEMM of a trained bf16 checkpoint (inputs of
      qkv/proj/fc1/fc2, weights, and dy from one backward pass) and report alpha, SQNR and
      B_eff per format, with and without RHT (markdown + jsonl); then the depth picture: one
      batch forward under each recipe with the same weights, per-block RMS ratio to bf16 and each
      block's mean per-GEMM Fprop attenuation (json + png)

All the math lives in fp4.py (attenuation, sqnr_db, bucket_use, bin_bias); this file only
collects tensors and prints or draws.
"""
import argparse
import glob
import json
import math
import os
import sys

import torch

import fp4
from checkpoint import CheckpointError
from configurator import ConfigError, check_device


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
    """A trained model (in its checkpoint's recipe-free bf16 form), a val-batch loader (seed 0:
    the same batches for every checkpoint of one config) and {iter, recipe} of the checkpoint."""
    import data
    import train
    from data.loader import BinLoader
    from model import GPT, GPTConfig
    ckpt, _ = train.load_checkpoint(ckpt_path, map_location=device, flag="--ckpt")
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    model.to(device).eval()
    cfg = ckpt["config"]
    path = os.path.join(cfg.get("data_dir", "data"), cfg["dataset"])
    if not os.path.exists(os.path.join(path, "val.bin")):  # a named dataset not prepared here yet
        try:
            path = data.prepare_dataset(cfg["dataset"], cfg.get("data_dir", "data"))
        except ValueError as e:   # not a named one: it was built where the run was trained
            raise ConfigError(f"the checkpoint's dataset {cfg['dataset']!r} is not at {path} ({e}): "
                              f"run analyze.py from the folder the run was trained in") from None
    loader = BinLoader(path, "val", model.config.block_size, cfg["batch_size"], seed=0, device=device)
    return model, loader, dict(iter=ckpt["iter_num"], recipe=ckpt["recipe"])


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
    model, loader, _ = load_model(ckpt_path, device)
    if model.config.n_expert:   # the hooks take nn.Linear and FP4Linear: the experts are neither
        sys.exit(f"error: {ckpt_path} is a MoE ({model.config.n_expert} experts); `tensors` covers "
                 f"dense linears only and would leave its experts out: use `analyze.py mechanism`, "
                 f"which measures them")
    os.makedirs(os.path.dirname(out_prefix) or ".", exist_ok=True)
    print(tensor_table(model, loader, out_prefix))
    model.zero_grad(set_to_none=True)
    depth = depth_profile(model, loader, ["e2m1", "ufp4", "nvfp4", "mxfp4"], out_prefix)
    for name, r in depth.items():
        print(f"{name:6s} last-block RMS ratio {r['rms_ratio'][-1]:.4f}, mean per-GEMM attenuation "
              f"{sum(r['gemm_attenuation']) / len(r['gemm_attenuation']):.4f}")
    print(f"wrote {out_prefix}_tensors.md, _tensors.jsonl, _depth.json, _depth.png")


# -----------------------------------------------------------------------------
# The mechanism at fixed weights: what each format does to the forward pass and to the weight
# gradient of each quantized layer of a trained checkpoint, over several batches.

MECH_CONFIGS = (("e2m1", False), ("e2m1", True), ("ufp4", False), ("ufp4", True))  # format, RHT 16
OPERANDS = ("x", "W")


def mech_label(fmt, rht):
    return fmt + ("+RHT" if rht else "")


def one_gemm_recipe(gemm, fmt, rht, sr_dy=False):
    """A recipe that quantizes one GEMM only (the others stay exact): the RHT of size 16 on it if
    rht, stochastic rounding on dy if sr_dy (Wgrad and Dgrad)."""
    return fp4.Recipe(f"{gemm}:{mech_label(fmt, rht)}", **{gemm: fp4.Gemm(fmt, rht, sr_a=sr_dy)})


def quantizable_layers(model):
    """{tag: module} of the linears fp4.convert quantizes (the router excepted)."""
    return {m.tag: m for m in model.modules() if isinstance(m, (fp4.FP4Linear, fp4.GroupedLinear)) and m.tag}


def set_recipe(layers, recipe, only=None):
    """`recipe` on layer `only` (every layer if None), bf16 on the others."""
    for tag, m in layers.items():
        m.recipe = recipe if only in (None, tag) else "bf16"


@torch.no_grad()
def forward_penalty(model, layers, batches):
    """{(config, layer or 'all'): [per batch: CE with that Fprop quantized (RTNE) - exact CE]}."""
    out = {}
    for x, y in batches:
        set_recipe(layers, "bf16")
        exact = model(x, y)[1].item()
        for fmt, rht in MECH_CONFIGS:
            recipe = one_gemm_recipe("fprop", fmt, rht)
            for only in (None, *layers):
                set_recipe(layers, recipe, only)
                key = (mech_label(fmt, rht), only or "all")
                out.setdefault(key, []).append(model(x, y)[1].item() - exact)
    set_recipe(layers, "bf16")
    return out


def weight_grads(model, layers, x, y):
    model.zero_grad(set_to_none=True)
    model(x, y)[1].backward()
    return {tag: m.weight.grad.detach().double().clone() for tag, m in layers.items()}


def draw_stats(exact, total, sum_sq, draws):
    """Bias of a stochastic gradient estimate from `draws` draws g_k (their sum and the sum of
    their squared norms) against the exact g: alpha_g = <mean, g> / |g|^2, the cosine of mean and
    g, |bias|^2 / |g|^2 corrected for the draw noise left in the mean (|mean - g|^2 - tr(C) / K,
    unbiased, may come out < 0), and the variance ratio tr(C) / |g|^2 of one draw (C: the draws'
    covariance, tr(C) estimated with K - 1 degrees of freedom)."""
    mean = total / draws
    gg, mm = exact.pow(2).sum().item(), mean.pow(2).sum().item()
    dot = (mean * exact).sum().item()
    trace = max(sum_sq - draws * mm, 0.0) / (draws - 1)
    bias2 = (mean - exact).pow(2).sum().item() - trace / draws
    return dict(alpha_g=dot / gg, cosine=dot / math.sqrt(gg * mm), bias2_rel=bias2 / gg, var_ratio=trace / gg)


def gradient_bias(model, layers, batches, draws):
    """{(config, layer): [per batch: draw_stats]} of every layer's Wgrad under the config (SR on
    dy, RTNE on x, as the recipes do), with every Fprop and Dgrad exact: each layer sees the exact
    dy and x, so all layers are measured in one backward per draw."""
    out = {}
    for b, (x, y) in enumerate(batches):
        set_recipe(layers, "bf16")
        exact = weight_grads(model, layers, x, y)
        for fmt, rht in MECH_CONFIGS:
            set_recipe(layers, one_gemm_recipe("wgrad", fmt, rht, sr_dy=True))
            total = {t: torch.zeros_like(g) for t, g in exact.items()}
            sum_sq = dict.fromkeys(exact, 0.0)
            for k in range(draws):
                torch.manual_seed(7919 * b + k)   # the SR draws: reproducible, new per draw
                for t, g in weight_grads(model, layers, x, y).items():
                    total[t] += g
                    sum_sq[t] += g.pow(2).sum().item()
            for t in exact:
                stats = draw_stats(exact[t], total[t], sum_sq[t], draws)
                out.setdefault((mech_label(fmt, rht), t), []).append(stats)
    set_recipe(layers, "bf16")
    model.zero_grad(set_to_none=True)
    return out


def level_bias(q, ref):
    """Per grid level i: (sum of |Q(t)| - |t|, count) over the elements that round to level i,
    t = the element in grid units (|ref| * tensor scale / block scale): the empirical
    E[Q(t) - t | bin] (magnitudes: negative = toward zero). q: a QTensor of ref quantized along
    its last dim (1D blocks)."""
    grid = fp4.GRIDS[q.fmt.grid]
    idx = (fp4.unpack_codes(q.codes) & 7).long().reshape(-1, ref.shape[-1])
    scales = q.scales.float().reshape(idx.shape[0], -1).repeat_interleave(q.fmt.block, dim=-1)
    t = ref.reshape(idx.shape).abs() * (q.tensor_scale if q.tensor_scale is not None else 1.0)
    ok = scales > 0
    levels = torch.tensor(grid.levels, dtype=torch.float64, device=idx.device)
    d = (levels[idx] - t.double() / scales.double())[ok]
    n = len(grid.levels)
    return (torch.bincount(idx[ok], weights=d, minlength=n).tolist(),
            torch.bincount(idx[ok], minlength=n).tolist())


@torch.no_grad()
def operand_stats(model, layers, batches):
    """Per batch, layer, Fprop operand (x: the layer's input; W) and config, RTNE: alpha, SQNR
    and B_eff; and the per-level sums of level_bias, added up over batches and layers by operand
    kind (e.g. mlp.fc2.x)."""
    per, levels = {}, {}
    set_recipe(layers, "bf16")
    for x, y in batches:
        seen = {}
        hooks = [m.register_forward_hook(lambda m, inp, out, t=t: seen.__setitem__(t, inp[0].detach()))
                 for t, m in layers.items()]
        model(x, y)
        for h in hooks:
            h.remove()
        for tag, m in layers.items():
            for op, t in (("x", seen[tag].reshape(-1, seen[tag].shape[-1])), ("W", m.weight.detach())):
                for fmt, rht in MECH_CONFIGS:
                    size = 16 if rht else None
                    ref = fp4.rht_transform(t, size) if rht else t.float()
                    q = fp4.quantize(t, fmt, dim=-1, rht=size)
                    xq = fp4.dequantize(q, torch.float32)
                    label = mech_label(fmt, rht)
                    per.setdefault((label, tag, op), []).append(dict(
                        alpha=fp4.attenuation(ref, xq), sqnr_db=fp4.sqnr_db(ref, xq),
                        b_eff=fp4.bucket_use(q)))
                    sums, counts = level_bias(q, ref)
                    kind = ".".join(tag.split(".")[2:] + [op])
                    acc = levels.setdefault((label, kind), [[0.0] * len(sums), [0] * len(sums)])
                    acc[0] = [a + b for a, b in zip(acc[0], sums)]
                    acc[1] = [a + b for a, b in zip(acc[1], counts)]
    return per, levels


def mean_se(xs):
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def mechanism(ckpt_path, out_prefix, n_batches=8, draws=8, device="cpu"):
    """All four measurements on one checkpoint: writes out_prefix + _mechanism.md and .json."""
    torch.set_flush_denormal(True)   # as train.py: tiny gradients as denormals are ~100x slower on a CPU
    try:
        return _mechanism(ckpt_path, out_prefix, n_batches, draws, device)
    finally:
        torch.set_flush_denormal(False)


def _mechanism(ckpt_path, out_prefix, n_batches, draws, device):
    model, loader, info = load_model(ckpt_path, device)
    model = fp4.convert(model, "bf16")     # FP4Linear everywhere, so recipes can be set per layer
    layers = quantizable_layers(model)
    batches = [loader.next_batch() for _ in range(n_batches)]
    result = dict(ckpt=ckpt_path, **info, batches=n_batches, tokens_per_batch=batches[0][0].numel(),
                  draws=draws, mlp=model.config.mlp, layers=list(layers))
    fwd = forward_penalty(model, layers, batches)
    result["forward_penalty"] = {f"{c}|{t}": mean_se(v) for (c, t), v in fwd.items()}
    grad = gradient_bias(model, layers, batches, draws)
    result["gradient"] = {f"{c}|{t}": {k: mean_se([s[k] for s in v]) for k in v[0]}
                          for (c, t), v in grad.items()}
    per, levels = operand_stats(model, layers, batches)
    result["operands"] = {f"{c}|{t}|{op}": {k: mean_se([s[k] for s in v]) for k in v[0]}
                          for (c, t, op), v in per.items()}
    # each batch's values too: every layer sees the same batches, so a mean over layers (and a
    # difference of two configs) has its SE from the batches, not from independent layers
    for section, per_key in (("gradient", grad), ("operands", per)):
        result[section + "_batches"] = {"|".join(key): {k: [s[k] for s in v] for k in v[0]}
                                        for key, v in per_key.items()}
    result["level_bias"] = {f"{c}|{kind}": dict(bias=[s / n if n else None for s, n in zip(*acc)],
                                                count=acc[1]) for (c, kind), acc in levels.items()}
    os.makedirs(os.path.dirname(out_prefix) or ".", exist_ok=True)
    with open(out_prefix + "_mechanism.json", "w") as f:
        json.dump(result, f, indent=1)
    text = "\n".join(mechanism_markdown(result))
    with open(out_prefix + "_mechanism.md", "w") as f:
        f.write(text + "\n")
    print(text)
    return result


PAPER_FC2_SQNR = {"e2m1": 21.90, "e2m1+RHT": 20.00, "ufp4": 19.94, "ufp4+RHT": 23.19}  # dB, 1.5B


def _pm(ms, digits=4):
    m, se = ms
    return f"{m:+.{digits}f} ± {se:.{digits}f}" if se == se else f"{m:+.{digits}f}"


def _per_layer(result, section, metric, label, op=None):
    """[(mean, SE) of the metric in each layer]."""
    return [result[section][f"{label}|{t}" + (f"|{op}" if op else "")][metric] for t in result["layers"]]


def _per_batch(r, section, metric, label, layer, op=None):
    """The metric's value in each batch for one layer and config, or None in a result written
    before they were kept."""
    batches = r.get(section + "_batches")
    return batches[f"{label}|{layer}" + (f"|{op}" if op else "")][metric] if batches else None


def _layers_pm(r, section, metric, label, op=None):
    """Mean over layers of a metric, ± its SE: over batches of each batch's mean over layers
    (the layers share the batches). A result without per-batch values gets the SE from the
    per-layer SEs as if the layers were independent, which a shared batch effect makes too small
    (by up to the square root of the layer count)."""
    pairs = _per_layer(r, section, metric, label, op)
    mean = sum(m for m, _ in pairs) / len(pairs)
    rows = [_per_batch(r, section, metric, label, t, op) for t in r["layers"]]
    if all(rows):
        return mean, mean_se([sum(col) / len(col) for col in zip(*rows)])[1]
    ses = [se for _, se in pairs]
    se = math.sqrt(sum(x * x for x in ses)) / len(ses) if all(x == x for x in ses) else float("nan")
    return mean, se


def _layer_mean(result, section, metric, label, op=None):
    """Mean over layers of a metric's per-layer means."""
    return _layers_pm(result, section, metric, label, op)[0]


def fc2_sqnr(r):
    """{config: SQNR in dB of the MLP's second input, mean over layers}, or None without one."""
    fc2 = [t for t in r["layers"] if t.endswith(("fc2", "w_down"))]   # dense MLP, MoE experts
    if not fc2:
        return None
    return {mech_label(f, h): sum(r["operands"][f"{mech_label(f, h)}|{t}|x"]["sqnr_db"][0] for t in fc2) / len(fc2)
            for f, h in MECH_CONFIGS}


def rht_alpha_shift(r, fmt):
    """(layers where RHT lowers the Fprop input's alpha under fmt, layers where it raises it),
    each beyond 2 SE of the difference: the SE of the per-batch differences (both measured on
    the same batches), or, in a result without per-batch values, the two SEs as if independent."""
    op, lower, higher = r["operands"], 0, 0
    for t in r["layers"]:
        (a0, s0), (a1, s1) = op[f"{fmt}|{t}|x"]["alpha"], op[f"{fmt}+RHT|{t}|x"]["alpha"]
        b0, b1 = (_per_batch(r, "operands", "alpha", c, t, "x") for c in (fmt, f"{fmt}+RHT"))
        if b0 and b1:
            se = mean_se([y - x for x, y in zip(b0, b1)])[1]
            band = 2 * (se if se == se else 0)
        else:
            band = 2 * math.sqrt((s0 if s0 == s0 else 0) ** 2 + (s1 if s1 == s1 else 0) ** 2)
        lower += a1 < a0 - band
        higher += a1 > a0 + band
    return lower, higher


def mechanism_checks(r):
    """Plain statements, each from the numbers, on where the paper's mechanism shows."""
    labels, L = [mech_label(f, h) for f, h in MECH_CONFIGS], len(r["layers"])
    alpha = lambda c, o: _layer_mean(r, "operands", "alpha", c, o)  # noqa: E731
    out = ["- Fprop attenuation alpha, mean over layers (x / W): " + "; ".join(
        f"{c} {alpha(c, 'x'):.4f} / {alpha(c, 'W'):.4f}" for c in labels) +
        ". The paper's mechanism: E2M1 shrinks (alpha < 1), int4 does not."]
    for fmt in ("e2m1", "ufp4"):
        lower, higher = rht_alpha_shift(r, fmt)
        out.append(f"- RHT on the Fprop input x under {fmt}: alpha lower (more shrinkage) in {lower} of {L} "
                   f"layers, higher in {higher}, within 2 SE in {L - lower - higher}. The paper: RHT "
                   f"amplifies E2M1's shrinkage and leaves int4 unbiased.")
    sq = fc2_sqnr(r)
    if sq:
        out.append(f"- SQNR of the fc2 input ({r['mlp']} output), mean over layers: " + "; ".join(
            f"{c} {sq[c]:.2f} dB (paper {PAPER_FC2_SQNR[c]:.2f})" for c in labels) +
            ". The paper's numbers are its 1.5B model's fc2 input: a different model and data.")
    out.append("- Forward penalty with every layer's Fprop quantized (nats): " + "; ".join(
        f"{c} {_pm(r['forward_penalty'][f'{c}|all'], 5)}" for c in labels) + ".")
    grad = lambda metric, fmt: "; ".join(  # noqa: E731
        f"{c} {_layer_mean(r, 'gradient', metric, c):{fmt}}" for c in labels)
    out.append(f"- Wgrad (SR on dy), mean over layers: alpha_g {grad('alpha_g', '.4f')}; |bias|^2 / |g|^2 "
               f"{grad('bias2_rel', '.2e')}; variance ratio {grad('var_ratio', '.3f')}.")
    return out


def mechanism_markdown(r):
    labels = [mech_label(f, h) for f, h in MECH_CONFIGS]
    head = "| layer | " + " | ".join(labels) + " |"
    sep = "|---" * (len(labels) + 1) + "|"
    out = [f"# Mechanism at fixed weights: {r['ckpt']} (step {r['iter']}, trained in {r['recipe']})", "",
           f"{r['batches']} val batches of {r['tokens_per_batch']} tokens (the same batches for every "
           f"checkpoint of a config), the fp32 model, one GEMM quantized at a time as said; "
           f"mean ± SE over batches. e2m1 and ufp4 (int4) with fp32 1x16 block scales, with and "
           f"without the 16-point RHT. The MLP is {r['mlp']}: mlp.fc2.x is its nonlinearity's output.",
           "", "## What shows", "", *mechanism_checks(r), "",
           "## Forward penalty: CE with the Fprop GEMM quantized (RTNE) minus the exact CE (nats)", "",
           head, sep]
    for t in ("all", *r["layers"]):
        out.append(f"| {t} | " + " | ".join(_pm(r["forward_penalty"][f"{c}|{t}"], 5) for c in labels) + " |")
    out += ["", f"## Wgrad over {r['draws']} SR draws against the exact dW (Fprop and Dgrad exact)", "",
            "alpha_g = <mean g_q, g> / |g|^2; cosine of mean g_q and g; |bias|^2 / |g|^2 with the draw "
            "noise left in the mean subtracted; variance ratio = tr(Cov of one draw) / |g|^2.", "",
            "| layer | config | alpha_g | cosine | bias^2 / g^2 | variance ratio |",
            "|---|---|---|---|---|---|"]
    for t in r["layers"]:
        for c in labels:
            g = r["gradient"][f"{c}|{t}"]
            out.append(f"| {t} | {c} | {_pm(g['alpha_g'])} | {_pm(g['cosine'])} | "
                       f"{g['bias2_rel'][0]:.2e} ± {g['bias2_rel'][1]:.1e} | {_pm(g['var_ratio'])} |")
    for metric, digits in (("alpha", 4), ("sqnr_db", 2), ("b_eff", 3)):
        out += ["", f"## Fprop operands, RTNE: {metric}", "",
                "| layer | operand | " + " | ".join(labels) + " |", "|---|---" + "|---" * len(labels) + "|"]
        for t in r["layers"]:
            for op in OPERANDS:
                out.append(f"| {t} | {op} | " + " | ".join(
                    _pm(r["operands"][f"{c}|{t}|{op}"][metric], digits).lstrip("+") for c in labels) + " |")
    out += ["", "## Per-level bias E[|Q(t)| - |t| given the level], grid units, RTNE, all layers and batches",
            "", "Analytic (locally uniform density): e2m1 -0.125 at 2 and -0.25 at 4, int4 0 at every "
            "interior level.", "", "| operand | config | levels: bias (count) |", "|---|---|---|"]
    for key, v in sorted(r["level_bias"].items(), key=lambda kv: (kv[0].split("|")[1], kv[0])):
        c, kind = key.split("|")
        grid = fp4.GRIDS["e2m1" if c.startswith("e2m1") else "int4"].levels
        cells = [f"{q:g}: {b:+.3f} ({n})" if b is not None else f"{q:g}: - (0)"
                 for q, b, n in zip(grid, v["bias"], v["count"])]
        out.append(f"| {kind} | {c} | " + ", ".join(cells) + " |")
    return out


SUMMARY_ROWS = (  # title, (section, metric, operand or None), format
    ("Fprop alpha of x (the layer's input), mean over layers", ("operands", "alpha", "x"), ".4f"),
    ("Fprop alpha of W, mean over layers", ("operands", "alpha", "W"), ".4f"),
    ("Wgrad alpha_g (SR on dy), mean over layers", ("gradient", "alpha_g", None), ".4f"),
    ("Wgrad |bias|^2 / |g|^2, mean over layers", ("gradient", "bias2_rel", None), ".2e"),
)


def mechanism_summary(out_dir):
    """summary.md in out_dir: every checkpoint analysed there (its *_mechanism.json), one row each,
    so the mechanism can be read across training (steps) and across the recipe a checkpoint was
    trained in. Rebuilt from all the JSON files, so runs added later join the table."""
    results = []
    for path in sorted(glob.glob(os.path.join(out_dir, "*_mechanism.json"))):
        r = json.load(open(path))
        results.append((os.path.basename(path)[:-len("_mechanism.json")], r))
    if not results:
        sys.exit(f"error: no *_mechanism.json in {out_dir}: run `analyze.py mechanism --ckpt ... --out {out_dir}` first")
    results.sort(key=lambda nr: (nr[1]["iter"], nr[1]["recipe"], nr[0]))
    labels = [mech_label(f, h) for f, h in MECH_CONFIGS]
    head = ["| checkpoint | step | trained in | " + " | ".join(labels) + " |", "|---|---|---" + "|---" * len(labels) + "|"]
    out = ["# The mechanism at fixed weights, across checkpoints", "",
           f"From the `*_mechanism.json` of `analyze.py mechanism` in this folder ({len(results)} checkpoints; "
           "per checkpoint and layer: its `_mechanism.md`). Means over layers ± the SE over val batches "
           "of each batch's mean over layers" + ("" if all(r.get("operands_batches") for _, r in results)
           else " (in files without per-batch values: from the per-layer SEs as if the layers were "
           "independent, which is too small where a batch moves every layer alike)") + "; the forward penalty is the CE with every layer's Fprop "
           "quantized (RTNE) minus the exact CE, ± SE over batches. The paper's mechanism: E2M1 shrinks "
           "(alpha < 1) and RHT amplifies that; int4 is unbiased (alpha = 1) with or without RHT.", ""]

    def row(name, r, cells):
        return f"| {name} | {r['iter']} | {r['recipe']} | " + " | ".join(cells) + " |"
    out += ["## Forward penalty, all layers quantized (nats)", "", *head]
    out += [row(n, r, [_pm(r["forward_penalty"][f"{c}|all"], 5) for c in labels]) for n, r in results]
    for title, (section, metric, op), fmt in SUMMARY_ROWS:
        out += ["", f"## {title}", "", *head]
        for n, r in results:
            cells = []
            for c in labels:
                m, se = _layers_pm(r, section, metric, c, op)
                cells.append(f"{m:{fmt}} ± {se:.1e}")
            out.append(row(n, r, cells))
    out += ["", "## RHT on the Fprop input x: layers where alpha is lower with RHT (more shrinkage) / higher, "
            "beyond 2 SE", "", "| checkpoint | step | trained in | e2m1 | ufp4 | fc2 input SQNR, dB: " +
            " / ".join(labels) + " |", "|---|---|---|---|---|---|"]
    for n, r in results:
        cells = []
        for fmt in ("e2m1", "ufp4"):
            lower, higher = rht_alpha_shift(r, fmt)
            cells.append(f"{lower} / {higher} of {len(r['layers'])}")
        sq = fc2_sqnr(r)
        out.append(row(n, r, cells + [" / ".join(f"{sq[c]:.2f}" for c in labels) if sq else "-"]))
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {path}")
    return out


def ckpt_label(path):
    """A file name for a checkpoint's outputs: its two folders (ablate.py's forks/<base>/<arm> and
    bases/<base> stay apart), and the file's stem unless it is ckpt.pt."""
    parts = os.path.abspath(path).split(os.sep)
    stem = os.path.splitext(parts[-1])[0]
    return "_".join(parts[-3:-1] + ([] if stem == "ckpt" else [stem]))


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grids", help="draw the e2m1 vs int4 grid picture")
    g.add_argument("--out", default="docs/grids.png")
    t = sub.add_parser("tensors", help="alpha/SQNR/B_eff of a checkpoint's real GEMM operands, "
                                        "and the depth profile under each recipe")
    t.add_argument("--ckpt", required=True)
    t.add_argument("--out", default="out/shrinkage", help="prefix of the output files")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    m = sub.add_parser("mechanism", help="per layer, over batches: forward penalty, Wgrad bias over SR "
                                          "draws, alpha/SQNR/B_eff and per-level bias, e2m1 vs ufp4 +- RHT")
    m.add_argument("--ckpt", required=True, action="append", help="a checkpoint (give several: bases, "
                   "fork endpoints); outputs are named after the checkpoint's folder")
    m.add_argument("--out", default="out/mechanism", help="output folder")
    m.add_argument("--batches", type=int, default=8)
    m.add_argument("--draws", type=int, default=8, help="SR draws of each Wgrad (at least 2)")
    m.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    m.add_argument("--backend", default="torch", choices=("torch", "triton", "auto"),
                   help="fp4's reference (default) or the Triton kernels")
    ms = sub.add_parser("mechanism_summary", help="summary.md of every checkpoint's mechanism json in --out")
    ms.add_argument("--out", default="out/mechanism", help="the folder `mechanism` wrote to")
    args = p.parse_args(argv)
    try:
        if args.cmd in ("tensors", "mechanism"):
            check_device(args.device)   # (else a good checkpoint would be reported unreadable)
        run_command(args, p)
    except (CheckpointError, ConfigError) as e:  # each says which file or device, and why
        sys.exit(f"error: {e}")


def run_command(args, p):
    if args.cmd == "grids":
        draw_grids(args.out)
    elif args.cmd == "tensors":
        analyze_checkpoint(args.ckpt, args.out, args.device)
    elif args.cmd == "mechanism_summary":
        mechanism_summary(args.out)
    else:
        if args.draws < 2 or args.batches < 2:
            p.error("--draws and --batches must be at least 2 (the draw variance and the SE over "
                    "batches need two each)")
        labels = [ckpt_label(c) for c in args.ckpt]
        same = sorted({(l, c) for l, c in zip(labels, args.ckpt) if labels.count(l) > 1})
        if same:   # one's files would replace the other's
            p.error(f"checkpoints {', '.join(c for _, c in same)} get the same name "
                    f"{same[0][0]!r} (their last two folders): analyze them into separate --out folders")
        fp4.set_backend(args.backend)
        for ckpt, label in zip(args.ckpt, labels):
            mechanism(ckpt, os.path.join(args.out, label), args.batches, args.draws, args.device)
        mechanism_summary(args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
