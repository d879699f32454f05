"""
ablate.py: run a list of recipe arms on one config with paired seeds, then compare them.

    python ablate.py configs/gpt_ablate.py --arms=bf16,e2m1,ufp4 --seeds=0,1 --parallel=4
    python ablate.py configs/moe_ablate.py --arms=paper_moe --gpus=0,1 --out=out/ablate_moe
    python ablate.py configs/gpt_ablate.py --report_only      # just redo the table and plots

Every run is `python train.py CONFIG --out_dir=OUT/<arm>_s<seed> --seed=<seed> <arm overrides>`
(no second trainer). Paired: every arm of one seed starts from the same init and sees the same
batches (the model init and the loader are seeded by `seed`; SR draws do not move them).
Finished runs are skipped and interrupted ones resumed, so a sweep can be split over sittings.
Several runs share a GPU (--parallel) or spread over GPUs (--gpus, round robin).

Output in OUT: summary.md (final train/val loss, and the paper's BF16-relative gap
|L - L_bf16| / L_bf16 averaged over the last 10 % of logged steps, mean and spread over seeds),
summary.json, loss_curves.png.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# An arm is a name and the train.py overrides that make it. bf16 is the reference of the gap.
ARMS = {
    "bf16": {"recipe": "bf16"},
    "e2m1": {"recipe": "e2m1"},                                   # paper baseline: RHT Wgrad, SR dy
    "ufp4": {"recipe": "ufp4"},                                   # int4, RHT on all three GEMMs
    "e2m1_rht_all": {"recipe": "e2m1", "recipe_rht": "all"},      # full RHT on the e2m1 grid
    "int4_rht_wgrad": {"recipe": "ufp4", "recipe_rht": "wgrad"},  # uniform grid, RHT Wgrad only
    "ufp4_no_sr": {"recipe": "ufp4", "recipe_sr_dy": False},
    "ufp4_sr16": {"recipe": "ufp4", "sr_bits": 16},              # 16 random bits per SR draw, not 8
    "nvfp4": {"recipe": "nvfp4"},
    "mxfp4": {"recipe": "mxfp4"},
}
GROUPS = {  # the sweeps of the paper's ablation, at small scale
    "paper_gpt": ["bf16", "e2m1", "ufp4", "e2m1_rht_all", "int4_rht_wgrad", "ufp4_no_sr", "nvfp4", "mxfp4"],
    "paper_moe": ["bf16", "e2m1", "ufp4", "nvfp4"],
}


def run_dir(out, arm, seed):
    return os.path.join(out, f"{arm}_s{seed}")


def read_log(path):
    recs = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    recs.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by a kill: the resumed run writes it again
    return recs


def is_done(d):
    return os.path.exists(os.path.join(d, "done.json"))


def command(config, arm, seed, out, extra):
    d = run_dir(out, arm, seed)
    args = [sys.executable, "train.py", config, f"--out_dir={d}", f"--seed={seed}"]
    args += [f"--{k}={v}" for k, v in ARMS[arm].items()] + list(extra)
    if os.path.exists(os.path.join(d, "ckpt.pt")):
        args.append("--init_from=resume")
    return args


def run_all(config, arms, seeds, out, extra, parallel, gpus):
    todo = [(a, s) for s in seeds for a in arms if not is_done(run_dir(out, a, s))]
    print(f"{len(arms) * len(seeds) - len(todo)} runs already done, {len(todo)} to run")
    running, failed, slot = [], [], 0
    while todo or running:
        while todo and len(running) < parallel:
            arm, seed = todo.pop(0)
            d = run_dir(out, arm, seed)
            os.makedirs(d, exist_ok=True)
            env = dict(os.environ)
            if parallel > 1 and not gpus:
                env.setdefault("OMP_NUM_THREADS", "1")  # CPU runs side by side: one thread each
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
                slot += 1
            logf = open(os.path.join(d, "stdout.txt"), "a")
            p = subprocess.Popen(command(config, arm, seed, out, extra), stdout=logf,
                                 stderr=subprocess.STDOUT, env=env)
            running.append((p, arm, seed, logf, time.time()))
            print(f"started {arm} seed {seed} -> {d}")
        time.sleep(1)
        for item in list(running):
            p, arm, seed, logf, t0 = item
            if p.poll() is None:
                continue
            running.remove(item)
            logf.close()
            d = run_dir(out, arm, seed)
            if p.returncode == 0:
                with open(os.path.join(d, "done.json"), "w") as f:
                    json.dump(dict(arm=arm, seed=seed, seconds=time.time() - t0), f)
                print(f"finished {arm} seed {seed} in {time.time() - t0:.0f} s")
            else:
                failed.append((arm, seed))
                print(f"FAILED {arm} seed {seed} (exit {p.returncode}); see {d}/stdout.txt")
    return failed


def _tail(curve, ref):
    common = sorted(set(curve) & set(ref))
    return common[-max(1, len(common) // 10):] if common else []


def gap(curve, ref):
    """The paper's gap: mean of |L - L_ref| / L_ref over the last 10 % of the steps both curves
    logged. Per-step noise makes it positive even between equal recipes."""
    tail = _tail(curve, ref)
    return statistics.mean(abs(curve[i] - ref[i]) / ref[i] for i in tail) if tail else float("nan")


def signed_gap(curve, ref):
    """Mean of (L - L_ref) / L_ref over the same tail: which side, without the noise floor
    (|signed_gap| <= gap)."""
    tail = _tail(curve, ref)
    return statistics.mean((curve[i] - ref[i]) / ref[i] for i in tail) if tail else float("nan")


def val_gap(val, ref):
    """100 (V - V_ref) / V_ref at the last eval both runs reached (a stopped run is not compared
    with a finished one's end)."""
    common = set(val) & set(ref)
    return 100 * (val[max(common)] / ref[max(common)] - 1) if common else float("nan")


def summarize(out, arms, seeds):
    runs = {}
    for arm in arms:
        for seed in seeds:
            recs = read_log(os.path.join(run_dir(out, arm, seed), "log.jsonl"))
            train = {r["iter"]: r["loss"] for r in recs if r.get("type") == "train"}
            evals = [r for r in recs if r.get("type") == "eval"]
            tel = [r for r in recs if r.get("type") == "telemetry"]
            if train:
                runs[arm, seed] = dict(train=train, val={r["iter"]: r["val_loss"] for r in evals},
                                       final_val=evals[-1]["val_loss"] if evals else None,
                                       final_train=evals[-1]["train_loss"] if evals else None,
                                       alpha=tel[-1]["alpha"] if tel else {})
    rows = []
    for arm in arms:
        got = [s for s in seeds if (arm, s) in runs]
        if not got:
            continue
        paired = [s for s in got if ("bf16", s) in runs]
        ref = lambda s: runs["bf16", s]  # noqa: E731
        vals = [runs[arm, s]["final_val"] for s in got if runs[arm, s]["final_val"] is not None]
        trs = [runs[arm, s]["final_train"] for s in got if runs[arm, s]["final_train"] is not None]
        val_gaps = [val_gap(runs[arm, s]["val"], ref(s)["val"]) for s in paired]
        alphas = {}
        for s in got:
            for op, a in runs[arm, s]["alpha"].items():
                alphas.setdefault(op, []).append(a)
        rows.append(dict(arm=arm, seeds=len(got), overrides=ARMS[arm], val=_ms(vals), train=_ms(trs),
                         gap_pct=_ms([100 * gap(runs[arm, s]["train"], ref(s)["train"]) for s in paired]),
                         signed_gap_pct=_ms([100 * signed_gap(runs[arm, s]["train"], ref(s)["train"])
                                             for s in paired]),
                         val_gap_pct=_ms(val_gaps),
                         alpha={op: statistics.mean(v) for op, v in alphas.items()}))
    lines = ["| arm | overrides | seeds | final train loss | final val loss | gap vs bf16 (%) "
             "| signed gap (%) | val gap (%) | alpha Fprop x / W |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ov = ", ".join(f"{k}={v}" for k, v in r["overrides"].items())
        a = r["alpha"]
        al = f"{a['fprop_x']:.4f} / {a['fprop_w']:.4f}" if "fprop_x" in a and "fprop_w" in a else "-"
        lines.append(f"| {r['arm']} | {ov} | {r['seeds']} | {_fmt(r['train'])} | {_fmt(r['val'])} | "
                     f"{_fmt(r['gap_pct'], 3)} | {_fmt(r['signed_gap_pct'], 3)} | "
                     f"{_fmt(r['val_gap_pct'], 3)} | {al} |")
    table = "\n".join(lines)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(table + "\n\ngap: the paper's |L - L_bf16| / L_bf16 of the training loss, paired by "
                "seed, averaged over the last 10 % of logged steps (per-step noise keeps it above 0); "
                "signed gap: the mean of (L - L_bf16) / L_bf16 over the same steps; val gap: the "
                "same for the val loss at the last eval both runs reached; mean ± std over seeds. alpha: <Q(A), A> / ||A||^2 of "
                "the Fprop operands at the last telemetry step, mean over layers (and seeds).\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(out, runs, arms, seeds)
    print(table)
    return rows


def _ms(xs):
    xs = [x for x in xs if x == x]
    if not xs:
        return None
    return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _fmt(ms, digits=4):
    return "-" if ms is None else f"{ms[0]:.{digits}f} ± {ms[1]:.{digits}f}"


def plot(out, runs, arms, seeds):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, arm in enumerate(arms):
        for seed in seeds:
            if (arm, seed) not in runs:
                continue
            c = runs[arm, seed]["train"]
            it = sorted(c)
            kw = dict(color=f"C{i}", lw=1, label=arm if seed == seeds[0] else None)
            ax1.plot(it, [c[j] for j in it], **kw)
            if ("bf16", seed) in runs and arm != "bf16":
                ref = runs["bf16", seed]["train"]
                both = [j for j in it if j in ref]
                g = [100 * (c[j] - ref[j]) / ref[j] for j in both]
                k = max(1, len(g) // 30)  # moving average: the paired gap is noisy step to step
                ax2.plot(both[k - 1:], [statistics.mean(g[i - k + 1:i + 1]) for i in range(k - 1, len(g))], **kw)
    ax1.set_xlabel("iteration"), ax1.set_ylabel("train loss"), ax1.set_title("loss curves")
    lo = min(min(r["train"].values()) for r in runs.values())
    ax1.set_ylim(lo * 0.98, lo * 1.6)
    ax2.axhline(0, color="k", lw=0.5)
    ax2.set_xlabel("iteration"), ax2.set_ylabel("(L - L_bf16) / L_bf16  (%)")
    ax2.set_title("paired gap to bf16 (same seed), moving average")
    ax1.legend(fontsize=8), ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss_curves.png"), dpi=110)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--arms", default="paper_gpt", help=f"comma list of {sorted(ARMS)} or a group {sorted(GROUPS)}")
    p.add_argument("--seeds", default="0")
    p.add_argument("--out", default="")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (several share a GPU)")
    p.add_argument("--gpus", default="", help="comma list of GPU ids to spread runs over")
    p.add_argument("--report_only", action="store_true")
    args, extra = p.parse_known_args(argv)
    arms = []
    for a in args.arms.split(","):
        arms += GROUPS.get(a, [a])
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; valid arms: {sorted(ARMS)}, groups: {sorted(GROUPS)}")
    if "bf16" not in arms:
        arms = ["bf16"] + arms  # the reference of every gap
    bad = [e for e in extra if not e.startswith("--")]
    if bad:
        p.error(f"unexpected arguments {bad}; train.py overrides look like --key=value")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out or os.path.join("out", "ablate_" + os.path.splitext(os.path.basename(args.config))[0])
    os.makedirs(out, exist_ok=True)
    failed = [] if args.report_only else run_all(args.config, arms, seeds, out, extra, args.parallel,
                                                 [g for g in args.gpus.split(",") if g])
    summarize(out, arms, seeds)
    if failed:
        sys.exit(f"{len(failed)} run(s) failed: {failed}")


if __name__ == "__main__":
    main(sys.argv[1:])
