"""
plot.py: a picture of a training run from its log.jsonl, without wandb.

    python plot.py out/moe_small_ufp4                  # writes out/moe_small_ufp4/log.png
    python plot.py out/a out/b/log.jsonl         # one PNG beside each log

Panels, each only when the log holds its keys: loss (train, smoothed, and the eval points of
train and val), learning rate, gradient norm, tokens/s, and for MoE runs the router losses and
the expert load per layer; FP4 telemetry runs add the attenuation alpha per GEMM operand.
Steps skipped as non-finite are marked on the loss panel. train.py calls plot_run(out_dir) at
the end of a run.

The y-limits come from a running median widened by the points' spread around it, so that one
spike (a bad step, the first step's warm-up time) does not flatten the rest of a curve, while
the loss's steady descent from its first value, many points long, and a noisy series' band stay
in view.
"""
import json
import math
import os
import statistics
import sys

LOG_NAME = "log.jsonl"

class PlotError(ValueError):
    pass

# -----------------------------------------------------------------------------
# reading

def log_path(path):
    """A run's out_dir or its log.jsonl -> the log.jsonl path (checked to exist)."""
    log = os.path.join(path, LOG_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(log):
        raise PlotError(f"no log at {log}: pass a train.py out_dir or a log.jsonl file")
    return log

def read_records(log):
    """The records of the last run in a log. Lines cut by a kill are skipped. A scratch run that
    appended to an old run's log restarts the iteration count: only the records from there on
    are kept (a resumed run continues the count, so it stays one run)."""
    records, lines = [], 0
    with open(log, encoding="utf-8", errors="replace") as f:  # a binary file: no records, no crash
        for line in f:
            lines += bool(line.strip())
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("iter"), (int, float)):
                records.append(rec)
    start, top = 0, -math.inf
    for i, rec in enumerate(records):
        if rec.get("type") not in ("train", "eval"):
            continue
        if rec["iter"] < top:
            start, top = i, rec["iter"]
        top = max(top, rec["iter"])
    if not records:
        # a killed run's log may hold one cut line; more lines and no record: another file
        raise PlotError(f"{log} holds no records yet: nothing to plot" if lines <= 1 else
                        f"{log} holds {lines} lines and no train.py record: not a train.py log.jsonl")
    return records[start:]

def series(records, kind, key):
    """(iters, values) of the finite numeric `key` of the records of one type."""
    pairs = [(r["iter"], r[key]) for r in records if r.get("type") == kind
             and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pairs], [p[1] for p in pairs]

# -----------------------------------------------------------------------------
# limits and smoothing

def running_median(values, window, stride=1):
    """Median of the window centred on every stride-th point."""
    half = window // 2
    return [statistics.median(values[max(0, i - half):i + half + 1])
            for i in range(0, len(values), stride)]

def robust_limits(values, extra=(), log=False):
    """y-limits spanning the running median of values (window ~2% of the points, at least 5)
    widened by the points' spread around it (2nd to 98th percentile), and the points in `extra`
    (few, trusted: the eval losses), with a margin. On a log axis all of it is taken in log10.
    The median is taken at about 400 points, so a 60k-record log takes well under a second."""
    if not values and not extra:
        return None
    to_axis = math.log10 if log else (lambda v: v)
    band = [to_axis(v) for v in extra]
    if values:
        values = [to_axis(v) for v in values]
        window = max(5, len(values) // 50) | 1
        stride = max(1, window // 8)
        smooth = running_median(values, window, stride)
        residual = sorted(v - smooth[min(round(i / stride), len(smooth) - 1)]
                          for i, v in enumerate(values))
        low = residual[int(0.02 * (len(residual) - 1))]
        high = residual[math.ceil(0.98 * (len(residual) - 1))]
        band += [min(smooth) + min(low, 0.0), max(smooth) + max(high, 0.0)]
    lo, hi = min(band), max(band)
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.05
    lo, hi = lo - pad, hi + pad
    return (10 ** lo, 10 ** hi) if log else (lo, hi)

def ema(values, span):
    """Exponential moving average, debiased at the start (as wandb's smoothing)."""
    beta, avg, out = 1 - 2 / (span + 1), 0.0, []
    for i, v in enumerate(values):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** (i + 1)))
    return out

# -----------------------------------------------------------------------------
# panels: each returns False (drawing nothing) when the log lacks its keys

