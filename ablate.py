"""
ablate.py: compare FP4 recipes ("arms") by training through train.py, paired so that effects of
a few thousandths of a nat resolve.

    python ablate.py fork configs/gpu/ablate_gpt.py --bases=0-7 --arms=headline --fork_at=1000 \
        --eval_iters=100 --parallel=8 --gpus=0 --drop_fork_ckpts --out=out/fork_gpt
    python ablate.py fork configs/gpu/ablate_gpt.py --bases=0-7 --arms=placement,formats ... (same --out)
    python ablate.py fork configs/gpu/ablate_gpt.py --bases=0-2 --base_recipe=e2m1,ufp4 \
        --arms=e2m1,ufp4 ... (same --out)   # the crossover; the reference arm (bf16) comes along
    python ablate.py fork configs/gpu/ablate_gpt.py --bases=10-11 --arms=bf16,e2m1,ufp4 \
        --fork_at=500 ... (same --out)      # a second fork point, on bases of their own
    python ablate.py report --out=out/fork_gpt        # the tables again, from every finished run
    python ablate.py pack --out=out/fork_gpt --to=runs.tgz   # logs only: for the next sitting
    python ablate.py pack --out=out/fork_gpt --to=runs.tgz --merge=runs.tgz   # add to earlier runs
    python ablate.py report --runs=runs.tgz --out=DIR # the tables of the packed runs, into DIR
    python ablate.py seeds configs/gpt_ablate.py --arms=bf16,e2m1,ufp4 --seeds=0,1   # the older design

The forked design (`fork`, the headline). A base is a run of `--base_recipe` (bf16 by default)
with seed s, trained to the fork point p of the config's schedule (`--max_iters=p
--lr_decay_iters=T --always_save_checkpoint=True`, T the config's max_iters). Every arm then
continues the base from its step-p checkpoint to T in its own out_dir (`--init_from=resume
--resume_from=...`): same weights, optimizer state and batches; only the recipe and its SR draws
differ. Each fork is scored twice: its mean train loss over the steps p..T-1 (logged every step)
and its val loss at T on `--eval_iters` batches, under the arm's own recipe (its quantized
Fprop), as train.py evaluates. train.py draws the eval batches from a loader seeded with seed + 1,
fresh at every eval, so every fork of a base is scored on one fixed eval set. A contrast
(arm - ref) is paired by base: mean, SE and the per-base values.
Why forks: runs of one config from scratch diverge chaotically early and end some 0.02 nats
apart, a per-run offset that averaging over the tail does not remove; forks share the trajectory
up to p, so only the recipe's effect over the window p..T and the SR noise separate them. A fork
measures the recipe's effect over its window, not over a whole run: fork at several points
(`--fork_at=500,1000`) to see how it grows, and train bases in two recipes (the crossover) to
tell a better recipe from a better starting point.
The fork noise is measured, not assumed: the arm ufp4_sr16 repeats ufp4 with 16 random bits per
SR draw where the Triton kernels draw 8, which gives every element other random bits, i.e.
another SR stream (and a finer rounding probability); bf16_again repeats bf16 and measures the
GPU's run-to-run noise alone (on an H200 two bf16 forks of one checkpoint differ from their
second step: some kernels are not deterministic). The torch reference (CPU) is deterministic
and ignores sr_bits: there both contrasts are 0. For the same reason a base trained again is
another base: every fork records which training of its base it started from (the base's losses
at the fork point), and the report pairs only forks of one training.

Runs: bases first (one job per fork point, resumed from the previous one), then the forks, at most
--parallel at once, spread over --gpus (each run on the GPU with the fewest of ours). No
memory-aware packing: eight forks of the 33.5M-parameter configs/gpu/ablate_gpt.py share one H200
(126,516 MiB at the peak), twelve ran out of memory. Start the CUDA MPS daemon first
(`nvidia-cuda-mps-control -d`): without it the processes of one GPU time-slice instead of running
concurrently. Finished runs are skipped and interrupted ones resume from their last checkpoint, so
a sweep spreads over sittings (--stop_after ends a sitting on time); the report always covers every
finished run in --out. A sitting on a fresh machine needs only the logs of earlier ones (`pack`,
then unpack into --out): finished forks are skipped, and only the bases that unfinished forks start
from are trained again. Or it runs in an empty --out (new bases, say) and `pack --merge` adds its
runs to the earlier archive; `report --runs` then recomputes the tables from all of them.
Layout of --out: bases/<recipe>_s<seed> (the base's run), bases/<recipe>_s<seed>_at<p>/ckpt.pt
(its state at step p, a hard link), forks/<recipe>_s<seed>_at<p>_to<end>/<arm> (one fork),
logs/ (train.py's output), ablate.json (config and overrides: later sittings must match),
summary.md, summary.json, fork_curves.png.

The seed-per-arm design (`seeds`): every arm from scratch with paired seeds (same init and
batches per seed), the paper's |L - L_bf16| / L_bf16 gap over the last 10 % of steps;
summary.md, summary.json, loss_curves.png.
"""
import argparse
import glob
import itertools
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.abspath(__file__))

def _has_cuda():
    import torch   # only here: the runs are train.py processes, this file needs no torch
    return torch.cuda.is_available()

# An arm is a name and the train.py overrides that make it.
ARMS = {
    "bf16": {"recipe": "bf16"},
    "e2m1": {"recipe": "e2m1"},                 # the paper's baseline: RHT on Wgrad, SR on dy
    "ufp4": {"recipe": "ufp4"},                 # int4, RHT on all three GEMMs, SR on dy
    "ufp4_sr16": {"recipe": "ufp4", "sr_bits": 16},  # the fork noise: ufp4 with another SR stream
    "bf16_again": {"recipe": "bf16"},           # bf16 once more: the GPU's own run-to-run noise
    # the paper's RHT-placement table: the int4 grid, fp32 block scales, SR on dy
    "int4_rht_none": {"recipe": "ufp4", "recipe_rht": "none"},
    "int4_rht_wgrad": {"recipe": "ufp4", "recipe_rht": "wgrad"},
    "int4_rht_dgrad_wgrad": {"recipe": "ufp4", "recipe_rht": "dgrad,wgrad"},
    "int4_rht_fprop_wgrad": {"recipe": "ufp4", "recipe_rht": "fprop,wgrad"},
    "ufp4_no_sr": {"recipe": "ufp4", "recipe_sr_dy": False},      # RHT on all three, RTNE on dy
    "e2m1_rht_all": {"recipe": "e2m1", "recipe_rht": "all"},
    # the hardware formats, and UFP4's grid with their scales (quality to weigh against speed).
    # Power-of-two-scaled arms keep bf16 GEMMs, as the committed runs did: the FP8 GEMM path
    # computes the same products except in blocks out of its window (docs/formats.md)
    "nvfp4": {"recipe": "nvfp4"},
    "mxfp4": {"recipe": "mxfp4", "recipe_fp8_gemm": False},
    "ufp4_e8m0": {"recipe": "ufp4", "recipe_format": "int4/16/e8m0", "recipe_fp8_gemm": False},
    "mxint4": {"recipe": "ufp4", "recipe_format": "mxint4", "recipe_fp8_gemm": False},
    "nvint4": {"recipe": "ufp4", "recipe_format": "nvint4"},           # int4, e4m3 + tensor scale
}
GROUPS = {
    "headline": ["bf16", "e2m1", "ufp4", "ufp4_sr16"],
    "noise": ["ufp4_sr16", "bf16_again"],
    "placement": ["int4_rht_none", "int4_rht_wgrad", "int4_rht_dgrad_wgrad", "int4_rht_fprop_wgrad",
                  "ufp4", "ufp4_no_sr", "e2m1", "e2m1_rht_all"],
    "formats": ["nvfp4", "mxfp4", "nvint4", "ufp4_e8m0", "mxint4"],
    # the seed-per-arm sweeps
    "paper_gpt": ["bf16", "e2m1", "ufp4", "e2m1_rht_all", "int4_rht_wgrad", "ufp4_no_sr", "nvfp4", "mxfp4"],
    "paper_moe": ["bf16", "e2m1", "ufp4", "nvfp4"],
}
NOISE = (  # (arm, the arm it repeats, what differs between the two forks of one base)
    ("ufp4_sr16", "ufp4", "another SR stream, and the GPU's run-to-run noise"),
    ("bf16_again", "bf16", "nothing but the GPU's run-to-run noise (non-deterministic kernels)"),
)

