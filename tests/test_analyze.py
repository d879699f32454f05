"""analyze.py: the grid picture, and the tensor/depth analysis on a checkpoint of a tiny run."""
import json
import os

from train_helpers import keep_global_rng, make_char_dataset, tiny_args  # noqa: F401 (autouse)

import analyze  # noqa: E402
import fp4  # noqa: E402
import train  # noqa: E402


def test_grid_picture(tmp_path):
    path = str(tmp_path / "grids.png")
    analyze.draw_grids(path)
    assert os.path.getsize(path) > 10_000


def test_tensor_and_depth_analysis_of_a_checkpoint(tmp_path):
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    out = str(tmp_path / "run")
    train.main(tiny_args(ds, out, max_iters=4, eval_interval=4, n_embd=32, block_size=32))
    prefix = str(tmp_path / "an" / "shrink")
    analyze.analyze_checkpoint(os.path.join(out, "ckpt.pt"), prefix)
    table = open(prefix + "_tensors.md").read()
    for operand in ("attn.qkv.x", "mlp.fc2.x", "mlp.fc1.W", "attn.proj.dy"):
        assert f"| {operand} | ufp4 | yes |" in table
    rows = [json.loads(l) for l in open(prefix + "_tensors.jsonl")]
    assert all(0.5 < r["alpha"] < 1.5 and r["sqnr_db"] > 5 for r in rows)
    depth = json.load(open(prefix + "_depth.json"))
    assert set(depth) == {"e2m1", "ufp4", "nvfp4", "mxfp4"}
    assert len(depth["ufp4"]["rms_ratio"]) == 2 and os.path.exists(prefix + "_depth.png")
    # e2m1 shrinks: its per-GEMM attenuation is below int4's in every block; no compounded chain
    assert all(e < u for e, u in zip(depth["e2m1"]["gemm_attenuation"], depth["ufp4"]["gemm_attenuation"]))
    assert "alpha_chain" not in depth["e2m1"]
    assert fp4.RECIPES["ufp4"].quantized
