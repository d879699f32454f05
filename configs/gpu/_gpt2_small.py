# GPT-2-small-sized dense model (12 x 768, GELU MLP, LayerNorm, learned positions, tied
# embeddings: 85M non-embedding parameters) on `literature` (GPT-2 BPE, 28M train tokens).
# For one H200, or `torchrun --standalone --nproc_per_node=N train.py ...` with N in 1, 2, 4, 8:
# gradient_accumulation_steps is global (divided among processes), so tokens/iter stay 131,072.
# Each configs/gpu/gpt2_small_<recipe>.py only sets `recipe` (the `_fp8` ones add FP8 GEMM options).
out_dir = "out/gpt2_small_{recipe}{variant}"
dataset = "literature"
vocab_size = 50304           # GPT-2's 50257 padded to a multiple of 64
block_size = 1024
batch_size = 16
gradient_accumulation_steps = 8
n_layer = 12
n_head = 12
n_embd = 768
mlp = "gelu"
norm = "layernorm"
pos_emb = "learned"
tie_embeddings = True
dropout = 0.0
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 100
max_iters = 1000             # 131M tokens (about 4.6 epochs of `literature`): for paired comparisons
weight_decay = 0.1
beta2 = 0.95
eval_interval = 100
eval_iters = 40
log_interval = 10
compile = True
compile_mode = "reduce-overhead"  # CUDA graphs: the FP4 layers' many small launches cost no host time
                                  # (under torchrun too; telemetry needs 'default')
