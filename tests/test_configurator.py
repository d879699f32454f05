"""configurator.py: config files, --key=value, their errors, and --help from the defaults block."""
import subprocess
import sys

import pytest

from train_helpers import ROOT  # noqa: F401  (puts the repo root on sys.path)

import configurator  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402
from configurator import ConfigError  # noqa: E402


def test_config_file_with_a_syntax_error_is_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("batch_size = 4\nn_layer = = 3\n")
    with pytest.raises(ConfigError, match=r"config file .*bad.py, line 2: invalid syntax"):
        train.get_config([str(bad)])
    boom = tmp_path / "boom.py"
    boom.write_text("n_layer = undefined_name\n")
    with pytest.raises(ConfigError, match=r"boom.py fails when run: NameError"):
        train.get_config([str(boom)])


def test_parse_reports_the_keys_given():
    cfg, given = configurator.parse(["--b=2"], dict(a=1, b=1))
    assert cfg == dict(a=1, b=2) and given == {"b"}


@pytest.mark.parametrize("script, module", [("train.py", train), ("sample.py", sample)])
def test_help_lists_every_key_with_default_type_and_meaning(script, module):
    p = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    lines = {line.split("=")[0].strip(): line for line in p.stdout.splitlines()
             if line.startswith("  --")}
    assert set(lines) == {f"--{k}" for k in module.DEFAULTS}
    for key, line in lines.items():
        meaning = line.split(")", 1)[1].strip()
        assert meaning and "(" in line, line   # a type and a meaning on every line
    assert "--learning_rate=0.0006  (float) peak learning rate" in p.stdout or script == "sample.py"
    if script == "train.py":   # the block's comment lines read as section titles
        assert "\n\nI/O\n  --out_dir=" in p.stdout and "\nsystem\n  --device=" in p.stdout
        assert "default config values" not in p.stdout


def test_text_keys_take_text_as_written(tmp_path):
    """true, false, None and numbers are text where a key holds text (None only where the key
    may be None); a bool key's value is still a bool."""
    c = train.get_config(["--dataset=true", "--wandb_log=True", "--wandb_run_name=False",
                          "--out_dir=2024"])
    assert (c["dataset"], c["wandb_run_name"], c["out_dir"]) == ("true", "False", "2024")
    cfg, _ = configurator.parse(["--start=None", "--name=True"], dict(start="\n", name="x"))
    assert cfg == dict(start="None", name="True")
    cfg, _ = configurator.parse(["--fmt=None", "--flag=false"], dict(fmt=None, flag=True), dict(fmt=str))
    assert cfg == dict(fmt=None, flag=False)


def test_config_file_with_a_bom_or_a_coding_line_runs_as_python_runs_it(tmp_path):
    bom = tmp_path / "bom.py"
    bom.write_bytes(b"\xef\xbb\xbfbatch_size = 7\n")
    latin = tmp_path / "latin.py"
    latin.write_bytes(b"# -*- coding: latin-1 -*-\nwandb_run_name = 'caf\xe9'\n")
    c = train.get_config([str(bom), str(latin), "--wandb_log=True"])
    assert c["batch_size"] == 7 and c["wandb_run_name"] == "caf\u00e9"


def test_config_file_imports_from_its_own_folder_as_python_runs_it(tmp_path):
    """`from base import *` beside the config, as `python child.py` would find it; a second
    folder's base.py is its own, not the first one's cached."""
    for folder, size in (("one", 3), ("two", 5)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "base.py").write_text(f"batch_size = {size}\nn_layer = 2\n")
        (tmp_path / folder / "child.py").write_text("from base import *  # noqa\nn_layer = 3\n")
        c = train.get_config([str(tmp_path / folder / "child.py")])
        assert (c["batch_size"], c["n_layer"]) == (size, 3)
    assert str(tmp_path / "one") not in sys.path and "base" not in sys.modules


def test_odd_command_line_values_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"learning_rate.*is too large for a float"):
        train.get_config(["--learning_rate=1" + "0" * 400])
    with pytest.raises(ConfigError, match=r"unknown config key 'complie' .*did you mean compile"):
        train.get_config(["--complie"])
    assert train.get_config(["--recipe=mxfp4", "--recipe_fp8_gemm"])["recipe_fp8_gemm"] is True   # may be None
    with pytest.raises(ConfigError, match=r"dataset='' must be a plain name"):
        train.get_config(["--dataset="])