# The paper's numbers (Dense 1.5B unless said, whole training runs): context for our rows, not a
# prediction for a 34M model whose recipe acts over a fork window of a few hundred steps.
PAPER_GAP_PCT = {"e2m1": 1.2570, "ufp4": 0.9673}  # |L - L_bf16| / L_bf16 (%), last 1000 steps
PAPER_REDUCTION_PCT = (("dense 1.5B", 23.0), ("MoE 7.9B", 21.7), ("MoE 124B", 19.9))
PAPER_LOSS = {  # the RHT-placement ablation: mean LM loss, int4 grid, SR on dy unless said
    "int4_rht_none": 1.89202, "int4_rht_wgrad": 1.88721, "int4_rht_dgrad_wgrad": 1.88912,
    "int4_rht_fprop_wgrad": 1.88558, "ufp4": 1.88079, "ufp4_no_sr": 1.88535,
}
# The formats table (against ufp4): grid, block, scale and RHT of each arm; all SR on dy.
FORMAT_OF = {
    "ufp4": "int4, 1x16, fp32 scale; RHT on all three",
    "e2m1": "e2m1, 1x16, fp32 scale; RHT on Wgrad",
    "nvfp4": "e2m1, 1x16 (W 16x16), e4m3 + fp32 tensor scale; RHT on Wgrad; last 15 % of blocks bf16",
    "mxfp4": "e2m1, 1x32, e8m0 scale; RHT on Wgrad",
    "nvint4": "int4, 1x16, e4m3 + fp32 tensor scale; RHT on all three",
    "ufp4_e8m0": "int4, 1x16, e8m0 scale; RHT on all three",
    "mxint4": "int4, 1x32, e8m0 scale; RHT on all three",
}
# keys ablate.py sets itself: an extra --key=value may not change them
OWN_KEYS = ("out_dir", "seed", "max_iters", "lr_decay_iters", "init_from", "resume_from",
            "always_save_checkpoint", "log_interval", "eval_iters", "recipe", "sr_bits")
SEEDS_OWN_KEYS = ("out_dir", "seed", "init_from", "resume_from", "recipe", "sr_bits")


def check_extra(extra, own_keys, parser, instead):
    """Extra arguments are train.py overrides (--key=value) that leave ablate.py's own keys alone:
    an arm's recipe or a run's seed set there would silently make every arm the same run."""
    bad = [e for e in extra if not e.startswith("--")]
    own = [e for e in extra if e[2:].split("=")[0] in own_keys or e[2:].startswith("recipe_")]
    if bad or own:
        parser.error(f"unexpected arguments {bad or own}: extra train.py overrides look like "
                     f"--key=value and may not set {', '.join(own_keys)} or recipe_* (ablate.py "
                     f"sets those; use {instead})")


def expand_arms(spec, parser):
    arms = []
    for a in spec.split(","):
        for arm in GROUPS.get(a, [a]):
            if arm not in arms:
                arms.append(arm)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; valid arms: {sorted(ARMS)}, groups: {sorted(GROUPS)}")
    return arms


def arm_args(arm):
    return [f"--{k}={v}" for k, v in ARMS[arm].items()]


def fork_args(arm):
    """An arm's keys for a fork, which resumes its base's checkpoint: every recipe key and
    sr_bits given, the ones the arm leaves out at their defaults, so that none is taken from a
    base of the same recipe name (mxint4 is recipe ufp4 with recipe_format=mxint4)."""
    import train   # (here, as in make_plan: the report needs no torch)
    own = ARMS[arm]
    rest = {k: train.DEFAULTS[k] for k in (*train.RECIPE_KEYS, "sr_bits") if k not in own}
    return arm_args(arm) + [f"--{k}={v}" for k, v in rest.items()]


def parse_ints(spec, what, parser):
    """'0,1,2' or '0-7' (or a mix) -> sorted ints."""
    out = set()
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            parser.error(f"--{what}={spec!r}: expected numbers like 0,1,2 or a range 0-7")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            parser.error(f"--{what}={spec!r}: the range {part.strip()} runs backwards: "
                         f"write {hi}-{lo}")
        out.update(range(lo, hi + 1))
    if not out:
        parser.error(f"--{what} is empty")
    return sorted(out)


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


def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


# -----------------------------------------------------------------------------
# running train.py: jobs with dependencies, several at a time

@dataclass
class Job:
    name: str           # unique; also the name of its stdout file under logs/
    out_dir: str
    argv: object        # () -> train.py's arguments, decided at launch (fresh start or resume)
    done: object        # () -> bool
    finish: object      # () -> None: what a successful exit leaves behind (done marker, snapshot)
    after: tuple = ()   # names of the jobs that must finish first


def clear_unstarted(d):
    """An out_dir without a checkpoint holds nothing a rerun needs (a run stopped before its first
    save): remove it, since train.py starts from scratch only into an empty out_dir."""
    if os.path.isdir(d) and not os.path.exists(os.path.join(d, "ckpt.pt")):
        print(f"removing {d}: no checkpoint in it (a run stopped before its first save, or the "
              f"logs of an earlier sitting)")
        shutil.rmtree(d)


def launch(job, gpu, log_dir, one_thread):
    clear_unstarted(job.out_dir)
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    elif one_thread:
        env.setdefault("OMP_NUM_THREADS", "1")  # CPU runs side by side: one thread each
    argv = [sys.executable, os.path.join(ROOT, "train.py"), *job.argv()]
    logf = open(os.path.join(log_dir, job.name.replace("/", "__") + ".txt"), "a")
    logf.write("$ " + " ".join(argv) + "\n")
    logf.flush()
    proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env)
    print(f"started {job.name}" + (f" on GPU {gpu}" if gpu is not None else ""), flush=True)
    return dict(proc=proc, logf=logf, gpu=gpu, t0=time.time())


def run_jobs(jobs, parallel, gpus, log_dir, stop_after=0.0):
    """Runs the jobs not done yet, at most `parallel` at once, each after its dependencies; on
    GPUs each starts on the one with the fewest running. After stop_after seconds (0 = never) the
    running ones are stopped (they resume next time). Returns the names of jobs not finished."""
    os.makedirs(log_dir, exist_ok=True)
    done_before = {j.name for j in jobs if j.done()}
    print(f"{len(done_before)} runs already done, {len(jobs) - len(done_before)} to run", flush=True)
    names = {j.name for j in jobs}
    finished = {a for j in jobs for a in j.after if a not in names}   # bases this sitting skips
    running, failed, t_start = {}, [], time.time()
    try:
        return _run(list(jobs), finished, running, failed, parallel, gpus, log_dir, stop_after,
                    t_start, done_before)
    finally:   # an exception or Ctrl-C here: no train.py left running on its own
        stop(running)


def _run(todo, finished, running, failed, parallel, gpus, log_dir, stop_after, t_start, done_before):
    """run_jobs' loop. A job is checked for done once its dependencies are through: a fork done
    before may need to run again when its base was just trained again differently."""
    while todo or running:
        for job in list(todo):
            if len(running) >= parallel:   # (done() reads logs: ask it only when a slot is free)
                break
            deps_failed = any(a in failed for a in job.after)
            if (deps_failed or all(a in finished for a in job.after)) and job.done():
                todo.remove(job)
                finished.add(job.name)
            elif deps_failed:
                todo.remove(job)
                failed.append(job.name)
                print(f"SKIPPED {job.name}: a run it starts from failed")
            elif all(a in finished for a in job.after):
                todo.remove(job)
                if job.name in done_before:
                    print(f"running {job.name} again: its base was trained again and came out "
                          f"different, and the other forks of the base will start from this training")
                busy = [r["gpu"] for r in running.values()]
                gpu = min(gpus, key=busy.count) if gpus else None
                running[job.name] = dict(launch(job, gpu, log_dir, parallel > 1), job=job)
        time.sleep(0.2)
        for name, r in list(running.items()):
            if r["proc"].poll() is None:
                continue
            del running[name]
            r["logf"].close()
            try:
                if r["proc"].returncode:
                    raise RuntimeError(f"exit {r['proc'].returncode}")
                r["job"].finish()
                finished.add(name)
                print(f"finished {name} in {time.time() - r['t0']:.0f} s", flush=True)
            except (RuntimeError, OSError) as e:
                failed.append(name)
                print(f"FAILED {name} ({e}); see {log_dir}/{name.replace('/', '__')}.txt", flush=True)
        if stop_after and time.time() - t_start > stop_after and (running or todo):
            left = [j.name for j in todo] + list(running)
            stop(running)
            print(f"stopped after {stop_after:.0f} s: {len(left)} run(s) left for the next sitting")
            return failed + left
    return failed


