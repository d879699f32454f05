"""bench.py on the CPU: tiny recipes' runs, twice into the same --out."""
import json
import os

import pytest

from train_helpers import keep_global_rng, make_char_dataset, tiny_args  # noqa: F401 (autouse)

import bench  # noqa: E402  (train_helpers puts the repo root on sys.path)


def test_bench_twice_into_one_out(tmp_path):
    """train.py refuses a scratch run into a folder holding a run: bench.py replaces its own."""
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    extra = [a for a in tiny_args(ds, "unused", max_iters=0)
             if a[2:].split("=")[0] not in bench.OWN_KEYS]
    config = tmp_path / "tiny.py"
    config.write_text("n_layer = 2\n")
    argv = [str(config), "--recipes=bf16,ufp4", "--warmup=1", "--iters=2",
            f"--out={tmp_path / 'bench'}"] + extra
    for _ in range(2):
        rows = bench.main(argv)
        assert [r["recipe"] for r in rows] == ["bf16", "ufp4"]
        assert all(r["tok_per_s"] > 0 for r in rows)
    saved = json.load(open(tmp_path / "bench" / "bench.json"))
    assert [r["recipe"] for r in saved["rows"]] == ["bf16", "ufp4"]
    assert not os.path.exists(tmp_path / "bench" / "ufp4" / "ckpt.pt"), "benchmarks write no checkpoint"
    log = [json.loads(line) for line in open(tmp_path / "bench" / "ufp4" / "log.jsonl")]
    assert [r["iter"] for r in log if r["type"] == "train"] == [0, 1, 2]   # the second run's alone


def test_rounds_alternate_the_order_and_take_the_median(tmp_path, monkeypatch):
    """--rounds=3: the list, reversed, then again; each recipe's step time is its median round,
    tokens/s follows from it, and the table lists every round."""
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    extra = [a for a in tiny_args(ds, "unused", max_iters=0)
             if a[2:].split("=")[0] not in bench.OWN_KEYS]
    config = tmp_path / "tiny.py"
    config.write_text("n_layer = 2\n")
    real, ran = bench.bench_one, []

    def timed(config, spec, warmup, iters, out_dir, extra):  # a known step time per call
        ran.append((spec, os.path.relpath(out_dir, tmp_path / "bench")))
        return dict(real(config, spec, warmup, iters, out_dir, extra), step_ms=float(len(ran)))
    monkeypatch.setattr(bench, "bench_one", timed)
    rows = bench.main([str(config), "--recipes=bf16,ufp4", "--warmup=0", "--iters=1", "--rounds=3",
                       f"--out={tmp_path / 'bench'}"] + extra)
    assert ran == [("bf16", "round1/bf16"), ("ufp4", "round1/ufp4"), ("ufp4", "round2/ufp4"),
                   ("bf16", "round2/bf16"), ("bf16", "round3/bf16"), ("ufp4", "round3/ufp4")]
    assert [r["step_ms_rounds"] for r in rows] == [[1.0, 4.0, 5.0], [2.0, 3.0, 6.0]]
    assert [r["step_ms"] for r in rows] == [4.0, 3.0]
    assert rows[1]["tok_per_s"] == rows[1]["tokens_per_iter"] / 3.0 * 1000
    assert rows[1]["speed_vs_first"] == 4.0 / 3.0
    table = open(tmp_path / "bench" / "bench.md").read()
    assert "| step ms by round |" in table and "| 2.0, 3.0, 6.0 |" in table


def test_mfu_follows_the_median_step_not_the_warm_up(tmp_path, monkeypatch):
    """A slow warm-up step (compilation, graph capture) is outside the timed window: MFU, like
    tokens/s, comes from the median timed step (train.py's own records average in the warm-up)."""
    import time
    import train
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    extra = [a for a in tiny_args(ds, "unused", max_iters=0)
             if a[2:].split("=")[0] not in bench.OWN_KEYS]
    config = tmp_path / "tiny.py"
    config.write_text("n_layer = 2\npeak_tflops = 1e-4\n")
    real = train.train_step

    def slow_first(run, lr):
        if run.iter_num == 1:
            time.sleep(1.0)
        return real(run, lr)
    monkeypatch.setattr(train, "train_step", slow_first)
    row, = bench.main([str(config), "--recipes=bf16", "--warmup=3", "--iters=4",
                       f"--out={tmp_path / 'bench'}"] + extra)
    last = [r for r in map(json.loads, open(tmp_path / "bench" / "bf16" / "log.jsonl"))
            if r["type"] == "train"][-1]
    per_tok_s = last["mfu"] / last["tok_per_s"]   # FLOPs per token / peak, a constant
    assert row["mfu"] == pytest.approx(per_tok_s * row["tok_per_s"], rel=1e-9)


def test_bad_arguments_stop_before_any_run(tmp_path, capsys):
    """One line for each, before a recipe runs; a train.py key bench.py sets itself is refused
    (an --out_dir given through would be overwritten)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "ckpt.pt").write_bytes(b"a run")
    (tmp_path / "runs" / "ufp4").mkdir(parents=True)
    (tmp_path / "runs" / "ufp4" / "ckpt.pt").write_bytes(b"a run")
    config = tmp_path / "tiny.py"
    config.write_text("n_layer = 2\n")
    second = tmp_path / "tiny2.py"   # a second config file that names its own run folder
    second.write_text(f"n_embd = 48\nout_dir = {str(victim)!r}\n")
    for args, msg in (([f"--out_dir={victim}"], "--out_dir: set by bench.py itself"),
                      (["--recipe=ufp4"], "--recipe: set by bench.py itself"),   # not --recipes
                      (["--recipes=fp5"], "unknown recipe 'fp5'"), (["--recipes="], "empty"),
                      (["--iters=0"], "--iters >= 1"), (["--warmup=-1"], "--warmup must be >= 0"),
                      (["--rounds=0"], "--rounds must be >= 1"),
                      (["--recipes=bf16,ufp4+recipe_format=foo"], "unknown format 'foo'"),
                      (["--recipes=bf16,ufp4,bf16"], r"names \['bf16'\] more than once"),
                      (["--recipes=bf16,mxfp4", "--n_embd=48", "--n_head=2"],
                       r"recipe 'mxfp4': the model does not fit recipe 'mxfp4'.*multiples of 32"),
                      ([f"--data_dir={tmp_path}", "--dataset=nope"], "unknown dataset 'nope'"),
                      ([f"--out={tmp_path / 'runs'}", "--recipes=bf16,ufp4"],
                       r"runs/ufp4 holds another run's ckpt.pt, which bench.py would delete"),
                      ([f"--recipes=bf16+out_dir={victim}"],
                       r"recipe 'bf16\+out_dir=.*: out_dir set by bench.py itself would change"),
                      (["--recipes=ufp4+max_iters=5+recipe=bf16"], "recipe, max_iters set by bench"),
                      ([str(second)], r"tiny2.py: out_dir set by bench.py itself would change")):
        with pytest.raises(SystemExit, match=msg):
            bench.main([str(config), f"--out={tmp_path / 'bench'}"] + args)
    assert (victim / "ckpt.pt").read_bytes() == b"a run" and not (tmp_path / "bench").exists()
    assert (tmp_path / "runs" / "ufp4" / "ckpt.pt").read_bytes() == b"a run"
