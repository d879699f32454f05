# configs/gpu/_gpt2_small.py in mxint4 (UFP4's recipe on 1x32 power-of-two block scales) with its
# three GEMMs on the FP8 tensor cores and Wgrad's x kept as FP8 between forward and backward: on
# one H200 this trained at bf16's speed (1.00x) in 0.89x of bf16's peak memory; with
# recipe_fp8_wgrad_x = "packed" 0.98x in 0.85x (docs/performance.md). FP8 GEMMs need compute
# capability 8.9+ (Ada, Hopper); on older GPUs the same recipe runs its GEMMs in bf16.
from configs.gpu._gpt2_small import *  # noqa: F401,F403

recipe = "mxint4"
recipe_fp8_gemm = True
recipe_fp8_wgrad_x = "fp8"
