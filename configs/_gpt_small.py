# The CPU-sized dense GPT shared by configs/gpt_<recipe>.py (each of those only sets `recipe`).
# 4 layers, d=128, SwiGLU MLP (the MoE's active size), context 128, on character-level Shakespeare.
# The same budget as configs/_moe_small.py (the MoE flagship), for dense-vs-MoE comparisons.
out_dir = "out/gpt_small_{recipe}{variant}"
dataset = "shakespeare_char"
batch_size = 16
block_size = 128
gradient_accumulation_steps = 1
n_layer = 4
n_head = 4
n_embd = 128
n_expert = 0
dropout = 0.0
learning_rate = 3e-3
min_lr = 3e-4
max_iters = 450
warmup_iters = 30
lr_schedule = "cosine"
weight_decay = 0.1
beta2 = 0.99
eval_interval = 150
eval_iters = 20
log_interval = 10
final_sample_tokens = 200      # sampling with the fp4 reference costs ~0.3 s a token on a CPU