def stop(running):
    """Ends the runs still going (each resumes from its last checkpoint next time)."""
    for r in running.values():
        r["proc"].terminate()  # checkpoints are written atomically: the last one stays readable
    for r in running.values():
        try:
            r["proc"].wait(timeout=60)
        except subprocess.TimeoutExpired:
            r["proc"].kill()
            r["proc"].wait()
        r["logf"].close()
    running.clear()


# -----------------------------------------------------------------------------
# the forked design: plan and jobs

@dataclass
class Plan:
    config: str
    extra: list         # --key=value for train.py, for bases and forks alike
    out: str
    end: int            # every fork runs to this step
    schedule: int       # lr_decay_iters of bases and forks: one schedule for all
    eval_iters: int     # val (and train) batches of the forks' evals
    drop_ckpts: bool = False

    def base_dir(self, recipe, seed):
        return os.path.join(self.out, "bases", f"{recipe}_s{seed}")

    def snapshot(self, recipe, seed, step):
        return os.path.join(self.out, "bases", f"{recipe}_s{seed}_at{step}", "ckpt.pt")

    def fork_dir(self, recipe, seed, step, arm):
        return os.path.join(self.out, "forks", f"{recipe}_s{seed}_at{step}_to{self.end}", arm)


def base_fingerprint(d, p):
    """A base's (train, val) loss at its step-p eval as logged: two trainings of one base agree
    here only if they took the same path. GPU kernels that are not deterministic (atomics) make a
    base trained again on another machine a different base, whose forks do not pair with the
    first one's."""
    ev = [r for r in read_log(os.path.join(d, "log.jsonl")) if r.get("type") == "eval" and r["iter"] == p]
    return [ev[-1]["train_loss"], ev[-1]["val_loss"]] if ev else None


def base_jobs(plan, recipe, seed, points):
    """One job per fork point: train the base to p (resuming from the previous point), then keep
    its step-p checkpoint as a hard link (no copy) beside it."""
    d, jobs = plan.base_dir(recipe, seed), []
    earlier = {p: base_fingerprint(d, p) for p in points}   # a packed log of an earlier training
    live = os.path.exists(os.path.join(d, "ckpt.pt"))  # else it starts again from scratch
    reached = max((r["iter"] for r in read_log(os.path.join(d, "log.jsonl")) if r.get("type") == "eval"),
                  default=0) if live else 0
    for i, p in enumerate(points):
        snap = plan.snapshot(recipe, seed, p)
        if not os.path.exists(snap) and reached > p:
            sys.exit(f"error: base {d} is already at step {reached}, past the new fork point {p}: "
                     f"fork points join an --out in increasing order; use a new --out")

        def argv(p=p):
            a = [plan.config, f"--out_dir={d}", f"--seed={seed}", f"--max_iters={p}",
                 f"--lr_decay_iters={plan.schedule}", "--always_save_checkpoint=True",
                 *arm_args(recipe), *plan.extra]
            return a + ["--init_from=resume"] if os.path.exists(os.path.join(d, "ckpt.pt")) else a

        def finish(p=p, snap=snap):
            evals = [r["iter"] for r in read_log(os.path.join(d, "log.jsonl")) if r.get("type") == "eval"]
            if p not in evals:
                raise RuntimeError(f"base {d} ended without its step-{p} eval: see its log")
            os.makedirs(os.path.dirname(snap), exist_ok=True)
            try:   # ckpt.pt is replaced (not rewritten) by the next save: the link keeps step p
                os.link(os.path.join(d, "ckpt.pt"), snap + ".tmp")
            except OSError:
                shutil.copy2(os.path.join(d, "ckpt.pt"), snap + ".tmp")
            os.replace(snap + ".tmp", snap)
            now = base_fingerprint(d, p)
            if earlier[p] not in (None, now):
                print(f"WARNING: base {d} trained again ends step {p} at (train, val) {now}, its earlier "
                      f"training at {earlier[p]}: forks of the two are different bases; the report "
                      f"pairs only forks of one training", flush=True)

        jobs.append(Job(f"base/{recipe}_s{seed}_at{p}", d, argv, lambda snap=snap: os.path.exists(snap),
                        finish, after=(jobs[-1].name,) if i else ()))
    return jobs


def fork_job(plan, recipe, seed, p, arm):
    d, snap = plan.fork_dir(recipe, seed, p, arm), plan.snapshot(recipe, seed, p)
    meta = dict(arm=arm, overrides=ARMS[arm], base_recipe=recipe, seed=seed, fork_at=p, end=plan.end,
                eval_iters=plan.eval_iters, config=plan.config, extra=plan.extra)

    def argv():
        a = [plan.config, f"--out_dir={d}", f"--seed={seed}", f"--max_iters={plan.end}",
             f"--lr_decay_iters={plan.schedule}", "--always_save_checkpoint=True", "--log_interval=1",
             f"--eval_iters={plan.eval_iters}", *fork_args(arm), *plan.extra, "--init_from=resume"]
        return a if os.path.exists(os.path.join(d, "ckpt.pt")) else a + [f"--resume_from={snap}"]

    def finish():
        fp = base_fingerprint(plan.base_dir(recipe, seed), p)   # the base training it started from
        write_json(os.path.join(d, "done.json"), dict(meta, base_fp=fp))
        if plan.drop_ckpts:
            for f in glob.glob(os.path.join(d, "ckpt*.pt")):
                os.remove(f)

    def done():
        """Finished, from the training of the base that is here (if one is: a fresh machine has
        only the logs of earlier sittings until it trains the base again)."""
        path = os.path.join(d, "done.json")
        if not os.path.exists(path) or not os.path.exists(snap):
            return os.path.exists(path)
        fp = json.load(open(path)).get("base_fp")
        return fp is None or fp == base_fingerprint(plan.base_dir(recipe, seed), p)

    return Job(f"fork/{recipe}_s{seed}_at{p}_to{plan.end}/{arm}", d, argv, done, finish,
               after=(f"base/{recipe}_s{seed}_at{p}",))


def needed(jobs):
    """The jobs (in their order) less the base jobs that no unfinished fork needs, directly or
    through a later point of the same base. A sitting on a fresh machine, with only the logs of
    earlier sittings copied into --out, so retrains only the bases it still forks from."""
    by_name = {j.name: j for j in jobs}
    want, stack = set(), [a for j in jobs if j.name.startswith("fork/") and not j.done() for a in j.after]
    while stack:
        name = stack.pop()
        if name not in want:
            want.add(name)
            stack += list(by_name[name].after)
    return [j for j in jobs if j.name.startswith("fork/") or j.name in want]


PACKED = ("ablate.json", "summary.md", "summary.json", "fork_curves.png", "log.jsonl", "done.json")


def pack(out, path, merge=None):
    """What the report needs from --out, and what the next sitting needs to skip finished forks:
    ablate.json, every run's log.jsonl and done.json, the stdout logs and the summary (no
    checkpoints), under one folder named like --out. Unpack with `tar xzf PATH -C FOLDER`, where
    FOLDER holds --out. With `merge`, an earlier pack's runs come along (see merge_packed): a
    sitting on a fresh machine adds its runs to the archive of the earlier ones (PATH may be it)."""
    import tarfile
    name = os.path.basename(os.path.abspath(out))
    new = {}   # name in the archive -> file on disk
    for root, _, files in os.walk(out):
        for f in sorted(files):
            if f in PACKED or os.path.basename(root) == "logs":
                full = os.path.join(root, f)
                new[os.path.join(name, os.path.relpath(full, out))] = full
    with tarfile.open(path + ".tmp", "w:gz") as tar:
        if merge:
            merge_packed(tar, merge, name, new)
        for arc in sorted(new):
            tar.add(new[arc], arcname=arc)
    os.replace(path + ".tmp", path)
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB)")


