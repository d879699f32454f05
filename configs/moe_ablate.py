# The base config of `python ablate.py configs/moe_ablate.py ...`: configs/_moe_small.py (ablate.py
# sets out_dir, seed and each arm's recipe overrides). For GPU-sized sweeps use configs/gpu/_moe_gpt2_small.py.
from configs._moe_small import *  # noqa: F401,F403

recipe = "bf16"
final_sample_tokens = 0
