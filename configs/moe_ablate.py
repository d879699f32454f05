# The CPU-sized base config of `python ablate.py fork|seeds configs/moe_ablate.py ...`: configs/_moe_small.py
# (ablate.py sets out_dir, seed, the schedule and each arm's recipe overrides). The GPU-sized
# ablation is configs/gpu/ablate_moe.py.
from configs._moe_small import *  # noqa: F401,F403

recipe = "bf16"
final_sample_tokens = 0
