# configs/_moe_small.py trained with one recipe: the moe configs differ only in the last line.
from configs._moe_small import *  # noqa: F401,F403

recipe = "mxint4"
