"""sample.py on a checkpoint saved by a tiny train.py run."""
import os
import subprocess
import sys

import pytest
import torch

from train_helpers import MOE, ROOT, keep_global_rng, make_char_dataset, tiny_args  # noqa: F401

import sample  # noqa: E402
import train  # noqa: E402

@pytest.fixture(scope="module")
def out(tmp_path_factory):
    ds = make_char_dataset(str(tmp_path_factory.mktemp("data") / "tiny"))
    out = tmp_path_factory.mktemp("run")
    train.main(tiny_args(ds, str(out), recipe="ufp4", recipe_rht="wgrad", max_iters=30,
                         eval_interval=15, **MOE))
    return out

def test_sample_decodes_with_the_checkpoint_tokenizer(out, tmp_path):
    texts = sample.main([f"--out_dir={out}", "--start=The king", "--num_samples=2",
                         "--max_new_tokens=40", "--top_k=5"])
    assert len(texts) == 2 and all(t.startswith("The king") and len(t) == 48 for t in texts)
    prompt = tmp_path / "p.txt"
    prompt.write_text("My lord")
    again = sample.main([f"--out_dir={out}", f"--start=FILE:{prompt}", "--num_samples=1",
                         "--max_new_tokens=10", "--recipe=bf16"])
    assert again[0].startswith("My lord") and len(again[0]) == 17

def test_sample_is_reproducible_with_a_seed(out):
    a = sample.main([f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=20", "--seed=3"])
    b = sample.main([f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=20", "--seed=3"])
    c = sample.main([f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=20", "--seed=4"])
    assert a == b and a != c   # the seed is used, not the default one

def test_sample_errors(out, tmp_path):
    with pytest.raises(ValueError, match=r"characters \['Z'\] are not in the dataset's vocabulary"):
        sample.main([f"--out_dir={out}", "--start=Zebra"])
    with pytest.raises(sample.ConfigError, match="unknown config key 'temprature'.*temperature"):
        sample.main([f"--out_dir={out}", "--temprature=0.5"])
    with pytest.raises(sample.CheckpointError, match="no checkpoint at"):
        sample.main([f"--out_dir={tmp_path}"])
    p = subprocess.run([sys.executable, "sample.py", f"--out_dir={tmp_path}"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.startswith("error: no checkpoint at")
    with pytest.raises(sample.ConfigError, match="--ckpt_path or --out_dir, not both"):
        sample.main([f"--out_dir={tmp_path}", f"--ckpt_path={out}/ckpt.pt"])


def test_sample_never_draws_a_padded_vocabulary_id(tmp_path):
    """vocab_size padded above the dataset's vocabulary (a nanoGPT habit): the padding ids have no
    character, so generate must not sample them (the char decoder raised IndexError)."""
    ds = make_char_dataset(str(tmp_path / "tiny"))
    train.main(tiny_args(ds, str(tmp_path / "run"), vocab_size=4096, max_iters=2, eval_interval=2))
    texts = sample.main([f"--out_dir={tmp_path / 'run'}", "--start=The", "--num_samples=2",
                         "--max_new_tokens=60", "--temperature=5"])  # flat: pads would be drawn
    assert all(len(t) == 63 for t in texts)

def test_train_and_sample_do_not_import_each_other():
    code = ("import sys, sample; assert 'train' not in sys.modules; "
            "del sys.modules['sample']; import train; assert 'sample' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)

@pytest.mark.parametrize("arg, msg", [
    ("--num_samples=0", r"num_samples=0 is out of range: it must be >= 1"),
    ("--temperature=0", r"temperature=0.0 is out of range: it must be > 0"),
    ("--temperature=-1", r"temperature=-1.0 is out of range"),
    ("--top_k=-5", r"top_k=-5 is out of range: it must be >= 0"),
    ("--start=FILE:", r"cannot read the prompt file '' of --start=FILE:path"),
    ("--start=", r"--start is empty: give a prompt of at least one character"),
    ("--start=FILE:/no/such/prompt.txt", r"prompt file '/no/such/prompt.txt' .*No such file"),
    ("--dtype=float16", r"'dtype' .* must be one of"),
])
def test_sample_bad_input_is_refused_before_loading(out, arg, msg):
    with pytest.raises(sample.ConfigError, match=msg):
        sample.main([f"--out_dir={out}", arg])

@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_sample_on_a_missing_gpu_says_so_not_corrupt(out):
    p = subprocess.run([sys.executable, "sample.py", f"--out_dir={out}", "--device=cuda"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.startswith("error: device='cuda', but this machine has "
                                                     "no CUDA GPU"), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1

def test_sample_corrupt_checkpoint_hint_names_ckpt_path(out, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(out, run)
    with open(run / "ckpt.pt", "r+b") as f:
        f.truncate(500)
    with pytest.raises(sample.CheckpointError, match=r"truncated or corrupt.*--ckpt_path=.*ckpt_prev.pt"):
        sample.main([f"--out_dir={run}", "--num_samples=1", "--max_new_tokens=2"])

def test_sample_labels_the_checkpoint_with_its_own_val_loss(out, capsys):
    sample.main([f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=2"])
    ck = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert f"val loss {ck['val_loss']:.4f} (best of its run {ck['best_val_loss']:.4f})" in \
        capsys.readouterr().err
