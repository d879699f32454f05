"""sample.py on a checkpoint saved by a tiny train.py run."""
import subprocess
import sys

import pytest

from train_helpers import MOE, ROOT, keep_global_rng, make_char_dataset, tiny_args  # noqa: F401

import sample  # noqa: E402
import train  # noqa: E402

@pytest.fixture(scope="module")
def out(tmp_path_factory):
    ds = make_char_dataset(str(tmp_path_factory.mktemp("data") / "tiny"))
    out = tmp_path_factory.mktemp("run")
    train.main(tiny_args(ds, str(out), recipe="ufp4", recipe_rht="wgrad", max_iters=30,
                         eval_interval=30, **MOE))
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
    assert a == b

def test_sample_errors(out, tmp_path):
    with pytest.raises(ValueError, match=r"characters \['Z'\] are not in the dataset's vocabulary"):
        sample.main([f"--out_dir={out}", "--start=Zebra"])
    with pytest.raises(train.ConfigError, match="unknown config key 'temprature'.*temperature"):
        sample.main([f"--out_dir={out}", "--temprature=0.5"])
    with pytest.raises(train.CheckpointError, match="no checkpoint at"):
        sample.main([f"--out_dir={tmp_path}"])
    p = subprocess.run([sys.executable, "sample.py", f"--out_dir={tmp_path}"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.startswith("error: no checkpoint at")

def test_train_and_sample_do_not_import_each_other():
    code = ("import sys, sample; assert 'train' not in sys.modules; "
            "del sys.modules['sample']; import train; assert 'sample' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
