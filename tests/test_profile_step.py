"""scripts/profile_step.py's command line: a bad config or recipe, or no GPU, is one line (the
profile itself runs on the GPU only)."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import profile_step  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "gpt_ufp4.py")


def test_bad_input_or_no_gpu_is_one_line(main=profile_step.main):
    with pytest.raises(SystemExit, match="error: .*unknown recipe 'fp5'"):
        main([CONFIG, "--recipes=bf16,fp5"])
    with pytest.raises(SystemExit, match="error: .*no_such_config.py"):
        main([os.path.join(ROOT, "configs", "no_such_config.py")])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU; none is visible"):
            main([CONFIG, "--recipes=bf16"])
