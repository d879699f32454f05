"""ablate.py: a two-arm, two-seed sweep of tiny runs through train.py, resumable, with the gap table."""
import json
import os
import subprocess
import sys

from train_helpers import ROOT, make_char_dataset

import ablate  # noqa: E402


def write_config(tmp_path, ds):
    """A config file for a tiny CPU run (ablate.py adds out_dir, seed and the arm's recipe)."""
    settings = dict(data_dir=os.path.dirname(ds), dataset=os.path.basename(ds), device="cpu",
                    backend="torch", batch_size=4, block_size=32, n_layer=2, n_head=2, n_embd=32,
                    max_iters=12, eval_interval=12, eval_iters=2, log_interval=2, warmup_iters=2,
                    learning_rate=3e-3, min_lr=3e-4)
    cfg = tmp_path / "tiny.py"
    cfg.write_text("".join(f"{k} = {v!r}\n" for k, v in settings.items()))
    return str(cfg)


def test_sweep_runs_pairs_and_resumes(tmp_path):
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    cfg = write_config(tmp_path, ds)
    out = str(tmp_path / "sweep")
    cmd = [sys.executable, "ablate.py", cfg, "--arms=ufp4_no_sr", "--seeds=0,1", f"--out={out}",
           "--parallel=2"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    for arm in ("bf16", "ufp4_no_sr"):   # bf16 is added as the reference of the gap
        for seed in (0, 1):
            assert os.path.exists(os.path.join(out, f"{arm}_s{seed}", "done.json"))
    rows = {r["arm"]: r for r in json.load(open(os.path.join(out, "summary.json")))}
    assert rows["bf16"]["gap_pct"][0] == 0.0
    assert rows["ufp4_no_sr"]["gap_pct"][0] > 0 and rows["ufp4_no_sr"]["seeds"] == 2
    assert rows["ufp4_no_sr"]["gap_pct"][0] >= abs(rows["ufp4_no_sr"]["signed_gap_pct"][0])
    vals = {(a, s): [json.loads(l)["val_loss"] for l in open(os.path.join(out, f"{a}_s{s}", "log.jsonl"))
                     if '"eval"' in l][-1] for a in ("bf16", "ufp4_no_sr") for s in (0, 1)}
    want = [100 * (vals["ufp4_no_sr", s] / vals["bf16", s] - 1) for s in (0, 1)]
    assert abs(rows["ufp4_no_sr"]["val_gap_pct"][0] - sum(want) / 2) < 1e-9
    assert os.path.exists(os.path.join(out, "loss_curves.png"))
    # paired: both arms of a seed start from the same init and data, so their first losses agree
    first = {}
    for arm in ("bf16", "ufp4_no_sr"):
        with open(os.path.join(out, f"{arm}_s0", "log.jsonl")) as f:
            first[arm] = next(json.loads(l)["loss"] for l in f if '"train"' in l)
    assert abs(first["bf16"] - first["ufp4_no_sr"]) < 0.05
    # a second call finds everything done and only redoes the report
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "4 runs already done, 0 to run" in p.stdout


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


def test_unknown_arm_is_a_clear_error():
    p = subprocess.run([sys.executable, "ablate.py", "configs/gpt_ablate.py", "--arms=fp5"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode != 0 and "unknown arm" in p.stderr and "ufp4" in p.stderr
