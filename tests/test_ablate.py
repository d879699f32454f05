"""ablate.py: the forked design end to end on tiny CPU runs (bases, forks, skip, resume, report
arithmetic), the gap-reduction interval on synthetic numbers, the arms' train.py overrides, the
plots, and the seed-per-arm design."""
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest

from train_helpers import ROOT, make_char_dataset

import ablate  # noqa: E402
import fp4  # noqa: E402
import train  # noqa: E402


def write_config(tmp_path, ds, **over):
    """A config file for a tiny CPU run (ablate.py adds out_dir, seed and the arm's recipe)."""
    settings = dict(data_dir=os.path.dirname(ds), dataset=os.path.basename(ds), device="cpu",
                    backend="torch", batch_size=4, block_size=32, n_layer=2, n_head=2, n_embd=32,
                    max_iters=8, eval_interval=2, eval_iters=2, log_interval=2, warmup_iters=2,
                    learning_rate=3e-3, min_lr=3e-4)
    settings.update(over)
    cfg = tmp_path / "tiny.py"
    cfg.write_text("".join(f"{k} = {v!r}\n" for k, v in settings.items()))
    return str(cfg)


def ablate_cli(*args, timeout=600):
    p = subprocess.run([sys.executable, "ablate.py", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def log_of(d, kind):
    with open(os.path.join(d, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["type"] == kind]


def scores_by_hand(out, seed, arm, fork_at=4, end=8):
    d = os.path.join(out, "forks", f"bf16_s{seed}_at{fork_at}_to{end}", arm)
    train_losses = [r["loss"] for r in log_of(d, "train") if fork_at <= r["iter"] < end]
    assert len(train_losses) == end - fork_at   # forks log every step of their window
    return sum(train_losses) / len(train_losses), [r for r in log_of(d, "eval") if r["iter"] == end][-1]["val_loss"]


def test_fork_design_end_to_end_with_skip_and_resume(tmp_path, capsys):
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    cfg = write_config(tmp_path, ds)
    out = str(tmp_path / "fork")
    cmd = ["fork", cfg, "--bases=0,1", "--arms=e2m1", "--fork_at=4", f"--out={out}", "--parallel=2"]
    ablate_cli(*cmd)
    for seed in (0, 1):
        assert os.path.exists(os.path.join(out, "bases", f"bf16_s{seed}_at4", "ckpt.pt"))
        base_evals = [r["iter"] for r in log_of(os.path.join(out, "bases", f"bf16_s{seed}"), "eval")]
        assert max(base_evals) == 4       # the base stops at the fork point
        for arm in ("bf16", "e2m1"):      # bf16, the reference, is added
            d = os.path.join(out, "forks", f"bf16_s{seed}_at4_to8", arm)
            assert log_of(d, "train")[0]["iter"] == 4   # resumed from the base's step-4 state
            base_eval = [r for r in log_of(os.path.join(out, "bases", f"bf16_s{seed}"), "eval") if r["iter"] == 4]
            done = json.load(open(os.path.join(d, "done.json")))  # which training of the base
            assert done["base_fp"] == [base_eval[-1]["train_loss"], base_eval[-1]["val_loss"]]
    # the report's paired arithmetic, against a hand computation from the logs
    by_hand = {(a, s): scores_by_hand(out, s, a) for a in ("bf16", "e2m1") for s in (0, 1)}
    summary = json.load(open(os.path.join(out, "summary.json")))
    (group,) = summary["groups"]
    assert (group["base_recipe"], group["fork_at"], group["end"], group["bases"]) == ("bf16", 4, 8, [0, 1])
    row = {r["arm"]: r for r in group["contrasts"]}["e2m1"]
    for i, score in enumerate(("train", "val")):
        diffs = [by_hand["e2m1", s][i] - by_hand["bf16", s][i] for s in (0, 1)]
        c = row[score]["vs_ref"]
        assert c["n"] == 2
        assert c["per_base"] == pytest.approx({"0": diffs[0], "1": diffs[1]}, abs=1e-12)
        assert c["mean"] == pytest.approx((diffs[0] + diffs[1]) / 2, abs=1e-12)
        assert c["se"] == pytest.approx(abs(diffs[0] - diffs[1]) / 2, abs=1e-12)  # sd / sqrt(2)
    assert "| e2m1 | 2 |" in open(os.path.join(out, "summary.md")).read()
    assert os.path.exists(os.path.join(out, "fork_curves.png"))
    # an interrupted fork: stopped at step 6 (its own checkpoint there), resumed by the next call
    plan = ablate.Plan(cfg, [], out, end=8, schedule=8, eval_iters=2)
    job = ablate.fork_job(plan, "bf16", 1, 4, "e2m1")
    ablate.shutil.rmtree(job.out_dir)
    argv = [a.replace("--max_iters=8", "--max_iters=6") for a in job.argv()]
    subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True, check=True)
    stdout = ablate_cli(*cmd)
    # the three other forks and the one base this fork needs are done; base 0 is not needed
    assert "4 runs already done, 1 to run" in stdout
    resumed = open(os.path.join(out, "logs", "fork__bf16_s1_at4_to8__e2m1.txt")).read()
    assert f"resumed from {os.path.join(job.out_dir, 'ckpt.pt')} at iter 6" in resumed
    assert scores_by_hand(out, 1, "e2m1") == pytest.approx(by_hand["e2m1", 1], abs=1e-6)
    # `report` recomputes the same tables from the runs on disk
    os.remove(os.path.join(out, "summary.json"))
    ablate.main(["report", f"--out={out}"])
    again = json.load(open(os.path.join(out, "summary.json")))
    assert again["groups"][0]["contrasts"][1]["train"]["vs_ref"]["mean"] == pytest.approx(
        row["train"]["vs_ref"]["mean"], abs=1e-6)
    # the next sitting on a fresh machine gets only the packed logs: it reports the same and
    # neither reruns the finished forks nor retrains their bases
    ablate.main(["pack", f"--out={out}", f"--to={tmp_path / 'runs.tgz'}"])
    ablate.shutil.unpack_archive(str(tmp_path / "runs.tgz"), str(tmp_path / "next"))
    moved = str(tmp_path / "next" / "fork")
    assert not [f for f in glob.glob(moved + "/**/*.pt", recursive=True)]
    capsys.readouterr()
    ablate.main([a.replace(out, moved) for a in cmd])
    assert "4 runs already done, 0 to run" in capsys.readouterr().out
    assert json.load(open(os.path.join(moved, "summary.json")))["groups"] == again["groups"]


def test_gap_reduction_interval_on_synthetic_gaps():
    new, old = [0.6, 0.9, 0.7, 1.0], [1.0, 1.2, 0.9, 1.3]
    g = ablate.gap_reduction(new, old)
    n, mn, mo = 4, sum(new) / 4, sum(old) / 4
    r = mn / mo
    var = lambda xs, m: sum((x - m) ** 2 for x in xs) / (n - 1)  # noqa: E731
    cov = sum((a - mn) * (b - mo) for a, b in zip(new, old)) / (n - 1)
    se = math.sqrt((var(new, mn) - 2 * r * cov + r * r * var(old, mo)) / n) / mo
    assert g["estimate"] == pytest.approx(1 - 0.8 / 1.1, abs=1e-12)
    assert g["se"] == pytest.approx(se, rel=1e-12)
    assert g["ci95"] == pytest.approx([g["estimate"] - 3.182 * se, g["estimate"] + 3.182 * se], rel=1e-12)
    assert g["boot_ci95"][0] < g["estimate"] < g["boot_ci95"][1]
    assert g["old_gap"] == pytest.approx(1.1) and g["n"] == 4
    # gaps exactly proportional: the reduction is known without error
    exact = ablate.gap_reduction([0.8 * x for x in old], old)
    assert exact["estimate"] == pytest.approx(0.2) and exact["se"] == pytest.approx(0, abs=1e-12)
    assert exact["boot_ci95"] == pytest.approx([0.2, 0.2])
    assert math.isnan(ablate.gap_reduction([0.5], [1.0])["se"])  # one base: no interval
    assert ablate.t975(1) == 12.706 and abs(ablate.t975(60) - 2.000) < 0.003


def test_every_arm_is_a_valid_train_override():
    cfg_path = os.path.join(ROOT, "configs", "gpu", "ablate_gpt.py")
    recipes = {}
    for arm in ablate.ARMS:
        cfg = train.get_config([cfg_path, *ablate.arm_args(arm)])
        recipes[arm] = r = train.make_recipe_from(cfg)
        if r.quantized:
            fp4.check_dims(r, cfg["n_embd"], 1024)   # d = 384, SwiGLU hidden 1024
    rht = lambda r: tuple(g for g in fp4.GEMMS if getattr(r, g).rht)  # noqa: E731
    grid = lambda r: fp4.get_format(r.fprop.fmt)  # noqa: E731
    assert rht(recipes["int4_rht_none"]) == ()
    assert rht(recipes["int4_rht_dgrad_wgrad"]) == ("dgrad", "wgrad")
    assert rht(recipes["int4_rht_fprop_wgrad"]) == ("fprop", "wgrad")
    assert rht(recipes["ufp4"]) == fp4.GEMMS and rht(recipes["e2m1_rht_all"]) == fp4.GEMMS
    assert recipes["ufp4"].wgrad.sr_a and not recipes["ufp4_no_sr"].wgrad.sr_a
    assert not recipes["ufp4_no_sr"].dgrad.sr_a
    assert (grid(recipes["ufp4_e8m0"]).grid, grid(recipes["ufp4_e8m0"]).block,
            grid(recipes["ufp4_e8m0"]).scale) == ("int4", 16, "e8m0")
    assert (grid(recipes["mxint4"]).grid, grid(recipes["mxint4"]).block) == ("int4", 32)
    assert all(grid(recipes[a]).grid == "int4" for a in ablate.PAPER_LOSS)
    assert set(ablate.GROUPS["placement"]) >= set(ablate.PAPER_LOSS)


def fake_fork_runs():
    def run(offset):
        train_c = {i: 3.0 - 0.01 * (i - 100) + offset for i in range(100, 150)}
        val_c = {125: 3.1 + offset, 150: 2.6 + offset}
        return dict(train=statistics.fmean(train_c.values()), val=val_c[150], steps=50,
                    train_curve=train_c, val_curve=val_c)
    return {("bf16", 100, 150, 2): {"bf16": {0: run(0.0), 1: run(0.01)},
                                    "e2m1": {0: run(0.02), 1: run(0.03)}}}


def test_fork_plot_draws_train_and_val_curves_and_no_empty_panel(tmp_path):
    fig = ablate.plot_forks(fake_fork_runs(), "bf16", str(tmp_path / "f.png"))
    train_ax, val_ax, diff_ax = fig.axes
    train_lines = {ln.get_label(): ln for ln in train_ax.lines}
    val_lines = {ln.get_label(): ln for ln in val_ax.lines}
    assert {"bf16 train", "e2m1 train"} <= set(train_lines) and {"bf16 val", "e2m1 val"} <= set(val_lines)
    assert list(val_lines["e2m1 val"].get_xdata()) == [125, 150]   # the evals of the fork window
    assert val_lines["e2m1 val"].get_ydata()[-1] == pytest.approx(2.625)  # mean over the two bases
    assert min(train_lines["bf16 train"].get_xdata()) == 100       # the fork window only
    diff = {ln.get_label(): ln for ln in diff_ax.lines}["e2m1 val"]
    assert list(diff.get_ydata()) == pytest.approx([0.02, 0.02])
    # no reference among the runs: no third (empty) panel
    only = {k: {"e2m1": v["e2m1"]} for k, v in fake_fork_runs().items()}
    assert len(ablate.plot_forks(only, "bf16", str(tmp_path / "g.png")).axes) == 2


def test_seed_plot_shows_the_whole_run_and_val_curves(tmp_path):
    curve = {i: 10.0 * math.exp(-i / 50) + 1.5 for i in range(0, 300, 10)}
    runs = {("bf16", 0): dict(train=curve, val={0: 11.5, 150: 2.0, 290: 1.6}),
            ("ufp4", 0): dict(train={i: v * 1.01 for i, v in curve.items()}, val={0: 11.6, 290: 1.62})}
    fig = ablate.plot_seeds(runs, ["bf16", "ufp4"], [0], str(tmp_path / "s.png"))
    ax, gap_ax = fig.axes
    lo, hi = ax.get_ylim()
    assert lo <= 1.5 and hi >= 11.6             # the first iterations are not cut off
    assert {"bf16 val", "ufp4 val", "ufp4 train"} <= {ln.get_label() for ln in ax.lines}
    assert gap_ax.lines                         # the paired-gap panel has curves
    only = ablate.plot_seeds({("bf16", 0): runs["bf16", 0]}, ["bf16"], [0], str(tmp_path / "t.png"))
    assert len(only.axes) == 1                  # nothing to pair: no empty gap panel


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    for argv, msg in ((["fork", "configs/gpt_ablate.py", "--arms=fp5", "--out=x"], "unknown arm"),
                      (["fork", "configs/gpt_ablate.py", f"--out={tmp_path}", "--seed=3"], "ablate.py sets"),
                      (["fork", "configs/gpt_ablate.py", f"--out={tmp_path}", "--fork_at=9999"], "strictly between"),
                      (["fork", "configs/gpt_ablate.py", f"--out={tmp_path}", "--arms=mxfp4",
                        "--n_embd=48", "--n_head=2"], "does not fit recipe 'mxfp4'"),
                      (["fork", "configs/gpt_ablate.py", f"--out={tmp_path}", "--end=-5"], "--end=-5: give"),
                      (["fork", "configs/gpt_ablate.py", f"--out={tmp_path}", "--bases=3-1"],
                       "the range 3-1 runs backwards"),
                      (["seeds", "configs/gpt_ablate.py", "--seeds=a"], "expected numbers"),
                      # an arm's recipe or the seed set through would make every arm one run
                      (["seeds", "configs/gpt_ablate.py", "--recipe=ufp4"], "ablate.py sets"),
                      (["seeds", "configs/gpt_ablate.py", "--recipe_sr=none"], "ablate.py sets"),
                      (["seeds", "configs/gpt_ablate.py", "--seed=7"], "ablate.py sets")):
        with pytest.raises(SystemExit):
            ablate.main(argv)
        assert msg in capsys.readouterr().err
    # a later sitting in the same --out must pair with the first one's runs
    parser = ablate.build_parser()

    def plan_for(*extra):
        args, rest = parser.parse_known_args(["fork", "configs/gpt_ablate.py", f"--out={tmp_path}", *extra])
        args.arms, args.base_recipes, args.fork_at = ["bf16"], ["bf16"], []
        return ablate.make_plan(args, rest, parser)
    plan, points = plan_for()
    assert (points, plan.end, plan.schedule, plan.eval_iters) == ([300], 450, 450, 20)  # 2/3 of the run
    with pytest.raises(SystemExit):
        plan_for("--n_layer=3")
    assert "do not pair" in capsys.readouterr().err


def test_seeds_sweep_runs_pairs_and_resumes(tmp_path):
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    cfg = write_config(tmp_path, ds, max_iters=6, eval_interval=6, log_interval=1)
    out = str(tmp_path / "sweep")
    cmd = ["seeds", cfg, "--arms=ufp4_no_sr", "--seeds=0,1", f"--out={out}", "--parallel=2"]
    ablate_cli(*cmd)
    for arm in ("bf16", "ufp4_no_sr"):   # bf16 is added as the reference of the gap
        for seed in (0, 1):
            assert os.path.exists(os.path.join(out, f"{arm}_s{seed}", "done.json"))
    rows = {r["arm"]: r for r in json.load(open(os.path.join(out, "summary.json")))}
    assert rows["bf16"]["gap_pct"][0] == 0.0
    assert rows["ufp4_no_sr"]["gap_pct"][0] > 0 and rows["ufp4_no_sr"]["seeds"] == 2
    assert rows["ufp4_no_sr"]["gap_pct"][0] >= abs(rows["ufp4_no_sr"]["signed_gap_pct"][0])
    vals = {(a, s): log_of(os.path.join(out, f"{a}_s{s}"), "eval")[-1]["val_loss"]
            for a in ("bf16", "ufp4_no_sr") for s in (0, 1)}
    want = [100 * (vals["ufp4_no_sr", s] / vals["bf16", s] - 1) for s in (0, 1)]
    assert abs(rows["ufp4_no_sr"]["val_gap_pct"][0] - sum(want) / 2) < 1e-9
    assert os.path.exists(os.path.join(out, "loss_curves.png"))
    # paired: both arms of a seed start from the same init and data, so their first losses agree
    # far more closely than two seeds' do
    first = {(a, s): log_of(os.path.join(out, f"{a}_s{s}"), "train")[0]["loss"]
             for a in ("bf16", "ufp4_no_sr") for s in (0, 1)}
    pair = max(abs(first["bf16", s] - first["ufp4_no_sr", s]) for s in (0, 1))
    assert pair < 5e-3 and abs(first["bf16", 0] - first["bf16", 1]) > 2 * pair, first
    # a second call finds everything done and only redoes the report
    assert "4 runs already done, 0 to run" in ablate_cli(*cmd)


def test_gap_is_mean_relative_difference_over_the_tail():
    ref = {i: 2.0 for i in range(100)}
    cur = {i: (2.2 if i >= 90 else 5.0) for i in range(100)}
    assert abs(ablate.gap(cur, ref) - 0.1) < 1e-12
    assert abs(ablate.signed_gap(cur, ref) - 0.1) < 1e-12
    # noise around the reference: the paper's gap stays positive, the signed gap does not
    noisy = {i: 2.0 + (0.1 if i % 2 else -0.1) for i in range(100)}
    assert abs(ablate.gap(noisy, ref) - 0.05) < 1e-12 and abs(ablate.signed_gap(noisy, ref)) < 1e-12
    below = {i: 1.9 for i in range(100)}
    assert abs(ablate.signed_gap(below, ref) + 0.05) < 1e-12 and abs(ablate.gap(below, ref) - 0.05) < 1e-12


def test_val_gap_compares_the_last_eval_both_runs_reached():
    ref = {0: 4.0, 500: 3.0, 1000: 2.0}
    stopped = {0: 4.0, 500: 3.3}   # a run stopped early is not compared with the finished end
    assert abs(ablate.val_gap(stopped, ref) - 10.0) < 1e-9


def test_several_fork_points_chain_the_base_and_each_fork_waits_for_its_point(tmp_path):
    plan = ablate.Plan("cfg.py", ["--device=cpu"], str(tmp_path), end=9, schedule=12, eval_iters=3)
    jobs = ablate.base_jobs(plan, "e2m1", 5, [3, 6])
    assert [j.name for j in jobs] == ["base/e2m1_s5_at3", "base/e2m1_s5_at6"]
    assert jobs[0].after == () and jobs[1].after == ("base/e2m1_s5_at3",)   # resumed from step 3
    argv = jobs[1].argv()
    assert {"--max_iters=6", "--lr_decay_iters=12", "--seed=5", "--recipe=e2m1",
            "--always_save_checkpoint=True", "--device=cpu"} <= set(argv)
    os.makedirs(plan.base_dir("e2m1", 5))
    open(os.path.join(plan.base_dir("e2m1", 5), "ckpt.pt"), "w").close()
    assert jobs[1].argv()[-1] == "--init_from=resume"
    fork = ablate.fork_job(plan, "e2m1", 5, 6, "ufp4_no_sr")
    assert fork.after == ("base/e2m1_s5_at6",)
    argv = fork.argv()
    assert {"--max_iters=9", "--lr_decay_iters=12", "--eval_iters=3", "--log_interval=1", "--recipe=ufp4",
            "--recipe_sr_dy=False", "--init_from=resume"} <= set(argv)
    assert argv[-1] == f"--resume_from={plan.snapshot('e2m1', 5, 6)}"
    # a base already past a fork point cannot fork there any more
    with open(os.path.join(plan.base_dir("e2m1", 5), "log.jsonl"), "w") as f:
        f.write(json.dumps(dict(type="eval", iter=6, train_loss=1.0, val_loss=1.0)) + "\n")
    with pytest.raises(SystemExit, match="past the new fork point 3"):
        ablate.base_jobs(plan, "e2m1", 5, [3, 6])


def test_crossover_pairs_the_same_arm_across_base_recipes():
    def runs(shift):
        return {arm: {s: dict(train=1.0 + shift + 0.1 * i + 0.01 * s, val=2.0 + shift)
                      for s in (0, 1)} for i, arm in enumerate(("e2m1", "ufp4"))}
    groups = {("e2m1", 10, 20, 5): runs(0.0), ("ufp4", 10, 20, 5): runs(-0.03)}
    rows = ablate.crossover(groups)
    assert [(r["arm"], r["base"], r["vs_base"]) for r in rows] == [("e2m1", "ufp4", "e2m1"),
                                                                    ("ufp4", "ufp4", "e2m1")]
    assert all(r["train"]["mean"] == pytest.approx(-0.03) and r["train"]["n"] == 2 for r in rows)
    assert "Crossover" in "\n".join(ablate.crossover_markdown(rows))


def test_crossover_compares_every_pair_of_base_recipes():
    def runs(shift):
        return {"ufp4": {s: dict(train=1.0 + shift + 0.01 * s, val=2.0 + shift) for s in (0, 1)}}
    groups = {(r, 10, 20, 5): runs(x) for r, x in (("bf16", 0.0), ("e2m1", 0.02), ("ufp4", 0.05))}
    got = {(r["base"], r["vs_base"]): r["train"]["mean"] for r in ablate.crossover(groups)}
    assert got == pytest.approx({("e2m1", "bf16"): 0.02, ("ufp4", "bf16"): 0.05, ("ufp4", "e2m1"): 0.03})


def synthetic_group(recipe, p, e2m1, ufp4, seeds=(0, 1, 2)):
    """Fork scores of bf16, e2m1 and ufp4 arms whose gaps to bf16 are e2m1 and ufp4 (+ a per-base wobble)."""
    def run(x):
        return dict(train=x, val=x + 0.2, steps=5, train_curve={}, val_curve={}, base_fp=None)
    return {(recipe, p, 1500, 100): {arm: {s: run(3.0 + s * 0.01 + gap * (1 + 0.01 * s)) for s in seeds}
                                     for arm, gap in (("bf16", 0.0), ("e2m1", e2m1), ("ufp4", ufp4))}}


def test_glance_table_has_one_row_per_starting_point_and_fork_point():
    groups = {**synthetic_group("bf16", 500, 0.02, 0.016), **synthetic_group("bf16", 1000, 0.01, 0.008),
              **synthetic_group("e2m1", 1000, 0.012, 0.009)}
    summary = dict(groups=[dict(base_recipe=k[0], fork_at=k[1], end=k[2], eval_iters=k[3],
                                **ablate.group_summary(runs, "bf16")) for k, runs in sorted(groups.items())])
    rows = [line for line in ablate.glance_markdown(summary) if line.startswith("| bf16 |")
            or line.startswith("| e2m1 |")]
    assert [r.split(" | ")[:3] for r in rows] == [["| bf16", "500", "500..1499"], ["| bf16", "1000", "1000..1499"],
                                                  ["| e2m1", "1000", "1000..1499"]]
    assert "20.0 %" in rows[0] and "20.0 %" in rows[1] and "25.0 %" in rows[2]
    # a reference that is one of the two recipes has no gap reduction (and no crash)
    only = ablate.group_summary(next(iter(synthetic_group("e2m1", 1000, 0.01, 0.008).values())), "e2m1")
    assert "gap_reduction" not in only and only["contrasts"][2]["train"]["vs_ref"]["mean"] < 0
    assert ablate.glance_markdown(dict(groups=summary["groups"][:1])) == []   # one group: nothing to glance at


def test_growth_splits_the_window_into_fifths_paired_by_base():
    def run(curve):
        return dict(train=0, val=0, steps=len(curve), train_curve=curve, val_curve={}, base_fp=None)
    steps = range(100, 110)
    runs = {"bf16": {s: run({i: 3.0 + s for i in steps}) for s in (0, 1)},
            "e2m1": {s: run({i: 3.0 + s + 0.01 * (i - 99) for i in steps}) for s in (0, 1)},
            "ufp4": {s: run({i: 3.0 + s + 0.008 * (i - 99) + 0.001 * s for i in steps}) for s in (0, 1)}}
    rows = ablate.growth(runs, "bf16")
    assert [r["steps"] for r in rows] == [[100, 101], [102, 103], [104, 105], [106, 107], [108, 109]]
    assert rows[0]["e2m1"][0] == pytest.approx(0.015) and rows[-1]["e2m1"][0] == pytest.approx(0.095)
    assert rows[0]["ufp4"] == pytest.approx((0.0125, 0.0005))   # per base 0.012, 0.013
    assert rows[-1]["reduction"] == pytest.approx(1 - 0.0765 / 0.095)
    assert "| 100..101 | +0.01500 ± 0.00000 | +0.01250 ± 0.00050 | 16.7 % |" in ablate.growth_markdown(rows, "bf16")


def test_forks_of_a_base_trained_again_differently_are_not_paired():
    def run(train, fp):
        return dict(train=train, val=train + 1, steps=5, train_curve={}, val_curve={}, base_fp=fp)
    runs = {"bf16": {0: run(3.0, [1.0, 2.0]), 1: run(3.0, [1.5, 2.5])},
            "e2m1": {0: run(3.1, [1.0, 2.0]), 1: run(3.9, [1.6, 2.6])},   # seed 1: another training
            "ufp4": {0: run(3.05, [1.0, 2.0]), 1: run(3.05, [1.5, 2.5])}}
    g = ablate.group_summary(runs, "bf16")
    rows = {r["arm"]: r for r in g["contrasts"]}
    assert rows["e2m1"]["unpaired"] == [1] and rows["ufp4"]["unpaired"] == []
    assert rows["e2m1"]["train"]["vs_ref"]["n"] == 1
    assert rows["e2m1"]["train"]["vs_ref"]["mean"] == pytest.approx(0.1)
    assert rows["ufp4"]["train"]["vs_ref"]["n"] == 2
    assert g["gap_reduction"]["train"]["n"] == 1 and g["gap_reduction"]["train"]["estimate"] == pytest.approx(0.5)
    assert "not paired" in "\n".join(ablate.group_markdown(("bf16", 1, 6, 2), g))


def test_a_fork_runs_again_when_its_base_was_trained_again_differently(tmp_path):
    plan = ablate.Plan("cfg.py", [], str(tmp_path), end=9, schedule=9, eval_iters=3)
    fork = ablate.fork_job(plan, "bf16", 0, 6, "ufp4")
    os.makedirs(fork.out_dir)
    with open(os.path.join(fork.out_dir, "done.json"), "w") as f:
        json.dump(dict(base_fp=[2.0, 2.5]), f)
    assert fork.done()                 # no base here (a fresh machine with packed logs): done
    base = plan.base_dir("bf16", 0)
    os.makedirs(base)
    os.makedirs(os.path.dirname(plan.snapshot("bf16", 0, 6)))
    open(plan.snapshot("bf16", 0, 6), "w").close()
    for val, done in ((2.5, True), (2.6, False)):   # the base trained here: the same, or not
        with open(os.path.join(base, "log.jsonl"), "w") as f:
            f.write(json.dumps(dict(type="eval", iter=6, train_loss=2.0, val_loss=val)) + "\n")
        assert fork.done() is done


def fake_fork(out, seed, arm, offset, done=True, base_fp=(3.0, 3.1), fork_at=4, end=8):
    """A fork's log (every step of the window, the eval at the end) and done marker, written by
    hand: losses 2 + offset + 0.01 i at step i, val 2.5 + offset."""
    d = os.path.join(out, "forks", f"bf16_s{seed}_at{fork_at}_to{end}", arm)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "log.jsonl"), "w") as f:
        for i in range(fork_at, end):
            f.write(json.dumps(dict(type="train", iter=i, loss=2.0 + offset + 0.01 * i)) + "\n")
        f.write(json.dumps(dict(type="eval", iter=end, train_loss=2.4, val_loss=2.5 + offset)) + "\n")
    if done:
        with open(os.path.join(d, "done.json"), "w") as f:
            json.dump(dict(arm=arm, overrides=ablate.ARMS[arm], base_recipe="bf16", seed=seed,
                           fork_at=fork_at, end=end, eval_iters=2, base_fp=list(base_fp)), f)
    open(os.path.join(d, "ckpt.pt"), "w").close()   # packs leave checkpoints out
    return d


