"""The DDP scaling figure from dev/gpu_ddp_scaling.sh's JSON files (no GPU needed): tokens/s
on 1 and N GPUs per recipe, with the speed-up, and each recipe's loss curves on 1 and N GPUs.

    python dev/ddp_figure.py results/ddp/ddp_*.json --out results/ddp/ddp_scaling.png
"""
import argparse
import json
import sys


def figure(runs, out):
    """runs: gpu_ddp_scaling.sh's JSON dicts (one per recipe) -> a PNG at out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not runs:
        raise SystemExit("no runs to plot")
    gpus = {r["gpus"] for r in runs}
    if len(gpus) != 1:
        raise SystemExit(f"the runs have different GPU counts {sorted(gpus)}: plot them separately")
    modes = {(r.get("compile"), r.get("compile_mode")) for r in runs}
    if len(modes) != 1:
        raise SystemExit(f"the runs have different compile settings {sorted(map(str, modes))}: "
                         f"plot them separately")
    n = gpus.pop()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r["recipe"] for r in runs]
    xs = range(len(runs))
    ax1.bar([x - 0.2 for x in xs], [r["tok_per_s_1"] / 1e3 for r in runs], 0.4, label="1 GPU")
    ax1.bar([x + 0.2 for x in xs], [r["tok_per_s_n"] / 1e3 for r in runs], 0.4, label=f"{n} GPUs")
    for x, r in zip(xs, runs):
        ax1.text(x + 0.2, r["tok_per_s_n"] / 1e3, f"{r['scaling']:.2f}x", ha="center", va="bottom")
    ax1.set_xticks(list(xs), names)
    ax1.set_ylabel("tokens/s (thousands)")
    ax1.set_title(f"DDP throughput, same global batch ({runs[0].get('gpu', '')})")
    ax1.legend(fontsize=8)
    for i, r in enumerate(runs):
        ax2.plot(r["losses_1"], color=f"C{i}", lw=1, label=f"{r['recipe']}, 1 GPU")
        ax2.plot(r["losses_n"], color=f"C{i}", lw=1, ls="--", label=f"{r['recipe']}, {n} GPUs")
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("train loss")
    ax2.set_title("loss curves (each rank draws its own batches)")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="ddp_<recipe>_*.json files")
    p.add_argument("--out", default="ddp_scaling.png")
    args = p.parse_args(argv)
    runs = []
    for path in args.runs:
        with open(path) as fh:
            runs.append(json.load(fh))
    order = {"bf16": 0, "ufp4": 1, "e2m1": 2, "nvfp4": 3, "mxfp4": 4}
    runs.sort(key=lambda r: (order.get(r["recipe"], 9), r["recipe"]))
    figure(runs, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
