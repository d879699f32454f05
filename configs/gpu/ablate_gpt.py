# The dense GPT of the GPU recipe ablation (issue 7): `python ablate.py configs/gpu/ablate_gpt.py
# --arms=paper_gpt --seeds=0,1 --parallel=12 --gpus=0,1` (scripts/gpu_ablate.sh runs the sweep).
# 8 layers x 384, SwiGLU, RMSNorm, RoPE, tied embeddings: 33.6M parameters (14.2M non-embedding),
# context 512, 16,384 tokens per step, 1500 steps = 24.6M tokens (0.9 epoch of `literature`, so no
# token is seen twice). Sized so that all 11 runs of the sweep train side by side on two H200s in
# a few minutes; each run alone would leave most of a GPU idle.
out_dir = "out/ablate_gpt_{recipe}"
dataset = "literature"
vocab_size = 50304
block_size = 512
batch_size = 32
gradient_accumulation_steps = 1
n_layer = 8
n_head = 6
n_embd = 384
mlp = "swiglu"
tie_embeddings = True
n_expert = 0
dropout = 0.0
learning_rate = 1.5e-3
min_lr = 1.5e-4
warmup_iters = 100
max_iters = 1500
lr_schedule = "cosine"
weight_decay = 0.1
beta2 = 0.95
eval_interval = 250
eval_iters = 20
log_interval = 10
telemetry_interval = 100
always_save_checkpoint = False   # checkpoint only on a new best val loss: less disk traffic
compile = False
final_sample_tokens = 0
recipe = "bf16"
