# The CPU-sized MoE shared by configs/moe_<recipe>.py (each of those only sets `recipe`).
# 4 layers, d=128, 8 fine-grained experts (top-2), context 128, on character-level Shakespeare.
# Sized so that `python train.py configs/moe_ufp4.py` (fp4's torch reference path) finishes in
# minutes on a CPU. Measured 2026-11-30, 2 idle cores, torch 2.13 CPU: 6m42s wall (data prepared
# beforehand; preparing shakespeare_char adds ~4 s), final val loss 1.86 nats (the unigram entropy
# of the data is 3.33). Other CPU-heavy processes on the same 2 cores slow it a lot (OpenMP threads
# spin): 11 minutes with a test suite running beside it; run parallel jobs with OMP_NUM_THREADS=1.
out_dir = "out/moe_small_{recipe}"
dataset = "shakespeare_char"
batch_size = 16
block_size = 128
gradient_accumulation_steps = 1
n_layer = 4
n_head = 4
n_embd = 128
n_expert = 8
top_k = 2
router = "softmax"
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