def fake_sitting(out, gaps, stamp=None):
    """An --out with forks of bf16 bases: gaps {seed: {arm: offset}} (bf16 at 0 is added)."""
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    with open(os.path.join(out, "ablate.json"), "w") as f:
        json.dump(stamp or dict(config="cfg.py", extra=[], schedule=8, eval_iters=2), f)
    for seed, arms in gaps.items():
        for arm, offset in {"bf16": 0.0, **arms}.items():
            fake_fork(out, seed, arm, offset)
            with open(os.path.join(out, "logs", f"fork__bf16_s{seed}_at4_to8__{arm}.txt"), "w") as f:
                f.write(f"{arm} s{seed}\n")


def test_report_from_a_packed_archive_and_a_later_sitting_merged_into_it(tmp_path):
    first, later = str(tmp_path / "a" / "fork"), str(tmp_path / "b" / "fork")
    fake_sitting(first, {0: {"e2m1": 0.02, "ufp4": 0.015, "ufp4_e8m0": 0.025},
                         1: {"e2m1": 0.03, "ufp4": 0.025, "ufp4_e8m0": 0.035}})
    fake_fork(first, 1, "mxint4", 0.04, done=False)   # stopped: a later sitting finishes it
    archive, dest = str(tmp_path / "runs.tgz"), str(tmp_path / "report")
    ablate.main(["pack", f"--out={first}", f"--to={archive}"])
    ablate.main(["report", f"--runs={archive}", f"--out={dest}"])
    assert sorted(os.listdir(dest)) == ["fork_curves.png", "summary.json", "summary.md"]
    md = open(os.path.join(dest, "summary.md")).read()
    assert md.startswith(f"The runs packed in `{archive}`: `python ablate.py report --runs={archive} "
                         f"--out={dest}`.")
    (g,) = json.load(open(os.path.join(dest, "summary.json")))["groups"]
    rows = {r["arm"]: r for r in g["contrasts"]}
    assert g["bases"] == [0, 1] and "mxint4" not in rows            # an unfinished fork is no row
    assert rows["e2m1"]["train"]["vs_ref"]["mean"] == pytest.approx(0.025, abs=1e-12)
    assert rows["e2m1"]["val"]["vs_ref"]["per_base"] == pytest.approx({"0": 0.02, "1": 0.03}, abs=1e-12)
    assert g["gap_reduction"]["train"]["estimate"] == pytest.approx(1 - 0.02 / 0.025, abs=1e-9)
    fmt = {r["arm"]: r for r in g["formats"]}   # the power-of-two scale against ufp4
    assert fmt["ufp4_e8m0"]["train"]["vs_ref"]["mean"] == pytest.approx(0.01, abs=1e-12)
    assert "| ufp4_e8m0 | 2 |" in md and "int4, 1x16, e8m0 scale" in md
    # a later sitting on a fresh machine: base 2, and base 1's mxint4 finished; base 0's e2m1 again,
    # stopped (its finished fork in the archive stays)
    fake_sitting(later, {1: {}, 2: {"e2m1": 0.01, "ufp4": 0.008}})
    fake_fork(later, 1, "mxint4", 0.045)
    fake_fork(later, 0, "e2m1", 0.5, done=False)
    ablate.main(["pack", f"--out={later}", f"--to={archive}", f"--merge={archive}"])
    ablate.main(["report", f"--runs={archive}", f"--out={dest}"])
    (g,) = json.load(open(os.path.join(dest, "summary.json")))["groups"]
    rows = {r["arm"]: r for r in g["contrasts"]}
    assert g["bases"] == [0, 1, 2]
    assert rows["e2m1"]["train"]["vs_ref"]["per_base"] == pytest.approx({"0": 0.02, "1": 0.03, "2": 0.01})
    assert rows["mxint4"]["train"]["vs_ref"]["per_base"] == pytest.approx({"1": 0.045})
    assert rows["ufp4_e8m0"]["runs"] == 2
    import tarfile
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert len(names) == len(set(names)) and all(n.startswith("fork/") for n in names)
    assert not [n for n in names if n.endswith(".pt")]
    assert "fork/logs/fork__bf16_s2_at4_to8__ufp4.txt" in names
    assert not os.path.exists(archive + ".tmp")
    # runs of another config do not merge
    other = str(tmp_path / "c" / "fork")
    fake_sitting(other, {3: {}}, stamp=dict(config="cfg.py", extra=["--n_layer=3"], schedule=8, eval_iters=2))
    with pytest.raises(SystemExit, match="do not pair"):
        ablate.main(["pack", f"--out={other}", f"--to={tmp_path / 'x.tgz'}", f"--merge={archive}"])


