# configs/gpu/_gpt2_small.py in mxint4 (UFP4's recipe on 1x32 power-of-two block scales) with its
# three GEMMs on the FP8 tensor cores, Fprop's x at unit scale (no pass over x for its scale) and
# dy's scale kept for each optimizer step: level with bf16 (1.000x) at 0.82x of its peak memory
# on an H100, 1.002x at 0.88x with recipe_fp8_wgrad_x = "fp8" (results/bench/bars_h100.md). Each
# option and what it costs: docs/formats.md, FP8 GEMMs. FP8 GEMMs need compute capability 8.9+
# (Ada, Hopper); on older GPUs the same recipe runs its GEMMs in bf16.
from configs.gpu._gpt2_small import *  # noqa: F401,F403

recipe = "mxint4"
recipe_fp8_gemm = True
recipe_fp8_x_scale = "unit"
recipe_fp8_dy_scale = "step"
