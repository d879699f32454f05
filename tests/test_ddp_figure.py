"""dev/ddp_figure.py: the DDP scaling figure from gpu_ddp_scaling.sh's JSON."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev"))
import ddp_figure  # noqa: E402


def _run(recipe, gpus=2, tok=400e3, scaling=1.9):
    return dict(recipe=recipe, gpus=gpus, tok_per_s_1=tok, tok_per_s_n=tok * scaling, scaling=scaling,
                losses_1=[10.0, 8.0, 7.0], losses_n=[10.0, 8.1, 6.9], gpu="test GPU")


def test_figure_from_the_scaling_json(tmp_path):
    files = []
    for r in ("ufp4", "bf16"):
        files.append(str(tmp_path / f"ddp_{r}.json"))
        json.dump(_run(r), open(files[-1], "w"))
    out = tmp_path / "fig.png"
    ddp_figure.main(files + ["--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_runs_on_different_gpu_counts_or_compile_modes_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="different GPU counts"):
        ddp_figure.figure([_run("bf16", gpus=2), _run("ufp4", gpus=4)], str(tmp_path / "f.png"))
    with pytest.raises(SystemExit, match="different compile settings"):
        ddp_figure.figure([dict(_run("bf16"), compile_mode="default"),
                           dict(_run("bf16"), compile_mode="reduce-overhead")], str(tmp_path / "f.png"))
