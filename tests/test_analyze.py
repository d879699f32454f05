"""analyze.py: the grid picture, the tensor/depth analysis and the mechanism measurements on a
checkpoint of a tiny run, and the estimators behind them on synthetic data."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from train_helpers import MOE, ROOT, keep_global_rng, make_char_dataset, tiny_args  # noqa: F401 (autouse)

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
    assert rows and all(0.5 < r["alpha"] < 1.5 and r["sqnr_db"] > 5 for r in rows)
    depth = json.load(open(prefix + "_depth.json"))
    assert set(depth) == {"e2m1", "ufp4", "nvfp4", "mxfp4"}
    assert len(depth["ufp4"]["rms_ratio"]) == 2 and os.path.exists(prefix + "_depth.png")
    # e2m1 shrinks: its per-GEMM attenuation is below int4's in every block; no compounded chain
    assert all(e < u for e, u in zip(depth["e2m1"]["gemm_attenuation"], depth["ufp4"]["gemm_attenuation"]))
    assert "alpha_chain" not in depth["e2m1"]
    assert fp4.RECIPES["ufp4"].quantized
    moe = str(tmp_path / "moe")   # its experts are GroupedLinear, which the hooks do not take
    train.main(tiny_args(ds, moe, max_iters=1, eval_interval=1, n_embd=32, block_size=32, **MOE))
    with pytest.raises(SystemExit, match="is a MoE .*: use `analyze.py mechanism`"):
        analyze.analyze_checkpoint(os.path.join(moe, "ckpt.pt"), str(tmp_path / "an" / "moe"))


def test_mechanism_of_a_checkpoint(tmp_path):
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    out = str(tmp_path / "run")
    train.main(tiny_args(ds, out, max_iters=4, eval_interval=4, n_embd=32, block_size=32))
    # through the CLI, in its own process: torch's CPU worker threads keep the denormal flag of
    # the thread that created them, and earlier tests in this process created them without it
    subprocess.run([sys.executable, "analyze.py", "mechanism", f"--ckpt={os.path.join(out, 'ckpt.pt')}",
                    "--batches=2", "--draws=2", f"--out={tmp_path / 'm'}", "--device=cpu"],
                   cwd=ROOT, check=True, capture_output=True)
    prefix = str(tmp_path / "m" / analyze.ckpt_label(os.path.join(out, "ckpt.pt")))
    assert prefix.endswith(os.path.basename(str(tmp_path)) + "_run")
    r = json.load(open(prefix + "_mechanism.json"))
    labels = ("e2m1", "e2m1+RHT", "ufp4", "ufp4+RHT")
    assert len(r["layers"]) == 8 and r["iter"] == 4    # 2 blocks x qkv, proj, fc1, fc2
    for c in labels:
        for t in ("all", *r["layers"]):
            m, se = r["forward_penalty"][f"{c}|{t}"]
            assert abs(m) < 0.1 and se >= 0
        for t in r["layers"]:
            g = r["gradient"][f"{c}|{t}"]
            assert 0.8 < g["alpha_g"][0] < 1.2 and 0.9 < g["cosine"][0] <= 1 and g["var_ratio"][0] > 0
            assert 0.9 < r["operands"][f"{c}|{t}|x"]["alpha"][0] < 1.1
    # quantizing every Fprop costs more than quantizing one layer's, on average
    assert r["forward_penalty"]["e2m1|all"][0] > sum(r["forward_penalty"][f"e2m1|{t}"][0] for t in r["layers"]) / 8 - 0.01
    md = open(prefix + "_mechanism.md").read()
    assert "| all |" in md and "## What shows" in md and "paper 21.90" in md
    assert r["draws"] == 2 and r["batches"] == 2
    # summary.md: one row per checkpoint in --out, rebuilt from the json (a later one joins it)
    rows = [line for line in open(tmp_path / "m" / "summary.md") if line.startswith(f"| {os.path.basename(prefix)} |")]
    assert len(rows) == 6 and all("| 4 | bf16 |" in line for line in rows)
    alpha_x = [line for line in rows if "±" in line][1]   # the second table: Fprop alpha of x
    assert f"{analyze._layer_mean(r, 'operands', 'alpha', 'e2m1', 'x'):.4f} ±" in alpha_x
    later = dict(r, iter=8, recipe="ufp4")
    json.dump(later, open(tmp_path / "m" / "later_mechanism.json", "w"))
    analyze.main(["mechanism_summary", f"--out={tmp_path / 'm'}"])
    text = open(tmp_path / "m" / "summary.md").read()
    assert "(2 checkpoints" in text and text.index("| 4 | bf16 |") < text.index("| later | 8 | ufp4 |")
    with pytest.raises(SystemExit, match="no .*_mechanism.json"):
        analyze.mechanism_summary(str(tmp_path))


def test_level_bias_matches_the_analytic_bias_on_uniform_data():
    torch.manual_seed(0)
    for fmt, grid in (("e2m1", "e2m1"), ("ufp4", "int4")):
        x = torch.rand(4096, 64) * 2 - 1
        x[:, ::16] = 1.0              # every block's amax is 1: t = |x| * qmax is uniform on [0, qmax]
        q = fp4.quantize(x, fmt, dim=-1)
        sums, counts = analyze.level_bias(q, x)
        levels = fp4.GRIDS[grid].levels
        assert sum(counts) == x.numel()
        for level, want in fp4.bin_bias(grid).items():
            i = levels.index(level)
            assert abs(sums[i] / counts[i] - want) < 0.01, (fmt, level, sums[i] / counts[i], want)


def test_draw_stats_recovers_a_known_bias_and_variance():
    torch.manual_seed(0)
    exact = torch.randn(20000, dtype=torch.float64)
    draws = [0.9 * exact + 0.5 * torch.randn(20000, dtype=torch.float64) for _ in range(16)]
    s = analyze.draw_stats(exact, sum(draws), sum(d.pow(2).sum().item() for d in draws), 16)
    gg = exact.pow(2).sum().item() / 20000
    assert abs(s["alpha_g"] - 0.9) < 0.005
    assert abs(s["bias2_rel"] - 0.01) < 0.002          # |0.1 g|^2 / |g|^2, the draw noise removed
    assert abs(s["var_ratio"] - 0.25 / gg) < 0.02 and s["cosine"] > 0.99


def test_committed_mechanism_summary_rebuilds_from_its_json(tmp_path):
    """results/ablation/mechanism_gpt/summary.md is what `analyze.py mechanism_summary` makes of
    the committed per-checkpoint JSON files."""
    committed = os.path.join(ROOT, "results", "ablation", "mechanism_gpt")
    for path in glob.glob(os.path.join(committed, "*_mechanism.json")):
        shutil.copy(path, tmp_path)
    analyze.mechanism_summary(str(tmp_path))
    assert open(tmp_path / "summary.md").read() == open(os.path.join(committed, "summary.md")).read()


def test_a_missing_or_damaged_checkpoint_is_one_line(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    for cmd, path, msg in (("tensors", tmp_path / "none" / "ckpt.pt", "no checkpoint at"),
                           ("mechanism", tmp_path / "ckpt.pt", "cannot read checkpoint")):
        with pytest.raises(SystemExit, match=f"error: {msg}"):
            analyze.main([cmd, "--ckpt", str(path), "--out", str(tmp_path / "out"), "--device", "cpu"])


def test_mechanism_refuses_one_batch_and_checkpoints_of_one_name(tmp_path, capsys):
    """One batch has no SE (every layer would count as beyond 2 SE); two checkpoints whose last
    two folders match would write one file."""
    a, b = (str(tmp_path / x / "bases" / "bf16_s0_at10" / "ckpt.pt") for x in ("gpt", "moe"))
    for args, msg in ((["--ckpt", a, "--batches=1"], "--batches must be at least 2"),
                      (["--ckpt", a, "--ckpt", b], "get the same name 'bases_bf16_s0_at10'")):
        with pytest.raises(SystemExit):
            analyze.main(["mechanism", *args, "--out", str(tmp_path / "out"), "--device", "cpu"])
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_device_or_dataset_not_here_is_one_line(tmp_path):
    """A good checkpoint with --device=cuda on a machine without one, or whose dataset is gone:
    one line that says so, not 'corrupt' or a traceback."""
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    out = str(tmp_path / "run")
    train.main(tiny_args(ds, out, max_iters=1, eval_interval=1, n_embd=32, block_size=32))
    ckpt = ["--ckpt", os.path.join(out, "ckpt.pt"), "--out", str(tmp_path / "an")]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="error: device='cuda', but this machine has no CUDA GPU"):
            analyze.main(["tensors", *ckpt, "--device", "cuda"])
    shutil.rmtree(ds)
    for cmd in ("tensors", "mechanism"):
        with pytest.raises(SystemExit, match="error: the checkpoint's dataset 'tiny' is not at .*tiny "
                                             ".*: run analyze.py from the folder the run was trained in"):
            analyze.main([cmd, *ckpt, "--device", "cpu"])


def test_layer_means_and_rht_shifts_take_their_se_over_batches():
    """Every layer sees the same batches: a batch effect shared by all layers stays in the SE of a
    mean over layers (the per-layer SEs as if independent would be sqrt(4) = 2x too small here),
    and a shift by RHT that every batch shows is found however much the batches differ."""
    layers, shared = ["b0.fc", "b1.fc", "b2.fc", "b3.fc"], [0.004, -0.004, 0.002, -0.002]
    r = dict(layers=layers, operands={}, operands_batches={})
    for cfg, shift in (("e2m1", 0.0), ("e2m1+RHT", 0.001)):
        for t in layers:
            vals = [0.99 + shift + b for b in shared]
            key = f"{cfg}|{t}|x"
            r["operands_batches"][key] = dict(alpha=vals)
            r["operands"][key] = dict(alpha=list(analyze.mean_se(vals)))
    mean, se = analyze._layers_pm(r, "operands", "alpha", "e2m1", "x")
    assert mean == pytest.approx(0.99) and se == pytest.approx(analyze.mean_se(shared)[1])
    assert analyze.rht_alpha_shift(r, "e2m1") == (0, 4)
    old = dict(r, operands_batches=None)   # a result written before per-batch values were kept
    assert analyze._layers_pm(old, "operands", "alpha", "e2m1", "x")[1] == pytest.approx(se / 2)
    assert analyze.rht_alpha_shift(old, "e2m1") == (0, 0)
