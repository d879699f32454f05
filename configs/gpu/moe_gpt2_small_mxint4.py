# configs/gpu/_moe_gpt2_small.py trained with one recipe: these configs differ only in the last line.
from configs.gpu._moe_gpt2_small import *  # noqa: F401,F403

recipe = "mxint4"
