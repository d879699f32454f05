# configs/gpu/_moe_gpt2_small.py in mxfp4 with its three GEMMs on the FP8 tensor cores (fast
# accumulation in all three), Fprop's x at unit scale and dy's scale kept for each optimizer step:
# 1.003x bf16's speed at 0.84x of its peak memory on an H100 (results/bench/bars_h100.md). Each
# option and what it costs: docs/formats.md, FP8 GEMMs. FP8 GEMMs need compute capability 8.9+
# (Ada, Hopper); on older GPUs the same recipe runs its GEMMs in bf16.
from configs.gpu._moe_gpt2_small import *  # noqa: F401,F403

recipe = "mxfp4"
recipe_fp8_gemm = True
recipe_fp8_x_scale = "unit"
recipe_fp8_fast_accum = "all"
recipe_fp8_dy_scale = "step"
