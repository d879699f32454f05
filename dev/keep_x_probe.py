"""Bytes a compiled dense GPT (GELU MLP, ufp4) saves for backward with fc2's x kept packed (the
default) and kept whole (fp4.convert's keep_x): does inductor then recompute GELU from fc1's
output, which GELU's backward saves anyway, or save GELU's output too? CPU, toy sizes.
    PYTHONPATH=. python dev/keep_x_probe.py"""
import torch

import fp4
import train
from model import GPT, GPTConfig

def saved_kib(keep_x, compiled):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128, mlp="gelu")
    model = fp4.convert(GPT(cfg), fp4.make_recipe("ufp4"), keep_x=keep_x)
    run = train.torch_compile(model) if compiled else model
    x, y = torch.randint(0, 512, (8, 64)), torch.randint(0, 512, (8, 64))
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for _ in range(2):  # the second call: compiled, no tracing-time tensors
        storages.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            loss = run(x, y)[1]
        loss.backward()
    return sum(storages.values()) / 1024

print(f"torch {torch.__version__}; 2 layers x 128, hidden 512, 512 tokens; KiB saved for backward")
for keep_x in (("attn.proj",), ("attn.proj", "fc2")):
    row = [f"{saved_kib(keep_x, c):.1f}" for c in (False, True)]
    print(f"keep_x={keep_x}: eager {row[0]}, compiled {row[1]}")
