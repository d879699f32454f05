# The CPU-sized base config of `python ablate.py fork|seeds configs/gpt_ablate.py ...`: configs/_gpt_small.py
# (ablate.py sets out_dir, seed, the schedule and each arm's recipe overrides). The GPU-sized
# ablation is configs/gpu/ablate_gpt.py.
from configs._gpt_small import *  # noqa: F401,F403

recipe = "bf16"
final_sample_tokens = 0
