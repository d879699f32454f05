# An MoE with the active size of configs/gpu/_gpt2_small.py: the same model, with each MLP split
# into 8 experts of hidden 1536 and top-2 routing (2 x 1536 = the dense 3072 per token).
from configs.gpu._gpt2_small import *  # noqa: F401,F403

out_dir = "out/moe_gpt2_small_{recipe}{variant}"
n_expert = 8
top_k = 2
expert_hidden = 1536
router = "softmax"
aux_loss_weight = 0.01
z_loss_weight = 0.001
