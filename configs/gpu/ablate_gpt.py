# The dense GPT of the recipe ablation on the GPU. Headline (forked design: bases to step 1000,
# every arm forked from each to step 1500):
#   nvidia-cuda-mps-control -d   # the runs of one GPU then run concurrently instead of time-slicing
#   python ablate.py fork configs/gpu/ablate_gpt.py --bases=0-7 --arms=headline --fork_at=1000 \
#       --eval_iters=100 --parallel=8 --gpus=0 --drop_fork_ckpts --out=out/fork_gpt
# (results and their commands: results/ablation/fork_gpt/)
# (`python ablate.py seeds configs/gpu/ablate_gpt.py ...` runs the older seed-per-arm design.)
# 8 layers x 384, SwiGLU, RMSNorm, RoPE, tied embeddings: 33.5M parameters (14.2M non-embedding),
# context 512, 16,384 tokens per step, 1500 steps = 24.6M tokens, 0.9 of `literature`'s 28M train
# tokens. Batches are windows at random offsets drawn with replacement, so this is not one pass over
# the data: about 42 % of the train tokens are never seen and about 22 % are seen more than once
# (Poisson with mean 0.87 per token). Eight runs of this model share one H200 (126,516 MiB at the
# peak, with MPS); twelve ran out of memory.
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
