# A wider dense model where the GEMMs dominate the step (24 x 2048: 1.2B non-embedding parameters),
# to see how the FP4 and FP8-GEMM recipes' speed grows with width against bf16's:
#   python bench.py configs/gpu/wide_gpt_bf16.py --recipes=bf16,mxfp4+recipe_fp8_gemm=True,ufp4 --warmup=3 --iters=6
# Same architecture as configs/gpu/_gpt2_small.py otherwise; 131k tokens per step in 16 micro-steps
# of 8 x 1024. Fits one H200 (fp32 master weights and AdamW state: about 20 GB).
from configs.gpu._gpt2_small import *  # noqa: F401,F403

out_dir = "out/wide_gpt_{recipe}{variant}"
n_layer = 24
n_head = 16
n_embd = 2048
batch_size = 8
gradient_accumulation_steps = 16

recipe = "bf16"
