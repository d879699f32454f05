"""bench.py on the CPU: tiny recipes' runs, twice into the same --out."""
import json
import os

from train_helpers import keep_global_rng, make_char_dataset, tiny_args  # noqa: F401 (autouse)

import bench  # noqa: E402  (train_helpers puts the repo root on sys.path)


def test_bench_twice_into_one_out(tmp_path):
    """train.py refuses a scratch run into a folder holding a run: bench.py replaces its own."""
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    extra = [a for a in tiny_args(ds, "unused", max_iters=0)
             if not a.startswith(("--out_dir=", "--max_iters=", "--eval_interval="))]
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