@pytest.mark.parametrize("name", ["fork_gpt", "fork_moe"])
def test_the_committed_fork_tables_are_what_the_committed_runs_give(tmp_path, name):
    """results/ablation/NAME/summary.* come from results/ablation/NAME_runs.tgz."""
    archive = f"results/ablation/{name}_runs.tgz"
    ablate_cli("report", f"--runs={archive}", f"--out={tmp_path}")
    committed = os.path.join(ROOT, "results", "ablation", name)
    assert json.load(open(tmp_path / "summary.json")) == json.load(open(os.path.join(committed, "summary.json")))
    assert (open(tmp_path / "summary.md").read().splitlines()[1:]
            == open(os.path.join(committed, "summary.md")).read().splitlines()[1:])


def test_a_fork_takes_no_recipe_key_from_a_base_of_the_same_recipe_name(tmp_path):
    """mxint4 is recipe ufp4 with recipe_format=mxint4: its base forked into the ufp4 arm (or a
    ufp4_sr16 base into ufp4) must train ufp4 itself, not the base's format or SR bits."""
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    cfg = write_config(tmp_path, ds, max_iters=4)
    plan = ablate.Plan(cfg, [], str(tmp_path / "fork"), end=4, schedule=4, eval_iters=2)
    for base, arm in (("mxint4", "ufp4"), ("ufp4_sr16", "ufp4"), ("e2m1_rht_all", "e2m1")):
        snap = plan.snapshot(base, 0, 2)
        train.main([cfg, f"--out_dir={os.path.dirname(snap)}", "--max_iters=2", "--eval_interval=2",
                    *ablate.arm_args(base)])
        got, _ = train.configure(ablate.fork_job(plan, base, 0, 2, arm).argv())   # as resumed
        want = train.get_config([cfg, *ablate.arm_args(arm)])
        keys = (*train.RECIPE_KEYS, "recipe", "sr_bits")
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, (base, arm)

