"""plot.py: a PNG from a synthetic log.jsonl, with exactly the panels its keys allow."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import plot  # noqa: E402
from train_helpers import (keep_global_rng, make_char_dataset,  # noqa: E402, F401 (autouse)
                           tiny_args)

def write_log(folder, moe=False, telemetry=False, n=120, extra_lines=()):
    """A log.jsonl as train.py writes it: evals every 40 iterations, train records every 2."""
    os.makedirs(folder, exist_ok=True)
    lines = []
    for it in range(0, n, 2):
        if it % 40 == 0:
            lines.append(dict(type="eval", iter=it, train_loss=4.0 * math.exp(-it / 50) + 1.5,
                              val_loss=4.0 * math.exp(-it / 50) + 1.6))
        rec = dict(type="train", iter=it, loss=4.0 * math.exp(-it / 50) + 1.5 + 0.05 * (it % 3),
                   lr=1e-3 * min(1, (it + 1) / 20), grad_norm=1.0 + (50.0 if it == 60 else 0.0),
                   dt_ms=10.0, tok_per_s=1000.0 if it else 10.0, mfu=0.1, elapsed_s=it / 10)
        if moe:
            rec.update(aux_loss=1.02, z_loss=3.0 - it / 100, ce_loss=rec["loss"] - 0.01,
                       expert_load=[[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]],
                       expert_counts=[[40, 30, 20, 10], [25, 25, 25, 25]])
        if telemetry and it % 20 == 0:
            lines.append(dict(type="telemetry", iter=it, alpha=dict(fprop_x=0.95, wgrad_dy=None),
                              sqnr_db=dict(fprop_x=18.0), layers={}))
        if it == 62:
            lines.append(dict(type="nonfinite", iter=it, loss=float("nan"), grad_norm=float("inf")))
        lines.append(rec)
    path = os.path.join(folder, "log.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
        f.writelines(extra_lines)
    return path

def check_png(path):
    import matplotlib.image
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 300
    # not a blank canvas: many distinct colours (lines, text, markers)
    colours = {tuple(px) for px in (img[::7, ::7, :3] * 255).astype(int).reshape(-1, 3).tolist()}
    assert len(colours) > 20
    return img

def test_dense_log_gives_the_dense_panels(tmp_path):
    write_log(tmp_path / "run", extra_lines=['{"type": "train", "iter": 9'])  # a line cut by a kill
    png = plot.plot_run(str(tmp_path / "run"))
    assert png == str(tmp_path / "run" / "log.png")
    check_png(png)
    records = plot.read_records(str(tmp_path / "run" / "log.jsonl"))
    assert plot.panels_for(records) == ["loss", "lr", "grad_norm", "tok_per_s"]

def test_moe_and_telemetry_panels_appear_only_with_their_keys(tmp_path):
    log = write_log(tmp_path / "moe", moe=True, telemetry=True)
    records = plot.read_records(log)
    assert plot.panels_for(records) == ["loss", "lr", "grad_norm", "tok_per_s", "router",
                                        "expert_load", "alpha"]
    img = check_png(plot.plot_run(log))
    dense = check_png(plot.plot_run(write_log(tmp_path / "dense")))
    assert img.shape[0] > dense.shape[0]   # more panels, a taller figure
    evals_only = [r for r in records if r["type"] == "eval"]
    assert plot.panels_for(evals_only) == ["loss"]

def test_limits_keep_the_start_and_drop_a_spike(tmp_path):
    records = plot.read_records(write_log(tmp_path / "run"))
    _, loss = plot.series(records, "train", "loss")
    lo, hi = plot.robust_limits(loss)
    assert hi >= loss[0]   # the first iterations' descent stays in view
    assert lo <= min(loss) + 0.05
    _, norm = plot.series(records, "train", "grad_norm")
    assert plot.robust_limits(norm)[1] < 2.0      # one 51.0 spike does not flatten the curve
    _, tok = plot.series(records, "train", "tok_per_s")
    assert plot.robust_limits(tok)[0] > 900       # nor does the first step's warm-up time

def test_limits_keep_a_noisy_series_in_view():
    import random
    rng = random.Random(0)
    noisy = [1.0 + rng.gauss(0, 0.3) for _ in range(5000)]
    lo, hi = plot.robust_limits(noisy)
    ordered = sorted(noisy)   # the noise band shows, not only its running median
    assert lo <= ordered[int(0.03 * len(ordered))] and hi >= ordered[int(0.97 * len(ordered))]
    lo, hi = plot.robust_limits([v + 1.0 for v in noisy] + [1e3], log=True)
    assert hi < 10   # one spike still does not set the top, on a log axis too
    assert lo <= ordered[int(0.03 * len(ordered))] + 1.0

def test_a_scratch_run_appended_to_an_old_log_plots_alone(tmp_path):
    log = write_log(tmp_path / "run", n=120)
    with open(log, "a") as f:   # a second run from scratch into the same out_dir
        for it, loss in ((0, 9.0), (2, 8.0)):
            f.write(json.dumps(dict(type="train", iter=it, loss=loss, lr=1e-4, grad_norm=1.0,
                                    tok_per_s=5.0)) + "\n")
    records = plot.read_records(log)
    assert [r["iter"] for r in records] == [0, 2] and records[0]["loss"] == 9.0

def test_missing_or_empty_log_is_a_one_line_error(tmp_path):
    with pytest.raises(plot.PlotError, match="no log at"):
        plot.plot_run(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "log.jsonl").write_text("")
    with pytest.raises(plot.PlotError, match="no records"):
        plot.plot_run(str(tmp_path / "empty"))
    (tmp_path / "tel").mkdir()
    (tmp_path / "tel" / "log.jsonl").write_text(
        json.dumps(dict(type="nonfinite", iter=3, loss=None, grad_norm=None)) + "\n")
    with pytest.raises(plot.PlotError, match="no train or eval records"):
        plot.plot_run(str(tmp_path / "tel"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "log.jsonl").write_bytes(bytes(range(256)) * 4 + b"\n{not json\n")
    with pytest.raises(plot.PlotError, match=r"holds \d+ lines and no train.py record"):
        plot.plot_run(str(tmp_path / "bin"))
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "log.jsonl").write_text('{"type": "train", "it')  # killed mid-line
    with pytest.raises(plot.PlotError, match="no records yet"):
        plot.plot_run(str(tmp_path / "cut"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), str(tmp_path / "nothing"),
                        str(tmp_path / "empty")], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert [line.split(":")[0] for line in r.stderr.strip().splitlines()] == ["error", "error"]

def test_train_plots_its_run(tmp_path):
    import train
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    train.main(tiny_args(ds, str(tmp_path / "out"), max_iters=4, eval_interval=2))
    check_png(str(tmp_path / "out" / "log.png"))


def test_an_unwritable_png_is_one_line_and_the_others_still_plot(tmp_path):
    bad, ok = tmp_path / "bad", tmp_path / "ok"
    write_log(str(bad))
    write_log(str(ok))
    (bad / "log.png").mkdir()   # the PNG cannot be written there (for root too)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), str(bad), str(ok)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1
    assert os.path.exists(ok / "log.png")