def merge_packed(tar, archive, name, new):
    """Writes into `tar` the files of an earlier pack that `new` ({name in the archive: file}, this
    --out's) does not replace. A run (a folder with a log.jsonl) comes whole from one side: this
    --out's, unless only the earlier one finished (has done.json); any other file from --out
    replaces the earlier one's. The two must be runs of one config (the same ablate.json)."""
    import tarfile
    with tarfile.open(archive) as old:
        files = {f"{name}/{m.name.split('/', 1)[1]}": m for m in old.getmembers()
                 if m.isfile() and "/" in m.name}   # the earlier folder's name -> --out's
        stamp = os.path.join(name, "ablate.json")
        if stamp in files and stamp in new:
            if json.load(old.extractfile(files[stamp])) != json.load(open(new[stamp])):
                sys.exit(f"error: {archive} holds runs of another config or overrides than "
                         f"{new[stamp]}: they do not pair; pack them apart")
        runs = lambda arcs: {os.path.dirname(a) for a in arcs if a.endswith("/log.jsonl")}  # noqa: E731
        for run in runs(files) & runs(new):
            earlier_only = f"{run}/done.json" in files and f"{run}/done.json" not in new
            print(f"{run}: in both; keeping {'the earlier, finished' if earlier_only else 'this'} one")
            drop = new if earlier_only else files
            for arc in [a for a in drop if a.startswith(run + "/")]:
                del drop[arc]
        for arc, m in sorted(files.items()):
            if arc not in new:
                info = tarfile.TarInfo(arc)
                info.size, info.mtime, info.mode = m.size, m.mtime, m.mode
                tar.addfile(info, old.extractfile(m))


def make_plan(args, extra, parser):
    """The plan from the command line and the config (through train.py's own config parser),
    checked against what an earlier sitting in the same --out used."""
    import train
    check_extra(extra, OWN_KEYS, parser, "--fork_at, --end, --eval_iters, --bases, --arms")
    try:
        cfg = train.get_config([args.config, *extra])
        for arm in set(args.arms) | set(args.base_recipes):
            train.get_config([args.config, *extra, *arm_args(arm)])
    except train.ConfigError as e:
        parser.error(str(e))
    if args.end < 0:
        parser.error(f"--end={args.end}: give the step every fork runs to (> 0), or 0 for the "
                     f"config's max_iters")
    end = args.end or cfg["max_iters"]
    points = args.fork_at or [round(2 * end / 3)]
    if not all(0 < p < end for p in points):
        parser.error(f"--fork_at={points} must lie strictly between 0 and the fork end {end}")
    plan = Plan(args.config, list(extra), args.out, end, cfg["lr_decay_iters"] or cfg["max_iters"],
                args.eval_iters or cfg["eval_iters"], args.drop_fork_ckpts)
    os.makedirs(plan.out, exist_ok=True)
    stamp_path = os.path.join(plan.out, "ablate.json")
    stamp = dict(config=plan.config, extra=plan.extra, schedule=plan.schedule, eval_iters=plan.eval_iters)
    if os.path.exists(stamp_path):
        old = json.load(open(stamp_path))
        if old != stamp:
            parser.error(f"{plan.out} holds runs of {old}; this call would add runs of {stamp} that do "
                         f"not pair with them: use the same config and overrides, or a new --out")
    write_json(stamp_path, stamp)
    return plan, points


def fork_main(args, extra, parser):
    plan, points = make_plan(args, extra, parser)
    jobs = []   # base by base, its forks right after it: run_jobs starts the first ready job, so
    for seed in args.bases:   # a finished base's forks go before the next bases (whole bases finish
        for recipe in args.base_recipes:   # early: a sitting stopped on time loses the least)
            jobs += base_jobs(plan, recipe, seed, points)
            jobs += [fork_job(plan, recipe, seed, p, arm) for p in points for arm in args.arms]
    jobs = needed(jobs)
    gpus = [g for g in args.gpus.split(",") if g]
    left = run_jobs(jobs, args.parallel, gpus, os.path.join(plan.out, "logs"), args.stop_after)
    fork_report(plan.out, args.ref)
    return left


# -----------------------------------------------------------------------------
# the forked design: scores, statistics, report

def fork_scores(d, meta):
    """Mean train loss over the fork window and val loss at its end, with the curves. A window
    with a step missing from the log or not finite (a skipped non-finite step) has no train score
    (NaN, and `excluded` says why): its mean would not pair with the other arms' means."""
    recs = read_log(os.path.join(d, "log.jsonl"))
    p, end = meta["fork_at"], meta["end"]
    train = {r["iter"]: r["loss"] for r in recs if r.get("type") == "train" and p <= r["iter"] < end}
    val = {r["iter"]: r["val_loss"] for r in recs if r.get("type") == "eval"}
    bad = [i for i, v in train.items() if not math.isfinite(v)]
    excluded = (f"{len(train)} of its {end - p} window steps logged" if len(train) != end - p else
                f"non-finite loss at step(s) {bad[:3]}" if bad else None)
    return dict(train=float("nan") if excluded else statistics.fmean(train.values()),
                val=val.get(end, float("nan")), steps=len(train), train_curve=train, val_curve=val,
                base_fp=meta.get("base_fp"), excluded=excluded)


def collect_forks(out):
    """{(base_recipe, fork_at, end, eval_iters): {arm: {seed: scores}}} of every finished fork."""
    groups = {}
    for done in sorted(glob.glob(os.path.join(out, "forks", "*", "*", "done.json"))):
        meta = json.load(open(done))
        key = (meta["base_recipe"], meta["fork_at"], meta["end"], meta["eval_iters"])
        groups.setdefault(key, {}).setdefault(meta["arm"], {})[meta["seed"]] = \
            fork_scores(os.path.dirname(done), meta)
    return groups


def mean_se(xs):
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def paired(a, b):
    """a - b paired by base seed ({seed: score} each): n, mean, SE, per-base differences, and the
    same relative to b in %."""
    seeds = sorted(s for s in set(a) & set(b) if a[s] == a[s] and b[s] == b[s])
    diffs = {s: a[s] - b[s] for s in seeds}
    m, se = mean_se(list(diffs.values()))
    pm, pse = mean_se([100 * diffs[s] / b[s] for s in seeds])
    return dict(n=len(seeds), mean=m, se=se, pct=pm, pct_se=pse, per_base=diffs)


T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)


def t975(df):
    """Student t's 97.5 % quantile (a table; 1.96 + 2.4/df, within 0.003, above 30)."""
    return T975[df - 1] if df <= 30 else 1.96 + 2.4 / df


def gap_reduction(d_new, d_old, n_boot=10000, seed=0):
    """R = 1 - mean(d_new) / mean(d_old): the fraction of the old recipe's gap (to the reference)
    that the new one removes, from per-base gaps paired by base (same order in both lists).
    Interval 1: the delta method, SE^2 = (V_new - 2 r C + r^2 V_old) / mean(d_old)^2 with
    r = mean(d_new) / mean(d_old) and V, C the variances and covariance of the two means, times
    Student t with n - 1 degrees of freedom. Interval 2: percentile bootstrap over bases."""
    import numpy as np
    n = len(d_new)
    mn, mo = statistics.fmean(d_new), statistics.fmean(d_old)
    r = mn / mo
    out = dict(n=n, estimate=1 - r, se=float("nan"), ci95=[float("nan")] * 2,
               boot_ci95=[float("nan")] * 2, old_gap=mo, old_gap_se=mean_se(d_old)[1],
               new_gap=mn, new_gap_se=mean_se(d_new)[1])
    if n < 2:
        return out
    v_new, v_old = statistics.variance(d_new) / n, statistics.variance(d_old) / n
    cov = statistics.covariance(d_new, d_old) / n
    out["se"] = math.sqrt(max(v_new - 2 * r * cov + r * r * v_old, 0.0)) / abs(mo)
    half = t975(n - 1) * out["se"]
    out["ci95"] = [out["estimate"] - half, out["estimate"] + half]
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    new, old = np.asarray(d_new)[idx].mean(1), np.asarray(d_old)[idx].mean(1)
    ok = old != 0
    out["boot_ci95"] = [float(x) for x in np.percentile(1 - new[ok] / old[ok], [2.5, 97.5])]
    return out


def same_base(a, b):
    return a.get("base_fp") is None or b.get("base_fp") is None or a["base_fp"] == b["base_fp"]


def scores(runs, arm, score, like=None):
    """{seed: score} of an arm's forks; with `like`, only the seeds whose fork of arm `like` started
    from the same training of the base."""
    other = runs.get(like, {})
    return {s: r[score] for s, r in runs[arm].items() if like is None or s not in other
            or same_base(r, other[s])}


