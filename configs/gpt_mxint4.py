# configs/_gpt_small.py trained with one recipe: the gpt configs differ only in the last line.
from configs._gpt_small import *  # noqa: F401,F403

recipe = "mxint4"
