"""
bench.py: training throughput and memory of several recipes on one config, in one run.

    python bench.py configs/gpu/gpt2_small_bf16.py --recipes=bf16,ufp4,e2m1,nvfp4,mxfp4
    python bench.py configs/gpu/moe_gpt2_small_bf16.py --recipes=bf16,ufp4 --iters=20 --compile=True
    python bench.py configs/gpu/gpt2_small_bf16.py --recipes=bf16,mxfp4,mxfp4+recipe_fp8_gemm=True
    python bench.py configs/gpu/gpt2_small_bf16.py --recipes=bf16,mxfp4+recipe_fp8_gemm=True --rounds=2

A recipe may carry train.py overrides of its own after '+' (ufp4+recipe_format=mxint4; no commas
in them: --recipes is a comma list).

Each recipe is a real `train.main` run (no second trainer) with the same model, batch and seed:
`--warmup` steps, then `--iters` timed steps; a one-batch eval before the first step and at the
end, outside the timed steps. Step time is the median of
the timed steps' `dt_ms` from log.jsonl; peak memory is torch.cuda.max_memory_allocated over the
run (each recipe starts from a reset compiler: no CUDA-graph memory left by the one before).
A recipe that runs after another in the process can run a few % slower than alone
(results/bench/order_effect.md): --rounds=2 runs the list, then again in reverse order, and
takes each recipe's median over its rounds, so that every recipe runs early and late.
Extra --key=value arguments go to train.py. Writes OUT/bench.json and OUT/bench.md, with the
command, date, device and library versions, and ratios to the first recipe.
"""
import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import types

import torch

import checkpoint
import train


# train.py keys that bench.py sets itself: given as extra arguments they would change what is
# timed or where the run writes (an --out_dir of another run would be overwritten)
OWN_KEYS = ("recipe", "max_iters", "out_dir", "overwrite", "init_from", "eval_interval",
            "log_interval", "checkpoint")


def train_args(config, spec, warmup, iters, out_dir, extra):
    """train.py's arguments for one recipe spec (e.g. ufp4+recipe_format=mxint4: a recipe and
    train.py keys of its own, which win over the extra ones)."""
    recipe, own = train.spec_args(spec)
    return [config, recipe, f"--max_iters={warmup + iters}", f"--out_dir={out_dir}",
            "--eval_interval=1000000", "--eval_iters=1", "--log_interval=1", "--warmup_iters=1",
            "--checkpoint=False", "--final_sample_tokens=0",
            "--overwrite=True"] + list(extra) + own  # (replaces the last run)


def changed_own_keys(config, spec, warmup, iters, out_dir, extra):
    """The OWN_KEYS that a recipe spec's overrides or the extra arguments (a second config file
    included) set to other values than bench.py's own."""
    mine = train.get_config(train_args(config, spec.split("+")[0], warmup, iters, out_dir, []))
    cfg = train.get_config(train_args(config, spec, warmup, iters, out_dir, extra))
    return [k for k in OWN_KEYS if cfg[k] != mine[k]], cfg


def check_args(args, extra):
    """Every problem with the command before the first recipe runs: one line (ValueError)."""
    if args.warmup < 0 or args.iters < 1:
        raise ValueError(f"--warmup must be >= 0 and --iters >= 1 (got {args.warmup}, {args.iters})")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1 (got {args.rounds})")
    specs = [r for r in args.recipes.split(",") if r]
    if not specs:
        raise ValueError("--recipes is empty: give a comma list, e.g. --recipes=bf16,ufp4")
    twice = sorted({r for r in specs if specs.count(r) > 1})
    if twice:
        raise ValueError(f"--recipes names {twice} more than once: each recipe gets one row "
                         f"(for repeats use --rounds)")
    for k in range(args.rounds):
        for spec in specs:
            d = recipe_dir(args, k, spec)
            kept = [f for f in CHECKPOINT_FILES if os.path.exists(os.path.join(d, f))]
            if kept:  # bench's own runs write no checkpoint: these are another run's
                raise ValueError(f"{d} holds another run's {', '.join(kept)}, "
                                 f"which bench.py would delete: pick another --out")
    own = sorted({a[2:].split("=")[0] for a in extra if a.startswith("--")} & set(OWN_KEYS))
    if own:
        raise ValueError(f"{', '.join('--' + k for k in own)}: set by bench.py itself (the run's "
                         f"folder is --out, the recipes --recipes, the length --warmup/--iters)")
    for spec in specs:
        try:
            changed, cfg = changed_own_keys(args.config, spec, args.warmup, args.iters, args.out, extra)
        except train.ConfigError as e:
            raise ValueError(f"recipe {spec!r}: {e}") from None
        if changed:   # through the spec, or a config file among the extra arguments
            raise ValueError(f"recipe {spec!r} with {' '.join(extra) or 'no extra arguments'}: "
                             f"{', '.join(changed)} set by bench.py itself would change (the run's "
                             f"folder is --out, the length --warmup/--iters): drop them")
    try:   # an unknown dataset, or missing input files: before any recipe has run
        train.dataset_needs_build(types.SimpleNamespace(**cfg),
                                  os.path.join(cfg["data_dir"], cfg["dataset"]))
    except train.ConfigError as e:
        raise ValueError(str(e)) from None
    return specs