def contrast_rows(runs, arms, ref):
    rows = []
    for arm in arms:
        row = dict(arm=arm, overrides=ARMS.get(arm, {}), ref=ref, runs=len(runs[arm]),
                   unpaired=sorted(s for s in set(runs[arm]) & set(runs[ref])
                                   if not same_base(runs[arm][s], runs[ref][s])))
        for score in ("train", "val"):
            row[score] = dict(value=mean_se([r[score] for r in runs[arm].values()]),
                              vs_ref=paired(scores(runs, arm, score, like=ref), scores(runs, ref, score)))
        rows.append(row)
    return rows


GROWTH_PARTS = 5


def growth(runs, ref):
    """How the headline builds up over the window: the logged steps in GROWTH_PARTS equal parts,
    per part e2m1 and ufp4 against ref (the mean per-step difference, paired by base: mean, SE)
    and the part's gap reduction 1 - mean(ufp4) / mean(e2m1)."""
    seeds = [s for s in sorted(set(runs["e2m1"]) & set(runs["ufp4"]) & set(runs[ref]))
             if same_base(runs["e2m1"][s], runs[ref][s]) and same_base(runs["ufp4"][s], runs[ref][s])]
    if not seeds:
        return []
    seeds = [s for s in seeds if not any(runs[a][s].get("excluded") for a in ("e2m1", "ufp4", ref))]
    steps = sorted(set.intersection(*(set(runs[a][s]["train_curve"]) for a in ("e2m1", "ufp4", ref)
                                      for s in seeds))) if seeds else []
    if not steps:
        return []
    size = math.ceil(len(steps) / GROWTH_PARTS)
    rows = []
    for part in (steps[i:i + size] for i in range(0, len(steps), size)):
        row = dict(steps=[part[0], part[-1]])
        for arm in ("e2m1", "ufp4"):
            row[arm] = mean_se([statistics.fmean(runs[arm][s]["train_curve"][i] - runs[ref][s]["train_curve"][i]
                                                 for i in part) for s in seeds])
        row["reduction"] = 1 - row["ufp4"][0] / row["e2m1"][0] if row["e2m1"][0] else float("nan")
        rows.append(row)
    return rows


def growth_markdown(rows, ref):
    if not rows:
        return []
    out = ["", f"How the effect builds up over the window (train loss, mean per-step Δ vs {ref} in each "
           f"of {len(rows)} equal parts of the window, paired by base):", "",
           f"| steps | e2m1 - {ref} | ufp4 - {ref} | gap reduction |", "|---|---|---|---|"]
    for r in rows:
        e, u = (_pm(dict(zip(("mean", "se"), r[a]))) for a in ("e2m1", "ufp4"))
        out.append(f"| {r['steps'][0]}..{r['steps'][1]} | {e} | {u} | {100 * r['reduction']:.1f} % |")
    return out + [""]


def group_summary(runs, ref):
    arms = [a for a in ARMS if a in runs] + sorted(a for a in runs if a not in ARMS)
    out = dict(arms=arms, bases=sorted({s for r in runs.values() for s in r}),
               steps={a: sorted({r["steps"] for r in runs[a].values()}) for a in arms})
    excluded = {a: {s: r["excluded"] for s, r in runs[a].items() if r.get("excluded")} for a in arms}
    if any(excluded.values()):
        out["excluded"] = {a: ex for a, ex in excluded.items() if ex}
    if ref in runs:
        out["contrasts"] = contrast_rows(runs, arms, ref)
    if "ufp4" in runs:
        out["placement"] = contrast_rows(runs, [a for a in PAPER_LOSS if a in runs], "ufp4")
        out["formats"] = contrast_rows(runs, [a for a in FORMAT_OF if a in runs], "ufp4")
    if ref in runs and ref not in ("ufp4", "e2m1") and {"ufp4", "e2m1"} <= set(runs):
        out["gap_reduction"] = {}
        by_arm = {r["arm"]: r for r in out["contrasts"]}
        for score in ("train", "val"):
            gaps = {a: by_arm[a][score]["vs_ref"]["per_base"] for a in ("ufp4", "e2m1")}
            both = sorted(set(gaps["ufp4"]) & set(gaps["e2m1"]))
            if both:
                out["gap_reduction"][score] = gap_reduction([gaps["ufp4"][s] for s in both],
                                                            [gaps["e2m1"][s] for s in both])
        out["growth"] = growth(runs, ref)
    for arm, of, _ in NOISE:
        if {arm, of} <= set(runs):
            out.setdefault("noise", {})[arm] = {}
            for score in ("train", "val"):
                c = paired(scores(runs, arm, score, like=of), scores(runs, of, score))
                d = list(c["per_base"].values())
                c["rms"] = math.sqrt(statistics.fmean(x * x for x in d)) if d else float("nan")
                out["noise"][arm][score] = c
    return out


def crossover(groups):
    """Forks of bases trained in different recipes (same fork point): per arm, the difference a
    better starting point makes, paired by seed, for every pair of base recipes."""
    by_point = {}
    for (recipe, p, end, ev), runs in groups.items():
        by_point.setdefault((p, end, ev), {})[recipe] = runs
    rows = []
    for (p, end, ev), per_recipe in sorted(by_point.items()):
        recipes = sorted(per_recipe, key=lambda r: list(ARMS).index(r) if r in ARMS else 99)
        for vs, other in itertools.combinations(recipes, 2):
            for arm in [a for a in ARMS if a in per_recipe[other] and a in per_recipe[vs]]:
                row = dict(fork_at=p, end=end, eval_iters=ev, arm=arm, base=other, vs_base=vs)
                for score in ("train", "val"):
                    row[score] = paired(scores(per_recipe[other], arm, score), scores(per_recipe[vs], arm, score))
                rows.append(row)
    return rows


def _pm(c, digits=5):
    if c["mean"] != c["mean"]:
        return "-"
    se = "-" if c["se"] != c["se"] else f"{c['se']:.{digits}f}"
    return f"{c['mean']:+.{digits}f} ± {se}"


def _per_base(c):
    return ", ".join(f"s{s} {d:+.5f}" for s, d in c["per_base"].items()) or "-"


