# nanoGPT's shakespeare_char "baby GPT" budget on the classic tinyshakespeare (1.1M characters,
# vocab 65; data/tinyshakespeare_char is downloaded from karpathy/char-rnn on first use and checked
# against its sha256; offline, add --dataset_input=path/to/input.txt): 6 layers, 6 heads, 384 wide,
# context 256, batch 64, 5000 iterations, lr 1e-3, dropout 0.2, GPT-2 architecture (GELU,
# LayerNorm, learned positions, tied embeddings).
# nanoGPT reports a val loss of about 1.47 after 5000 iterations: the bf16 acceptance run on a GPU.
# Any recipe: --recipe=ufp4 (384 is a multiple of 16 and of the RHT size).
out_dir = "out/shakespeare_char_gpt_{recipe}{variant}"
dataset = "tinyshakespeare_char"
dataset_tokenizer = "char"
recipe = "bf16"
n_layer = 6
n_head = 6
n_embd = 384
block_size = 256
batch_size = 64
gradient_accumulation_steps = 1
dropout = 0.2
bias = False
mlp = "gelu"
norm = "layernorm"
pos_emb = "learned"
tie_embeddings = True
learning_rate = 1e-3
min_lr = 1e-4
max_iters = 5000
lr_decay_iters = 5000
warmup_iters = 100
beta2 = 0.99
weight_decay = 0.1
eval_interval = 250
eval_iters = 200
log_interval = 10
always_save_checkpoint = False   # this small model overfits: keep the best val loss
final_sample_tokens = 500
