"""
sample.py: generate text from a checkpoint written by train.py.

    python sample.py --out_dir=out/moe_small_ufp4
    python sample.py --out_dir=out/moe_small_ufp4 --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --out_dir=out/x --start=FILE:prompt.txt --recipe=bf16   # prompt from a file

The model is rebuilt from the checkpoint's model_args with the recipe it was trained with (its
forward GEMMs quantized the same way), unless --recipe names another one. Text is decoded with the
dataset's tokenizer, stored in the checkpoint (char itos, or GPT-2 BPE).
"""
import os
import sys

import torch

import fp4
from checkpoint import CheckpointError, load_model
from configurator import (ConfigError, check_backend, check_device, check_ranges, defaults_of,
                          help_text, parse, resolve_device, wants_help)
from data.common import decoder, encoder

# -----------------------------------------------------------------------------
out_dir = "out"          # the run's folder: its ckpt.pt is sampled
ckpt_path = ""           # "" = out_dir/ckpt.pt
start = "\n"             # the prompt, or "FILE:path" to read it from a file
num_samples = 3          # samples to draw
max_new_tokens = 500     # tokens per sample
temperature = 0.8        # < 1 sharpens, > 1 flattens the distribution
top_k = 200              # keep only the top_k most likely tokens (0 = all)
seed = 1337              # seeds the sampling
device = "auto"          # "auto" (cuda when present), "cpu", "cuda", "cuda:1"...
dtype = "auto"           # "auto" (bf16 autocast on GPU, fp32 on CPU), "bfloat16", "float32"
recipe = ""              # "" = the checkpoint's recipe (with its ablation overrides)
backend = "auto"         # fp4 backend: "auto", "torch" or "triton"
# -----------------------------------------------------------------------------
DEFAULTS = defaults_of(globals())
CHOICES = dict(dtype=("auto", "bfloat16", "float32"), backend=("auto", "torch", "triton"))
RANGES = dict(num_samples=(lambda v: v >= 1, ">= 1"), max_new_tokens=(lambda v: v >= 1, ">= 1"),
              temperature=(lambda v: v > 0, "> 0 (below 1e-4: greedy, the most likely token)"),
              top_k=(lambda v: v >= 0, ">= 0 (0 = all tokens)"),
              seed=(lambda v: 0 <= v < 2**63, "in [0, 2^63)"))


def read_prompt(start):
    """The prompt: the text itself, or a file's text for FILE:path; never empty (the model needs
    a token to continue from)."""
    if not start.startswith("FILE:"):
        text, where = start, "--start"
    else:
        try:
            with open(start[5:], encoding="utf-8") as f:
                text, where = f.read(), f"the prompt file {start[5:]!r}"
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the prompt file {start[5:]!r} of --start=FILE:path "
                              f"({getattr(e, 'strerror', None) or e}): name a text file") from None
    if not text:
        raise ConfigError(f"{where} is empty: give a prompt of at least one character (the default "
                          f"is a newline)")
    return text


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(help_text(__file__, DEFAULTS, usage=__doc__))
        return None
    c, given = parse(argv, DEFAULTS, choices=CHOICES)
    check_ranges(c, RANGES)
    if c["ckpt_path"] and "out_dir" in given:   # out_dir would be ignored
        raise ConfigError("give --ckpt_path or --out_dir, not both")
    check_device(c["device"])
    check_backend(c["backend"], c["device"])
    fp4.set_backend(c["backend"])
    dev, dt = resolve_device(c["device"], c["dtype"])
    prompt = read_prompt(c["start"])
    model, recipe, ckpt, path = load_model(c["ckpt_path"] or os.path.join(c["out_dir"], "ckpt.pt"),
                                         c["recipe"], dev, "decode")

    meta = ckpt["meta"]
    ids = encoder(meta)(prompt)
    decode = decoder(meta)
    torch.manual_seed(c["seed"])
    x = torch.tensor(ids, dtype=torch.long, device=dev)[None]
    ctx = torch.autocast(dev.split(":")[0], dtype=torch.bfloat16) if dt == "bfloat16" else \
        torch.autocast("cpu", enabled=False)
    val = ckpt.get("val_loss")
    print(f"# {path}: iter {ckpt['iter_num']}, recipe {recipe.name}, "
          + (f"val loss {val:.4f} (best of its run {ckpt['best_val_loss']:.4f})" if val is not None
             else f"best val loss of its run {ckpt['best_val_loss']:.4f}"), file=sys.stderr)
    outs = []
    with torch.no_grad(), ctx:
        for _ in range(c["num_samples"]):
            y = model.generate(x, c["max_new_tokens"], temperature=c["temperature"],
                               top_k=c["top_k"] or None, vocab=meta["vocab_size"])
            outs.append(decode(y[0].tolist()))
            print(outs[-1])
            print("---------------")
    return outs


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