def contrast_table(rows, paper, last="paper"):
    """Markdown rows: each arm's mean scores and its paired contrast to the row's reference; the
    last column, `paper(arm)`, headed `last`."""
    ref = rows[0]["ref"]
    lines = [f"| arm | bases | train loss, fork window | Δ vs {ref} (nats) | Δ (%) | val loss at end "
             f"| Δ vs {ref} (nats) | Δ (%) | per-base Δ train | per-base Δ val | {last} |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, v = r["train"], r["val"]
        lines.append(f"| {r['arm']} | {t['vs_ref']['n']} | {t['value'][0]:.4f} | {_pm(t['vs_ref'])} | "
                     f"{_pm(dict(mean=t['vs_ref']['pct'], se=t['vs_ref']['pct_se']), 3)} | "
                     f"{v['value'][0]:.4f} | {_pm(v['vs_ref'])} | "
                     f"{_pm(dict(mean=v['vs_ref']['pct'], se=v['vs_ref']['pct_se']), 3)} | "
                     f"{_per_base(t['vs_ref'])} | {_per_base(v['vs_ref'])} | {paper(r['arm'])} |")
    return lines


def reduction_text(red):
    lines = []
    for score, label in (("train", "mean train loss over the fork window"), ("val", "val loss at the end")):
        g = red.get(score)
        if not g:
            continue
        if g["n"] < 2:
            spread = f"one base: no interval yet); e2m1 gap {g['old_gap']:+.5f} nats"
        else:
            weak = "" if abs(g["old_gap"]) > 2 * g["old_gap_se"] else \
                " (not resolved from 0 at 2 SE, so the ratio means little)"
            spread = (f"SE {100 * g['se']:.1f} by the delta method; 95 % interval "
                      f"[{100 * g['ci95'][0]:.1f}, {100 * g['ci95'][1]:.1f}] by the delta method with t, "
                      f"[{100 * g['boot_ci95'][0]:.1f}, {100 * g['boot_ci95'][1]:.1f}] by a percentile "
                      f"bootstrap over bases; n = {g['n']}); e2m1 gap {g['old_gap']:+.5f} ± "
                      f"{g['old_gap_se']:.5f} nats{weak}")
        lines.append(f"- **gap reduction** 1 - Δufp4 / Δe2m1 on the {label}: "
                     f"**{100 * g['estimate']:.1f} %** ({spread}. Paper: "
                     + ", ".join(f"{v:.1f} % ({k})" for k, v in PAPER_REDUCTION_PCT) +
                     ", the ratio of |L - L_bf16| / L_bf16 over the last 1000 steps of whole runs: the "
                     "same question at 45-3700x the size, not the same measurement.")
    return lines


def noise_text(noise):
    lines = []
    for arm, of, what in NOISE:
        if arm in noise:
            t, v = noise[arm]["train"], noise[arm]["val"]
            lines.append(f"- **fork noise** ({arm} - {of}: same base, same recipe; differs in {what}): "
                         f"RMS over {t['n']} base(s) {t['rms']:.5f} nats on the mean train loss of the "
                         f"window (mean {_pm(t)}), {v['rms']:.5f} on the val loss at the end (mean "
                         f"{_pm(v)}). On a CPU (torch reference, deterministic, sr_bits unused) it is 0.")
    return lines


def group_markdown(key, g):
    recipe, p, end, ev = key
    out = [f"## {recipe} bases, forked at step {p}, scored over steps {p}..{end - 1} and at {end}",
           "", f"Bases (seeds): {g['bases']}; val on {ev} fixed batches per base; logged steps per fork: "
           + ", ".join(f"{a} {s}" for a, s in g["steps"].items()) + ".", ""]
    if "contrasts" in g:
        ref = g["contrasts"][0]["ref"]
        paper = (lambda a: f"gap {PAPER_GAP_PCT[a]:.4f} % (1.5B, whole run)" if a in PAPER_GAP_PCT else "") \
            if ref == "bf16" else (lambda a: "")
        out += contrast_table(g["contrasts"], paper) + [""]
        out += [f"- **not paired**: {r['arm']}'s forks of base(s) {r['unpaired']} started from another "
                f"training of the base than {ref}'s (it was trained again and came out different)"
                for r in g["contrasts"] if r["unpaired"]]
        out += [f"- **no train score**: {arm}'s fork of base {s} ({why}); its base is left out of "
                f"every train contrast with {arm}" for arm, ex in g.get("excluded", {}).items()
                for s, why in ex.items()]
    out += reduction_text(g.get("gap_reduction", {}))
    out += growth_markdown(g.get("growth", []), g["contrasts"][0]["ref"] if "contrasts" in g else "")
    if "noise" in g:
        out += noise_text(g["noise"])
    if len(g.get("placement", [])) > 1:
        out += ["", "RHT placement on the int4 grid, against ufp4 (RHT on all three GEMMs); paper: its "
                "1.5B dense model's mean LM loss minus its UFP4's (whole runs):", ""]
        out += contrast_table(g["placement"], lambda a: f"{PAPER_LOSS[a] - PAPER_LOSS['ufp4']:+.5f}")
    if len(g.get("formats", [])) > 1:
        out += ["", "Formats against ufp4: the grid, the block, the scale (e8m0: a power of two), "
                "SR on dy in every row:", ""]
        out += contrast_table(g["formats"], FORMAT_OF.get, last="format")
    return out + [""]


def glance_markdown(summary):
    """One row per group (base recipe, fork point) with e2m1 and ufp4 against bf16: how the
    headline changes with the fork point (the window) and with the starting point (the crossover)."""
    rows = []
    for g in summary["groups"]:
        c = {r["arm"]: r for r in g.get("contrasts", []) if r["ref"] == "bf16"}
        red = g.get("gap_reduction", {})
        if not {"e2m1", "ufp4"} <= set(c) or "train" not in red:
            continue
        cells = []   # both gaps over the bases the reduction pairs, so the three cells agree
        for score in ("train", "val"):
            r = red.get(score)
            if r is None:
                cells += ["-", "-", "-"]
                continue
            ci = "-" if r["n"] < 2 else f"[{100 * r['ci95'][0]:.1f}, {100 * r['ci95'][1]:.1f}]"
            cells += [_pm(dict(mean=r["old_gap"], se=r["old_gap_se"])),
                      _pm(dict(mean=r["new_gap"], se=r["new_gap_se"])), f"{100 * r['estimate']:.1f} % {ci}"]
        ns = sorted({r["n"] for r in red.values()})
        rows.append(f"| {g['base_recipe']} | {g['fork_at']} | {g['fork_at']}..{g['end'] - 1} | "
                    f"{' / '.join(map(str, ns))} | " + " | ".join(cells) + " |")
    if len(rows) < 2:
        return []
    return ["## At a glance: the headline by starting point and fork point", "",
            "e2m1 and ufp4 against bf16 forks of the same bases (Δ in nats, mean ± SE over bases) and "
            "the gap reduction 1 - Δufp4 / Δe2m1 with its 95 % interval (delta method, t). A longer "
            "window (an earlier fork point) accumulates more of the recipes' effect; bases trained in "
            "e2m1 or ufp4 (the crossover) ask whether the effect depends on where training started. "
            "Each row's gaps and reduction are over the bases with all three forks scored (n; train "
            "/ val where they differ).", "",
            "| bases | fork at | window | n | e2m1 Δ train | ufp4 Δ train | reduction, train | "
            "e2m1 Δ val | ufp4 Δ val | reduction, val |",
            "|---|---|---|---|---|---|---|---|---|---|", *rows, ""]


def crossover_markdown(rows):
    if not rows:
        return []
    out = ["## Crossover: the same arm forked from bases of two recipes", "",
           "Δ = fork from the `base` recipe's base - fork from the `vs` recipe's base, paired by seed: "
           "what a better starting point is worth, apart from the recipe over the window. Bases of "
           "two recipes are two trainings from the same init and batches, so this Δ carries their "
           "chaotic divergence (a few hundredths of a nat per pair) and needs many more bases than a "
           "contrast between forks of one base; the recipe's own effect from each starting point is "
           "the per-group tables' (and the glance table's) paired contrast.", "",
           "| fork at | arm | base | vs | bases | Δ train window (nats) | Δ val at end (nats) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['fork_at']} | {r['arm']} | {r['base']} | {r['vs_base']} | {r['train']['n']} | "
                   f"{_pm(r['train'])} | {_pm(r['val'])} |")
    return out + [""]


HOW_TO_READ = """\
How to read this: a fork continues a base from its checkpoint at the fork point under one arm's
recipe, on the same batches; its scores are the mean train loss over the fork window (every step
logged) and the val loss at the end (the same eval batches for every fork of a base, evaluated
under the arm's own recipe, quantized forward included). Δ is arm minus reference, paired by base:
mean ± SE over bases (SE needs 2 bases), in nats and in % of the reference; the loss columns
average the bases the arm ran on, so between arms run on different bases compare the Δ columns, not
the losses. A fork measures the recipe's effect over its window only, not over a whole run. The
paper's numbers come from whole training runs of 1.5B-124B models: they say which direction and
roughly how large, they are not a measurement of the same quantity.
"""


def fork_report(out, ref, dest=None, header=None):
    """summary.md, summary.json and fork_curves.png of the finished forks in `out`, written into
    `dest` (default `out`); `header`, a line put first in summary.md."""
    dest = dest or out
    groups = collect_forks(out)
    ran = sorted({arm for runs in groups.values() for arm in runs})
    if groups and ref not in ran:   # every table would be empty
        sys.exit(f"error: --ref={ref} has no finished forks in {out}; the arms that ran: "
                 f"{', '.join(ran)}")
    summary = dict(ref=ref, groups=[dict(base_recipe=k[0], fork_at=k[1], end=k[2], eval_iters=k[3],
                                         **group_summary(runs, ref)) for k, runs in sorted(groups.items())],
                   crossover=crossover(groups))
    md = ([header, ""] if header else []) + ["# Forked ablation", "", HOW_TO_READ]
    md += glance_markdown(summary)
    for key, g in zip(sorted(groups), summary["groups"]):
        md += group_markdown(key, g)
    md += crossover_markdown(summary["crossover"])
    if not groups:
        md.append("No finished forks yet.")
    text = "\n".join(md)
    with open(os.path.join(dest, "summary.md"), "w") as f:
        f.write(text + "\n")
    write_json(os.path.join(dest, "summary.json"), summary)
    if groups:
        plot_forks(groups, ref, os.path.join(dest, "fork_curves.png"))
    print(text)
    return summary


def report_packed(archive, dest, ref):
    """The report of the forks packed in `archive` (`ablate.py pack`), written into `dest`: the
    archive is unpacked into a temporary folder, removed afterwards."""
    import tarfile
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        roots = [os.path.dirname(d) for d in glob.glob(os.path.join(tmp, "*", "forks"))]
        if len(roots) != 1:
            sys.exit(f"error: {archive} should hold one folder with the forks (forks/) of an --out, "
                     f"as `ablate.py pack` writes; found {len(roots)}")
        os.makedirs(dest, exist_ok=True)
        return fork_report(roots[0], ref, dest, header=f"The runs packed in `{archive}`: "
                           f"`python ablate.py report --runs={archive} --out={dest}`.")


def _smooth(xs, k):
    return [statistics.fmean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def plot_forks(groups, ref, path):
    """One row per group: the arms' train loss over the fork window (mean over bases, moving
    average), their val loss at each eval of the window, and the paired difference of both to the
    reference (a third panel only where the reference ran). One colour per arm, one legend a row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = sorted(groups)
    ncol = 3 if any(ref in groups[k] for k in keys) else 2
    fig, axes = plt.subplots(len(keys), ncol, figsize=(5.2 * ncol + 2, 3.8 * len(keys)), squeeze=False)
    for row, key in enumerate(keys):
        runs, (recipe, p, end, _) = groups[key], key
        arms = [a for a in ARMS if a in runs]
        colors = plt.get_cmap("tab10" if len(arms) <= 10 else "tab20")
        a_tr, a_va, a_d = axes[row][0], axes[row][1], axes[row][2] if ncol == 3 else None
        for i, arm in enumerate(arms):
            kw = dict(color=colors(i), lw=1.2)
            tr, va = _mean_curves(runs[arm])
            it, vi = sorted(tr), sorted(j for j in va if j >= p)
            a_tr.plot(it, _smooth([tr[j] for j in it], max(1, len(it) // 25)), label=f"{arm} train", **kw)
            a_va.plot(vi, [va[j] for j in vi], "o-", ms=4, label=f"{arm} val", **kw)
            if a_d is not None and ref in runs and arm != ref:
                rtr, rva = _mean_curves(runs[ref], seeds=runs[arm])
                both, vb = [j for j in it if j in rtr], [j for j in vi if j in rva]
                a_d.plot(both, _smooth([tr[j] - rtr[j] for j in both], max(1, len(both) // 25)),
                         label=f"{arm} train", **kw)
                a_d.plot(vb, [va[j] - rva[j] for j in vb], "o--", ms=4, label=f"{arm} val", **kw)
        n = len({s for r in runs.values() for s in r})
        a_tr.set(xlabel="iteration", ylabel="train loss", title=f"{recipe} bases (n={n}), fork {p} -> {end}: "
                 f"train, moving average")
        a_va.set(xlabel="iteration", ylabel="val loss", title="val loss at the window's evals")
        if a_d is not None:
            if ref in runs:
                a_d.axhline(0, color="k", lw=0.5)
                a_d.set(xlabel="iteration", ylabel=f"L - L_{ref} (nats)",
                        title=f"paired difference to {ref}: train (line), val (dots)")
            else:
                a_d.axis("off")
        handles = [plt.Line2D([], [], color=colors(i), lw=2) for i in range(len(arms))]
        axes[row][-1].legend(handles, arms, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def _mean_curves(per_seed, seeds=None):
    """Train and val curves averaged over the bases (only `seeds` if given, for pairing)."""
    chosen = [s for s in per_seed if seeds is None or s in seeds]
    tr, va = {}, {}
    for s in chosen:
        for j, v in per_seed[s]["train_curve"].items():
            tr.setdefault(j, []).append(v)
        for j, v in per_seed[s]["val_curve"].items():
            va.setdefault(j, []).append(v)
    n = len(chosen)
    return ({j: statistics.fmean(v) for j, v in tr.items() if len(v) == n},
            {j: statistics.fmean(v) for j, v in va.items() if len(v) == n})


# -----------------------------------------------------------------------------
# the seed-per-arm design

def run_dir(out, arm, seed):
    return os.path.join(out, f"{arm}_s{seed}")


def seed_job(config, arm, seed, out, extra):
    d = run_dir(out, arm, seed)

    def argv():
        a = [config, f"--out_dir={d}", f"--seed={seed}", *arm_args(arm), *extra]
        return a + ["--init_from=resume"] if os.path.exists(os.path.join(d, "ckpt.pt")) else a

    return Job(f"{arm}_s{seed}", d, argv, lambda: os.path.exists(os.path.join(d, "done.json")),
               lambda: write_json(os.path.join(d, "done.json"), dict(arm=arm, seed=seed)))


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


def load_seed_runs(out, arms, seeds):
    """{(arm, seed): curves, final losses, alpha} of the finished runs (done.json): a stopped
    run's last eval is of another step than a finished one's."""
    runs = {}
    for arm in arms:
        for seed in seeds:
            recs = read_log(os.path.join(run_dir(out, arm, seed), "log.jsonl"))
            train = {r["iter"]: r["loss"] for r in recs if r.get("type") == "train"}
            evals = [r for r in recs if r.get("type") == "eval"]
            tel = [r for r in recs if r.get("type") == "telemetry"]
            if train and os.path.exists(os.path.join(run_dir(out, arm, seed), "done.json")):
                runs[arm, seed] = dict(train=train, val={r["iter"]: r["val_loss"] for r in evals},
                                       final_val=evals[-1]["val_loss"] if evals else None,
                                       final_train=evals[-1]["train_loss"] if evals else None,
                                       alpha=tel[-1]["alpha"] if tel else {})
    return runs


def seed_rows(runs, arms, seeds):
    rows = []
    for arm in arms:
        got = [s for s in seeds if (arm, s) in runs]
        if not got:
            continue
        paired_seeds = [s for s in got if ("bf16", s) in runs]
        ref = lambda s: runs["bf16", s]  # noqa: E731
        alphas = {}
        for s in got:
            for op, a in runs[arm, s]["alpha"].items():
                alphas.setdefault(op, []).append(a)
        rows.append(dict(
            arm=arm, seeds=len(got), overrides=ARMS[arm],
            val=_ms([runs[arm, s]["final_val"] for s in got if runs[arm, s]["final_val"] is not None]),
            train=_ms([runs[arm, s]["final_train"] for s in got if runs[arm, s]["final_train"] is not None]),
            gap_pct=_ms([100 * gap(runs[arm, s]["train"], ref(s)["train"]) for s in paired_seeds]),
            signed_gap_pct=_ms([100 * signed_gap(runs[arm, s]["train"], ref(s)["train"])
                                for s in paired_seeds]),
            val_gap_pct=_ms([val_gap(runs[arm, s]["val"], ref(s)["val"]) for s in paired_seeds]),
            alpha={op: statistics.mean(v) for op, v in alphas.items() if None not in v}))
    return rows


def summarize(out, arms, seeds):
    """The seed-per-arm report: summary.md, summary.json, loss_curves.png."""
    runs = load_seed_runs(out, arms, seeds)
    rows = seed_rows(runs, arms, seeds)
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
                "same for the val loss at the last eval both runs reached; mean ± std over seeds. "
                "alpha: <Q(A), A> / ||A||^2 of the Fprop operands at the last telemetry step, mean "
                "over layers (and seeds). Runs from scratch with different seeds end some 0.02 nats "
                "apart whatever the recipe: for effects below that, use `ablate.py fork`.\n")
    write_json(os.path.join(out, "summary.json"), rows)
    if runs:
        plot_seeds(runs, arms, seeds, os.path.join(out, "loss_curves.png"))
    print(table)
    return rows


def _ms(xs):
    xs = [x for x in xs if x == x]
    if not xs:
        return None
    return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else None)  # one seed: no spread


def _fmt(ms, digits=4):
    if ms is None:
        return "-"
    return f"{ms[0]:.{digits}f} ± " + ("-" if ms[1] is None else f"{ms[1]:.{digits}f}")


def plot_seeds(runs, arms, seeds, path):
    """Train (lines) and val (markers) loss of every run on a log scale that shows the whole run;
    beside it, when some arm pairs with bf16, the paired gap to bf16 (moving average)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pairs = [(a, s) for a, s in runs if a != "bf16" and ("bf16", s) in runs]
    fig, axes = plt.subplots(1, 2 if pairs else 1, figsize=(13 if pairs else 7, 4.5), squeeze=False)
    ax1 = axes[0][0]
    for i, arm in enumerate(arms):
        first = True
        for seed in seeds:
            if (arm, seed) not in runs:
                continue
            r, kw = runs[arm, seed], dict(color=f"C{i % 10}", lw=1)
            it, vi = sorted(r["train"]), sorted(r["val"])
            ax1.plot(it, [r["train"][j] for j in it], label=f"{arm} train" if first else None, **kw)
            ax1.plot(vi, [r["val"][j] for j in vi], "o--", ms=4, label=f"{arm} val" if first else None, **kw)
            first = False
            if (arm, seed) in pairs:
                ref = runs["bf16", seed]["train"]
                both = [j for j in it if j in ref]
                g = [100 * (r["train"][j] - ref[j]) / ref[j] for j in both]
                axes[0][1].plot(both, _smooth(g, max(1, len(g) // 30)),
                                label=arm if seed == min(s for a, s in pairs if a == arm) else None, **kw)
    ax1.set_yscale("log")
    ax1.set(xlabel="iteration", ylabel="loss (log scale)", title="train (lines) and val (markers) loss")
    ax1.legend(fontsize=8, ncol=2)
    if pairs:
        ax2 = axes[0][1]
        ax2.axhline(0, color="k", lw=0.5)
        ax2.set(xlabel="iteration", ylabel="(L - L_bf16) / L_bf16  (%)",
                title="paired gap to bf16 (same seed), moving average")
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def find_seed_runs(out):
    found = [re.fullmatch(r"(.+)_s(\d+)", os.path.basename(d)) for d in glob.glob(os.path.join(out, "*_s*"))]
    found = [m for m in found if m and m[1] in ARMS]
    return [a for a in ARMS if a in {m[1] for m in found}], sorted({int(m[2]) for m in found})


def seeds_main(args, extra, parser):
    if "bf16" not in args.arms:
        args.arms = ["bf16"] + args.arms  # the reference of every gap
    check_extra(extra, SEEDS_OWN_KEYS, parser, "--arms, --seeds, --out")
    seeds = parse_ints(args.seeds, "seeds", parser)
    out = args.out or os.path.join("out", "ablate_" + os.path.splitext(os.path.basename(args.config))[0])
    if args.report_only and not find_seed_runs(out)[0]:
        parser.error(f"--report_only: no runs found in {out}")
    os.makedirs(out, exist_ok=True)
    left = []
    if not args.report_only:
        jobs = [seed_job(args.config, a, s, out, extra) for s in seeds for a in args.arms]
        left = run_jobs(jobs, args.parallel, [g for g in args.gpus.split(",") if g],
                        os.path.join(out, "logs"), args.stop_after)
    summarize(out, args.arms, seeds)
    return left


# -----------------------------------------------------------------------------

def build_parser():
    # no abbreviations: the extra arguments go on to train.py, whose --seed would read as --seeds
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fork", allow_abbrev=False,
                       help="the forked design (headline): bases, forks, report")
    f.add_argument("config")
    f.add_argument("--bases", default="0", help="base seeds: 0,1,2 or 0-7")
    f.add_argument("--arms", default="headline", help=f"comma list of arms {sorted(ARMS)} or groups "
                   f"{sorted(GROUPS)}; the --ref arm is added")
    f.add_argument("--base_recipe", default="bf16", help="the arm(s) the bases train in; two (e2m1,ufp4) "
                   "make the crossover")
    f.add_argument("--fork_at", default="", help="fork point(s), e.g. 500,1000 (default: 2/3 of --end)")
    f.add_argument("--end", type=int, default=0, help="the step every fork runs to (default: the "
                   "config's max_iters); the lr schedule stays the config's")
    f.add_argument("--eval_iters", type=int, default=0, help="batches of the forks' evals (default: "
                   "the config's), e.g. 100")
    f.add_argument("--ref", default="bf16", help="the arm every contrast is taken against")
    f.add_argument("--drop_fork_ckpts", action="store_true", help="delete a finished fork's "
                   "checkpoints (its log is all the report needs): saves disk on large sweeps")
    r = sub.add_parser("report", allow_abbrev=False,
                       help="redo the report from every finished run in --out (or in --runs)")
    r.add_argument("--out", required=True, help="the runs, and where the report goes")
    r.add_argument("--runs", default="", help="a .tar.gz of `pack`: the forks to report on (then "
                   "--out is only where the report goes)")
    r.add_argument("--ref", default="bf16")
    k = sub.add_parser("pack", allow_abbrev=False, help="a .tar.gz of --out's logs and done markers "
                       "(no checkpoints): what a later sitting or the report needs")
    k.add_argument("--out", required=True)
    k.add_argument("--to", required=True, help="the .tar.gz to write")
    k.add_argument("--merge", default="", help="an earlier pack whose runs the new one keeps "
                   "(--out's replace those of the same name); may be --to itself")
    s = sub.add_parser("seeds", allow_abbrev=False,
                       help="the seed-per-arm design (every arm from scratch per seed)")
    s.add_argument("config")
    s.add_argument("--arms", default="paper_gpt",
                   help=f"comma list of {sorted(ARMS)} or a group {sorted(GROUPS)}")
    s.add_argument("--seeds", default="0")
    s.add_argument("--report_only", action="store_true")
    for q in (f, s):
        q.add_argument("--out", default="" if q is s else None, required=q is f)
        q.add_argument("--parallel", type=int, default=1, help="runs at once (they may share a GPU: "
                       "8 forks of configs/gpu/ablate_gpt.py fit one H200, 12 did not)")
        q.add_argument("--gpus", default="", help="comma list of GPU ids to spread the runs over")
        q.add_argument("--stop_after", type=float, default=0, help="seconds; then stop the runs "
                       "(they resume at the next call) and report what finished")
    return p


def check_archive(path, flag, p):
    """An archive named by --runs or --merge: a .tar.gz that `ablate.py pack` wrote (else p.error)."""
    import tarfile
    if path and not (os.path.isfile(path) and tarfile.is_tarfile(path)):
        p.error(f"{flag}={path}: " + ("not a tar archive" if os.path.isfile(path) else "no such file")
                + " (give a .tar.gz that `ablate.py pack` wrote)")


def main(argv):
    if argv and argv[0] not in ("fork", "report", "seeds", "pack") and os.path.isfile(argv[0]):
        print("note: no subcommand: running `ablate.py seeds` (seed-per-arm); the forked design is "
              "`ablate.py fork`", flush=True)
        argv = ["seeds", *argv]
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    if args.cmd == "pack":
        if extra:
            p.error(f"pack takes only --out, --to and --merge, got {extra}")
        if not os.path.isdir(args.out):
            p.error(f"--out={args.out}: no such folder, nothing to pack")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.to))):
            p.error(f"--to={args.to}: its folder does not exist")
        check_archive(args.merge, "--merge", p)
        return pack(args.out, args.to, args.merge)
    if args.cmd == "report":
        if extra:
            p.error(f"report takes only --out, --runs and --ref, got {extra}")
        if args.ref not in ARMS:  # before the report replaces the summary it has
            p.error(f"--ref={args.ref!r} is not an arm; valid arms: {sorted(ARMS)}")
        if args.runs:
            check_archive(args.runs, "--runs", p)
            report_packed(args.runs, args.out, args.ref)
        elif os.path.isdir(os.path.join(args.out, "forks")):
            fork_report(args.out, args.ref)
        else:
            arms, seeds = find_seed_runs(args.out)
            if not arms:
                p.error(f"no runs found in {args.out}")
            summarize(args.out, arms, seeds)
        return
    args.arms = expand_arms(args.arms, p)
    if args.parallel < 1:
        p.error("--parallel must be at least 1")
    if getattr(args, "stop_after", 0) < 0:
        p.error(f"--stop_after must be >= 0 seconds (0: never stop), got {args.stop_after}")
    if getattr(args, "eval_iters", 0) < 0:
        p.error(f"--eval_iters must be >= 1 (0: the config's), got {args.eval_iters}")
    if getattr(args, "gpus", "") and not _has_cuda():
        p.error(f"--gpus={args.gpus}, but this machine has no CUDA GPU: leave --gpus out")
    if args.cmd == "fork":
        args.base_recipes = expand_arms(args.base_recipe, p)
        if args.ref not in ARMS:
            p.error(f"--ref={args.ref!r} is not an arm; valid arms: {sorted(ARMS)}")
        if args.ref not in args.arms:
            args.arms = [args.ref] + args.arms
        args.bases = parse_ints(args.bases, "bases", p)
        args.fork_at = parse_ints(args.fork_at, "fork_at", p) if args.fork_at else []
        left = fork_main(args, extra, p)
    else:
        left = seeds_main(args, extra, p)
    if left:
        sys.exit(f"{len(left)} run(s) not finished: {left}")


if __name__ == "__main__":
    # SIGTERM (an outer `timeout`, say) unwinds like Ctrl-C: run_jobs then ends its train.py runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main(sys.argv[1:])
