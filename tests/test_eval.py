"""eval.py on the CPU: a full windowed pass over a text file or a split of a tiny checkpoint."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from train_helpers import (ROOT, keep_global_rng, make_char_dataset,  # noqa: F401 (autouse)
                           tiny_args)

import train  # noqa: E402  (train_helpers puts the repo root on sys.path)

import eval as eval_script  # noqa: E402  (the repo's eval.py)
from checkpoint import build_model, load_checkpoint, make_recipe_from  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A char model trained 30 iterations under ufp4 (block_size 32), and its dataset."""
    tmp = tmp_path_factory.mktemp("eval")
    ds = make_char_dataset(str(tmp / "data" / "tiny"), n_val=1000)
    out = str(tmp / "out")
    train.main(tiny_args(ds, out, recipe="ufp4", max_iters=30, eval_interval=30, plot=False))
    return ds, out


def val_text(ds):
    import json
    itos = json.load(open(os.path.join(ds, "meta.json")))["itos"]
    ids = np.fromfile(os.path.join(ds, "val.bin"), dtype=np.uint16)
    return "".join(itos[i] for i in ids)


def cli(*args):
    return [f"--{k}" for k in args] + ["--device=cpu", "--backend=torch"]


def test_one_window_is_the_models_own_loss(run, tmp_path):
    """block_size + 1 tokens: one window, whose mean loss is the model's forward loss on it."""
    ds, out = run
    text = val_text(ds)[:33]
    (tmp_path / "t.txt").write_text(text)
    got = eval_script.main(cli(f"out_dir={out}", f"text_file={tmp_path / 't.txt'}"))
    ckpt, path = load_checkpoint(os.path.join(out, "ckpt.pt"))
    model = build_model(ckpt, make_recipe_from(ckpt["config"]), path).eval()
    ids = torch.tensor([ckpt["meta"]["stoi"][ch] for ch in text])[None]
    with torch.no_grad():
        _, want = model(ids[:, :-1], ids[:, 1:])
    assert got["tokens"] == 32 and got["recipe"] == "ufp4"
    assert abs(got["loss"] - want.item()) < 1e-6
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))
    # ASCII text with a char tokenizer: one byte per token, so bits per byte = loss / ln 2
    assert got["bits_per_byte"] == pytest.approx(got["loss"] / math.log(2))


def test_a_text_file_and_the_split_it_holds_agree(run, tmp_path, capsys):
    ds, out = run
    (tmp_path / "val.txt").write_text(val_text(ds))
    split = eval_script.main(cli(f"out_dir={out}", "split=val"))
    text = eval_script.main(cli(f"ckpt_path={out}/ckpt.pt", f"text_file={tmp_path / 'val.txt'}",
                                "batch_size=3"))
    err = capsys.readouterr().err
    assert "non-overlapping windows of 32 tokens" in err and "1,000 tokens in 32" in err
    assert split["tokens"] == text["tokens"] == 999   # every token but the first, once
    assert split["loss"] == pytest.approx(text["loss"], rel=1e-6)   # batching aside, the same
    assert split["bits_per_byte"] == pytest.approx(text["bits_per_byte"], rel=1e-6)
    # the training's last eval (random windows of the same split) is near the full pass
    last_val = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["val_loss"]
    assert abs(split["loss"] - last_val) < 0.3


def test_recipe_bf16_measures_the_unquantized_forward(run, capsys):
    ds, out = run
    quant = eval_script.main(cli(f"out_dir={out}"))
    plain = eval_script.main(cli(f"out_dir={out}", "recipe=bf16"))
    assert plain["recipe"] == "bf16" and quant["recipe"] == "ufp4"
    assert plain["loss"] != quant["loss"] and abs(plain["loss"] - quant["loss"]) < 0.2
    assert "trained with ufp4" in capsys.readouterr().err


def test_unknown_character_is_one_line_naming_it(run, tmp_path):
    ds, out = run
    (tmp_path / "bad.txt").write_text("the king\nmy lörd\n")
    p = subprocess.run([sys.executable, "eval.py"] + cli(f"out_dir={out}",
                                                         f"text_file={tmp_path / 'bad.txt'}"),
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ")
    assert "'ö' (U+00F6) at line 2, column 5" in p.stderr
    for extra, msg in (("split=val", "--text_file or --split"), (f"data_dir={tmp_path}", "--text_file or --data_dir")):
        with pytest.raises(eval_script.ConfigError, match=f"{msg}, not both"):
            eval_script.main(cli(f"out_dir={out}", extra, f"text_file={tmp_path / 'bad.txt'}"))
    with pytest.raises(eval_script.ConfigError, match="--ckpt_path or --out_dir, not both"):
        eval_script.main(cli(f"out_dir={tmp_path}", f"ckpt_path={out}/ckpt.pt"))


def test_help_lists_the_keys():
    p = subprocess.run([sys.executable, "eval.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True)
    assert p.returncode == 0 and "--text_file=''" in p.stdout and "--split='val'" in p.stdout


@pytest.mark.parametrize("damage, msg", [("cut", r"val.bin has 1,001 bytes, not the"),
                                         ("foreign id", r"val.bin holds token id 60000, but meta.json")])
def test_a_damaged_split_is_refused_as_train_refuses_it(run, tmp_path, damage, msg):
    ds, out = run
    import shutil
    bad = tmp_path / "data" / "tiny"
    shutil.copytree(ds, bad)
    ids = np.fromfile(bad / "val.bin", dtype=np.uint16)
    if damage == "cut":
        (bad / "val.bin").write_bytes(ids.tobytes()[:1001])
    else:
        ids[7] = 60000
        ids.tofile(bad / "val.bin")
    with pytest.raises(train.ConfigError, match=msg):
        eval_script.main(cli(f"out_dir={out}", f"data_dir={tmp_path / 'data'}"))


def test_bytes_of_a_text_file_follow_one_rule_whether_cut_or_not(tmp_path):
    """GPT-2's end-of-text separator counts 0 bytes in a text file as in a split, so cutting a file
    by one token takes off that token's bytes only."""
    from data.common import GPT2_EOT, get_gpt2_encoding
    meta = dict(tokenizer="gpt2", vocab_size=50257, eot_token=GPT2_EOT)
    path = tmp_path / "two.txt"
    path.write_text("Hello world.<|endoftext|>Another text here.")
    ids, n_bytes = eval_script.text_tokens(str(path), meta)
    assert GPT2_EOT in ids.tolist()
    first = len(get_gpt2_encoding().decode_single_token_bytes(int(ids[0])))
    assert n_bytes == len("Hello world.Another text here.") - first
    cut, cut_bytes = eval_script.text_tokens(str(path), meta, max_tokens=len(ids) - 1)
    assert n_bytes - cut_bytes == len(get_gpt2_encoding().decode_single_token_bytes(int(ids[-1])))