CHECKPOINT_FILES = (checkpoint.LATEST, checkpoint.BEST, checkpoint.PREVIOUS, checkpoint.WEIGHTS)


def recipe_dir(args, k, spec):
    """Where round k (from 0) of one recipe runs: OUT/<recipe>, or OUT/round<k+1>/<recipe>."""
    return os.path.join(args.out, *([f"round{k + 1}"] if args.rounds > 1 else []), spec.replace("/", "_"))


def bench_one(config, spec, warmup, iters, out_dir, extra):
    args = train_args(config, spec, warmup, iters, out_dir, extra)
    if torch.cuda.is_available():
        # the previous recipe's compiled graphs hold their CUDA-graph memory pool until reset:
        # without this, every recipe's peak would include the ones before it
        torch.compiler.reset()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    train.main(args)
    recs = [json.loads(l) for l in open(os.path.join(out_dir, "log.jsonl"))]
    steps = [r for r in recs if r.get("type") == "train" and r["iter"] >= warmup]
    dt = statistics.median(r["dt_ms"] for r in steps)
    cfg = train.get_config(args)
    tokens = cfg["gradient_accumulation_steps"] * cfg["batch_size"] * cfg["block_size"]
    # MFU from the median step, as tokens/s: a record's own MFU is of train.py's running average
    # of step times, which carries the warm-up steps (compilation, graph capture) into the window
    mfu = steps[-1]["mfu"] / steps[-1]["tok_per_s"] * tokens / dt * 1000 if "mfu" in steps[-1] else None
    return dict(recipe=spec, step_ms=dt, tok_per_s=tokens / dt * 1000, tokens_per_iter=tokens,
                mfu=mfu,
                peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
                loss_last=steps[-1]["loss"])


def combine(runs):
    """One recipe's row from its rounds' rows: the median step time (and the tokens/s and MFU
    it gives), the largest peak memory, each round's step time in step_ms_rounds."""
    row = dict(runs[0])
    row["step_ms"] = statistics.median(r["step_ms"] for r in runs)
    row["tok_per_s"] = row["tokens_per_iter"] / row["step_ms"] * 1000
    if row["mfu"] is not None:  # (MFU is proportional to tokens/s)
        row["mfu"] *= runs[0]["step_ms"] / row["step_ms"]
    if row["peak_mem_gib"] is not None:
        row["peak_mem_gib"] = max(r["peak_mem_gib"] for r in runs)
    row["step_ms_rounds"] = [r["step_ms"] for r in runs]
    return row


def run_rounds(args, recipes, extra):
    """Every recipe once per round, every other round in reverse order: -> rows in --recipes order."""
    runs = {r: [] for r in recipes}
    for k in range(args.rounds):
        for r in (recipes if k % 2 == 0 else recipes[::-1]):
            print(f"--- {r}" + (f" (round {k + 1} of {args.rounds})" if args.rounds > 1 else ""), flush=True)
            runs[r].append(bench_one(args.config, r, args.warmup, args.iters, recipe_dir(args, k, r), extra))
    return [combine(runs[r]) for r in recipes]


def main(argv):
    # no abbreviations: extra arguments go on to train.py, whose --recipe would read as --recipes
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--recipes", default="bf16,ufp4,e2m1,nvfp4,mxfp4")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default="out/bench")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the list this many times, every other time in reverse order; the median per recipe")
    args, extra = p.parse_known_args(argv)
    try:
        recipes = check_args(args, extra)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not torch.cuda.is_available():
        print("note: no GPU: these are CPU timings of the torch reference, not FP4 speed")
    try:
        rows = run_rounds(args, recipes, extra)
    except (train.ConfigError, checkpoint.CheckpointError) as e:   # e.g. no network for the data
        sys.exit(f"error: {e}")
    base = rows[0]
    for row in rows:
        row["speed_vs_first"] = row["tok_per_s"] / base["tok_per_s"]
        if base["peak_mem_gib"]:
            row["mem_vs_first"] = row["peak_mem_gib"] / base["peak_mem_gib"]
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:   # a CPU machine without triton
        triton_version = None
    env = dict(command="python bench.py " + " ".join(argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               torch=torch.__version__, triton=triton_version)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    lines = [f"`{env['command']}` on {env['date']}, {env['device']}, torch {env['torch']}, "
             f"triton {env['triton']}" + ("" if torch.cuda.is_available() else
                                          " (CPU timings of the torch reference, not FP4 speed)"), "",
             f"| recipe | step ms | tokens/s | vs {base['recipe']} | MFU | peak GiB | mem vs {base['recipe']} |"
             + (" step ms by round |" if args.rounds > 1 else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if args.rounds > 1 else "")]
    for r in rows:
        mem = f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] else "-"
        rel = f"{r['mem_vs_first']:.2f}" if r.get("mem_vs_first") else "-"
        mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "-"
        lines.append(f"| {r['recipe']} | {r['step_ms']:.1f} | {r['tok_per_s']:,.0f} | "
                     f"{r['speed_vs_first']:.3f} | {mfu} | {mem} | {rel} |"
                     + (f" {', '.join(f'{t:.1f}' for t in r['step_ms_rounds'])} |" if args.rounds > 1 else ""))
    text = "\n".join(lines)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