def test_report_refuses_an_unknown_ref_before_replacing_the_summary(tmp_path, capsys):
    out = str(tmp_path / "fork")
    fake_sitting(out, {0: {"e2m1": 0.02, "ufp4": 0.015}})
    ablate.main(["report", f"--out={out}"])
    before = open(os.path.join(out, "summary.md")).read()
    with pytest.raises(SystemExit):
        ablate.main(["report", f"--out={out}", "--ref=foo"])
    assert "--ref='foo' is not an arm" in capsys.readouterr().err
    assert open(os.path.join(out, "summary.md")).read() == before
    with pytest.raises(SystemExit, match="--ref=nvfp4 has no finished forks in .*; the arms that "
                                         "ran: bf16, e2m1, ufp4"):   # an arm, but not one of these
        ablate.main(["report", f"--out={out}", "--ref=nvfp4"])
    assert open(os.path.join(out, "summary.md")).read() == before


def test_one_seed_has_no_spread():
    assert ablate._fmt(ablate._ms([4.36])) == "4.3600 ± -"
    assert ablate._fmt(ablate._ms([1.0, 3.0]), 1) == "2.0 ± 1.4"


def test_pack_and_report_check_their_paths_and_archives(tmp_path, capsys):
    out = str(tmp_path / "fork")
    fake_sitting(out, {0: {"e2m1": 0.02, "ufp4": 0.015}})
    text = tmp_path / "notes.txt"
    text.write_text("not an archive")
    for argv, msg in ((["pack", f"--out={tmp_path / 'none'}", f"--to={tmp_path / 'p.tgz'}"], "no such folder"),
                      (["pack", f"--out={out}", f"--to={tmp_path / 'none' / 'p.tgz'}"], "its folder does not exist"),
                      (["pack", f"--out={out}", f"--to={tmp_path / 'p.tgz'}", f"--merge={text}"], "--merge=.*not a tar"),
                      (["report", f"--out={tmp_path / 'r'}", f"--runs={text}"], "--runs=.*not a tar archive"),
                      (["report", f"--out={tmp_path / 'r'}", f"--runs={tmp_path / 'x.tgz'}"], "no such file")):
        with pytest.raises(SystemExit):
            ablate.main(argv)
        assert re.search(msg, capsys.readouterr().err), argv
    assert not os.path.exists(tmp_path / "p.tgz")