def panel_loss(ax, records):
    it, loss = series(records, "train", "loss")
    ev_it, ev_train = series(records, "eval", "train_loss")
    vit, ev_val = series(records, "eval", "val_loss")
    if not loss and not ev_val:
        return False
    if loss:
        ax.plot(it, loss, color="C0", lw=0.6, alpha=0.35)
        ax.plot(it, ema(loss, max(2, len(loss) // 25)), color="C0", lw=1.4,
                label="train (smoothed)")
    cit, ce = series(records, "train", "ce_loss")
    if ce:   # MoE: the loss above includes the weighted aux and z losses
        ax.plot(cit, ema(ce, max(2, len(ce) // 25)), color="C4", lw=1, ls="--",
                label="train CE (smoothed)")
    if ev_train:
        ax.plot(ev_it, ev_train, "o-", color="C2", ms=3, lw=1, label="eval: train split")
    if ev_val:
        ax.plot(vit, ev_val, "s-", color="C3", ms=3, lw=1, label="eval: val split")
    for x in [r["iter"] for r in records if r.get("type") == "nonfinite"]:
        ax.axvline(x, color="r", lw=0.6, alpha=0.5)   # a skipped step
    ax.set_ylim(robust_limits(loss, ev_train + ev_val))
    if ev_val:
        ax.set_title(f"loss (last val {ev_val[-1]:.4f} at iter {vit[-1]})")
    else:
        ax.set_title("loss")
    ax.legend(fontsize=7)
    return True

def panel_scalar(ax, records, key, title, log=False, robust=True):
    it, v = series(records, "train", key)
    if not v:
        return False
    ax.plot(it, v, color="C1", lw=0.8)
    if log and min(v) > 0:
        ax.set_yscale("log")
    if robust:   # else matplotlib's own limits: the whole curve (a schedule has no outliers)
        ax.set_ylim(robust_limits(v, log=log and min(v) > 0))
    ax.set_title(title)
    return True

def panel_router(ax, records):
    drawn = False
    for key, color in (("aux_loss", "C5"), ("z_loss", "C6")):
        it, v = series(records, "train", key)
        if v:
            ax.plot(it, v, color=color, lw=0.8, label=key)
            drawn = True
    if drawn:
        ax.set_title("MoE router losses (unweighted)")
        ax.legend(fontsize=7)
    return drawn

def panel_expert_load(ax, records):
    """The busiest expert's share of the token-expert pairs, times the number of experts, per
    MoE layer: 1 is perfect balance, E is one expert taking every token."""
    rows = [(r["iter"], r["expert_load"]) for r in records if r.get("type") == "train"
            and isinstance(r.get("expert_load"), list) and r["expert_load"]]
    if not rows:
        return False
    n_layer = len(rows[-1][1])
    for layer in range(n_layer):
        pts = [(it, max(load[layer]) * len(load[layer])) for it, load in rows
               if len(load) == n_layer and load[layer]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=0.8, label=f"MoE layer {layer}")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_title("expert load: max share x n_expert (1 = balanced)")
    if n_layer <= 12:
        ax.legend(fontsize=6, ncol=2)
    return True

def panel_alpha(ax, records):
    tel = [r for r in records if r.get("type") == "telemetry" and isinstance(r.get("alpha"), dict)]
    ops = sorted({op for r in tel for op, v in r["alpha"].items() if isinstance(v, (int, float))})
    if not ops:
        return False
    for op in ops:
        pts = [(r["iter"], r["alpha"][op]) for r in tel
               if isinstance(r["alpha"].get(op), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=0.8, marker=".", ms=3, label=op)
    ax.set_title("FP4 attenuation alpha (mean over layers)")
    ax.legend(fontsize=6, ncol=2)
    return True

PANELS = (
    ("loss", panel_loss),
    ("lr", lambda ax, r: panel_scalar(ax, r, "lr", "learning rate", robust=False)),
    ("grad_norm", lambda ax, r: panel_scalar(ax, r, "grad_norm", "gradient norm (before clipping)",
                                             log=True)),
    ("tok_per_s", lambda ax, r: panel_scalar(ax, r, "tok_per_s", "tokens/s")),
    ("router", panel_router),
    ("expert_load", panel_expert_load),
    ("alpha", panel_alpha),
)

# -----------------------------------------------------------------------------

def panels_for(records):
    """Names of the panels this log can fill, in drawing order (a dry run on a scratch figure)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    names = []
    for name, draw in PANELS:
        ax.clear()
        if draw(ax, records):
            names.append(name)
    plt.close(fig)
    return names

def plot_run(path, png_path=None):
    """log.jsonl of a run (its out_dir or the file) -> a PNG beside it (log.png for log.jsonl);
    returns its path.
    Raises PlotError (one line) if there is no log or nothing in it to plot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    log = log_path(path)
    records = read_records(log)
    names = panels_for(records)
    if not names:
        raise PlotError(f"{log} has no train or eval records to plot")
    cols = 2 if len(names) > 1 else 1
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.2 * rows), squeeze=False)
    draw = dict(PANELS)
    for ax, name in zip(axes.flat, names):
        draw[name](ax, records)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.remove()   # an odd panel count: no empty frame
    fig.suptitle(os.path.abspath(os.path.dirname(log)), fontsize=9)
    fig.tight_layout()
    png = png_path or os.path.splitext(log)[0] + ".png"
    try:
        fig.savefig(png, dpi=100)
    finally:   # (a failed write too: main goes on with other runs)
        plt.close(fig)
    return png

def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    failed = 0
    for path in argv:
        try:
            print(plot_run(path))
        except (PlotError, OSError) as e:   # (an unwritable folder: the others still plot)
            print(f"error: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
