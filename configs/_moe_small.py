# The CPU-sized MoE shared by configs/moe_<recipe>.py (each of those only sets `recipe`): the dense
# configs/_gpt_small.py with its MLPs split into experts, on the same budget.
# 4 layers, d=128, 8 fine-grained experts (top-2), context 128, on character-level Shakespeare.
# Sized so that `python train.py configs/moe_ufp4.py` (fp4's torch reference path) finishes in
# minutes on a CPU. Measured 2026-11-30, 2 idle cores, torch 2.13 CPU: 6m42s wall (data prepared
# beforehand; preparing shakespeare_char adds ~4 s), final val loss 1.86 nats (the unigram entropy
# of the data is 3.33). Other CPU-heavy processes on the same 2 cores slow it a lot (OpenMP threads
# spin): 11 minutes with a test suite running beside it; run parallel jobs with OMP_NUM_THREADS=1.
from configs._gpt_small import *  # noqa: F401,F403

out_dir = "out/moe_small_{recipe}{variant}"
n_expert = 8
top_k = 2
router = "softmax"