def test_seeds_report_only_and_stop_after_are_checked(tmp_path, capsys):
    cfg = os.path.join(ROOT, "configs", "gpt_ufp4.py")
    for argv, msg in ((["seeds", cfg, f"--out={tmp_path / 'none'}", "--report_only"], "no runs found"),
                      (["seeds", cfg, f"--out={tmp_path / 'x'}", "--stop_after=-5"], "--stop_after must be >= 0")):
        with pytest.raises(SystemExit):
            ablate.main(argv)
        assert msg in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "none")


def test_a_fork_with_a_skipped_or_missing_step_has_no_train_score(tmp_path):
    """A non-finite step (train.py skips it and logs NaN) or a step missing from the log leaves
    the fork without a train score, said in the report; every glance cell and the growth table
    then use the same bases: e2m1's gap is 0.01, 0.01, 0.04 and ufp4's 0.8 of it on every base,
    a 20 % reduction wherever it is measured."""
    out = str(tmp_path / "out")
    fake_sitting(out, {0: {"e2m1": 0.01, "ufp4": 0.008}, 1: {"e2m1": 0.01, "ufp4": 0.008},
                       2: {"e2m1": 0.04, "ufp4": 0.032}, 3: {"e2m1": 0.01, "ufp4": 0.008}})
    for seed, broken in ((2, "nan"), (3, "missing")):
        path = os.path.join(out, "forks", f"bf16_s{seed}_at4_to8", "ufp4", "log.jsonl")
        lines = open(path).read().splitlines()
        if broken == "nan":
            lines[1] = json.dumps(dict(type="train", iter=5, loss=float("nan")))
        else:
            del lines[1]
        open(path, "w").write("\n".join(lines) + "\n")
    ablate.fork_report(out, "bf16")
    g = json.load(open(os.path.join(out, "summary.json")))["groups"][0]
    assert g["excluded"] == {"ufp4": {"2": "non-finite loss at step(s) [5]",
                                      "3": "3 of its 4 window steps logged"}}
    assert g["gap_reduction"]["train"]["n"] == 2 and g["gap_reduction"]["val"]["n"] == 4
    assert g["gap_reduction"]["train"]["estimate"] == pytest.approx(0.2)
    assert g["gap_reduction"]["train"]["old_gap"] == pytest.approx(0.01)   # bases 0 and 1 only
    assert all(r["reduction"] == pytest.approx(0.2) for r in g["growth"])
    md = open(os.path.join(out, "summary.md")).read()
    assert "**no train score**: ufp4's fork of base 2 (non-finite loss at step(s) [5])" in md


def test_the_seeds_report_leaves_out_unfinished_runs(tmp_path):
    """A run stopped at step 500 would be averaged with finished ones at 1000: only runs with
    done.json count."""
    for arm, seed, done in (("bf16", 0, True), ("bf16", 1, True), ("ufp4", 0, True), ("ufp4", 1, False)):
        d = ablate.run_dir(str(tmp_path), arm, seed)
        os.makedirs(d)
        last = 1000 if done else 500
        with open(os.path.join(d, "log.jsonl"), "w") as f:
            for i in range(0, last, 100):
                f.write(json.dumps(dict(type="train", iter=i, loss=3.0)) + "\n")
            f.write(json.dumps(dict(type="eval", iter=last, train_loss=3.0 - last / 1000,
                                    val_loss=3.1)) + "\n")
        if done:
            open(os.path.join(d, "done.json"), "w").write("{}")
    runs = ablate.load_seed_runs(str(tmp_path), ["bf16", "ufp4"], [0, 1])
    assert sorted(runs) == [("bf16", 0), ("bf16", 1), ("ufp4", 0)]
