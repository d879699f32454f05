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


def test_bad_arguments_stop_before_any_run(tmp_path, capsys):
    """One line for each, before a recipe runs; a train.py key bench.py sets itself is refused
    (an --out_dir given through would be overwritten)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "ckpt.pt").write_bytes(b"a run")
    config = tmp_path / "tiny.py"
    config.write_text("n_layer = 2\n")
    for args, msg in (([f"--out_dir={victim}"], "--out_dir: set by bench.py itself"),
                      (["--recipes=fp5"], "unknown recipe 'fp5'"), (["--recipes="], "empty"),
                      (["--iters=0"], "--iters >= 1"), (["--warmup=-1"], "--warmup must be >= 0"),
                      (["--recipes=bf16,ufp4+recipe_format=foo"], "unknown format 'foo'")):
        with pytest.raises(SystemExit, match=msg):
            bench.main([str(config), f"--out={tmp_path / 'bench'}"] + args)
    assert (victim / "ckpt.pt").read_bytes() == b"a run" and not (tmp_path / "bench").exists()
