# The MoE of the recipe ablation on the GPU (`python ablate.py fork configs/gpu/ablate_moe.py ...`,
# as configs/gpu/ablate_gpt.py says): that dense model with each MLP split into 8 experts of hidden
# 512 and top-2 routing, so the active size per token equals the dense model's (14.2M active
# non-embedding parameters, 42.5M non-embedding in all, 61.8M with embeddings).
from configs.gpu.ablate_gpt import *  # noqa: F401,F403

out_dir = "out/ablate_moe_{recipe}"
n_expert = 8
top_k = 2
expert_hidden = 512
router = "softmax"
aux_loss_weight = 0.01
z_loss_weight = 0.001
