"""
eval.py: a checkpoint's loss over a whole text file or dataset split: tokens, mean loss
(nats/token), perplexity and bits per byte.

    python eval.py --out_dir=out/moe_small_ufp4                     # its dataset's val split
    python eval.py --out_dir=out/moe_small_ufp4 --text_file=hamlet.txt   # any UTF-8 text file
    python eval.py --ckpt_path=out/moe_small_ufp4/ckpt_best.pt --recipe=bf16   # unquantized forward

A full pass: the tokens are cut into non-overlapping windows of block_size tokens, and every
token but the first of the text is predicted once, from the tokens before it in its window (the
context restarts at each window, so the loss is a little higher than with a sliding window).
The model runs the checkpoint's recipe (its FP4 forward, ablation overrides included) unless
--recipe names another: --recipe=bf16 measures the high-precision master weights, so the two
runs give the quantized forward's cost in quality apart from training. Under a recipe with a
per-tensor scale (nvfp4) the windows of one batch share that scale.

Text is tokenized with the checkpoint's tokenizer; a char model refuses a character outside its
vocabulary. Bits per byte = the summed loss in bits / the UTF-8 bytes of the predicted tokens,
decoded from them (GPT-2's end-of-text separator counts 0 bytes, in a split or written out in a
text file): comparable across tokenizers.
"""
import math
import os
import sys

import numpy as np
import torch

import data
import fp4
from checkpoint import LATEST, CheckpointError, data_changes, load_model
from configurator import (ConfigError, check_backend, check_device, check_ranges, defaults_of,
                          help_text, parse, resolve_device, wants_help)
from data.common import encoder, read_text_file
from data.loader import read_split

# -----------------------------------------------------------------------------
out_dir = "out"          # the run's folder: its ckpt.pt is evaluated
ckpt_path = ""           # "" = out_dir/ckpt.pt
text_file = ""           # a UTF-8 text file to evaluate ("" = the dataset split below)
split = "val"            # the checkpoint's dataset split, when no text_file: "val" or "train"
data_dir = ""            # the folder of the prepared datasets ("" = the checkpoint's data_dir)
max_tokens = 0           # 0 = the whole text or split; else only its first this many tokens
batch_size = 8           # windows per forward
recipe = ""              # "" = the checkpoint's recipe (with its ablation overrides)
device = "auto"          # "auto" (cuda when present), "cpu", "cuda", "cuda:1"...
dtype = "auto"           # "auto" (bf16 autocast on GPU, fp32 on CPU), "bfloat16", "float32"
backend = "auto"         # fp4 backend: "auto", "torch" or "triton"
seed = 1337              # seeds the stochastic parts of a recipe's forward, if any
# -----------------------------------------------------------------------------
DEFAULTS = defaults_of(globals())
CHOICES = dict(split=("val", "train"), dtype=("auto", "bfloat16", "float32"),
               backend=("auto", "torch", "triton"))
RANGES = dict(max_tokens=(lambda v: v >= 0, ">= 0 (0 = all)"),
              batch_size=(lambda v: v >= 1, ">= 1"),
              seed=(lambda v: 0 <= v < 2**63, "in [0, 2^63)"))


def first_unknown(text, stoi):
    """'the character X at line L, column C' of the first character outside a char vocabulary."""
    for i, ch in enumerate(text):
        if ch not in stoi:
            line = text.count("\n", 0, i) + 1
            return f"{ch!r} (U+{ord(ch):04X}) at line {line}, column {i - text.rfind(chr(10), 0, i)}"
    return None


def text_tokens(path, meta, max_tokens=0):
    """(token ids, UTF-8 bytes of the tokens after the first) of a text file (its first
    max_tokens tokens, unless 0)."""
    try:
        text = read_text_file(path)
    except ValueError as e:
        raise ConfigError(str(e).replace("input file", "text_file")) from None
    if meta["tokenizer"] == "char":
        bad = first_unknown(text, meta["stoi"])
        if bad:
            raise ConfigError(f"{path}: the character {bad} is not in the char model's "
                              f"vocabulary of {len(meta['stoi'])}: evaluate text made of its "
                              f"characters")
    ids = np.asarray(encoder(meta)(text), dtype=np.int64)
    if max_tokens and len(ids) > max_tokens:
        ids = ids[:max_tokens]
    return ids, int(token_bytes(meta)[ids[1:]].sum())   # the split's rule: one count, cut or not


def token_bytes(meta):
    """UTF-8 bytes of each token id (GPT-2's end-of-text separator: 0), or None when unknown."""
    if meta.get("tokenizer") == "char":
        return np.array([len(ch.encode("utf-8")) for ch in meta["itos"]], dtype=np.int64)
    if meta.get("tokenizer") == "gpt2":
        from data.common import get_gpt2_encoding
        enc = get_gpt2_encoding()
        sizes = [len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)]
        if "eot_token" in meta:
            sizes[meta["eot_token"]] = 0
        return np.array(sizes, dtype=np.int64)
    return None


def split_tokens(c, ckpt):
    """(token ids, bytes of the predicted tokens or None, the file) of the checkpoint's dataset
    split."""
    cfg = ckpt["config"]
    folder = os.path.join(c["data_dir"] or cfg.get("data_dir", "data"), cfg.get("dataset", ""))
    path = os.path.join(folder, f"{c['split']}.bin")
    if not os.path.isfile(path):
        raise ConfigError(f"no {path}: the checkpoint's dataset is not prepared here; pass "
                          f"--data_dir=FOLDER, or evaluate a --text_file")
    try:
        meta = data.load_meta(folder)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None
    changes = data_changes(ckpt["meta"], meta)
    if changes:
        raise ConfigError(f"{folder} is not the data the checkpoint was trained on ({changes}): "
                          f"prepare that data again, or evaluate a --text_file")
    try:   # (the checks train.py's loader makes: a cut file, ids outside the vocabulary)
        ids = read_split(folder, c["split"]).astype(np.int64)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if c["max_tokens"]:
        ids = ids[:c["max_tokens"]]
    sizes = token_bytes(meta)
    return ids, None if sizes is None else int(sizes[ids[1:]].sum()), path


@torch.no_grad()
def summed_loss(model, ids, block_size, batch_size, device, ctx):
    """The summed cross-entropy (nats) of ids[1:], each predicted within its window of
    block_size tokens; windows batched, the last (shorter) one alone."""
    x_all, y_all = torch.from_numpy(ids[:-1]), torch.from_numpy(ids[1:])
    n = len(y_all)
    full = n // block_size
    total = 0.0
    for start in range(0, full, batch_size):
        rows = range(start, min(start + batch_size, full))
        x = torch.stack([x_all[r * block_size:(r + 1) * block_size] for r in rows]).to(device)
        y = torch.stack([y_all[r * block_size:(r + 1) * block_size] for r in rows]).to(device)
        with ctx:
            _, loss = model(x, y)   # the mean over the batch's tokens, in fp32
        total += loss.item() * y.numel()
    if n % block_size:
        x, y = x_all[full * block_size:][None].to(device), y_all[full * block_size:][None].to(device)
        with ctx:
            _, loss = model(x, y)
        total += loss.item() * y.numel()
    return total


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(help_text(__file__, DEFAULTS, usage=__doc__))
        return None
    c, given = parse(argv, DEFAULTS, choices=CHOICES)
    check_ranges(c, RANGES)
    for key, other in (("text_file", "split"), ("text_file", "data_dir"), ("ckpt_path", "out_dir")):
        if c[key] and other in given:   # the other would be ignored
            raise ConfigError(f"give --{key} or --{other}, not both")
    check_device(c["device"])
    check_backend(c["backend"], c["device"])
    fp4.set_backend(c["backend"])
    dev, dt = resolve_device(c["device"], c["dtype"])
    model, rec, ckpt, path = load_model(c["ckpt_path"] or os.path.join(c["out_dir"], LATEST),
                                         c["recipe"], dev, "tokenize")
    if c["text_file"]:
        ids, n_bytes = text_tokens(c["text_file"], ckpt["meta"], c["max_tokens"])
        source = c["text_file"]
    else:
        ids, n_bytes, source = split_tokens(c, ckpt)
    if len(ids) < 2:
        held = f"--max_tokens={c['max_tokens']} keeps" if c["max_tokens"] == 1 else f"{source} has"
        raise ConfigError(f"{held} {len(ids)} token(s): at least 2 are needed to predict one")
    block = ckpt["model_args"]["block_size"]
    print(f"# {path}: iter {ckpt['iter_num']}, recipe {rec.name}"
          + (" (the checkpoint's)" if not c["recipe"] else f" (trained with {ckpt['recipe']})"),
          file=sys.stderr)
    print(f"# {source}: {len(ids):,} tokens in {math.ceil((len(ids) - 1) / block)} "
          f"non-overlapping windows of {block} tokens (the context restarts at each window)",
          file=sys.stderr)
    torch.manual_seed(c["seed"])
    ctx = torch.autocast(dev.split(":")[0], dtype=torch.bfloat16) if dt == "bfloat16" else \
        torch.autocast("cpu", enabled=False)
    nats = summed_loss(model, ids, block, c["batch_size"], dev, ctx)
    n = len(ids) - 1
    out = dict(tokens=n, loss=nats / n, perplexity=math.exp(nats / n),
               bits_per_byte=nats / math.log(2) / n_bytes if n_bytes else None, recipe=rec.name)
    bpb = f"{out['bits_per_byte']:.4f}" if n_bytes else \
        "not available (the bytes behind the tokens are not known)"
    print(f"tokens {n:,} | loss {out['loss']:.4f} nats/token | perplexity "
          f"{out['perplexity']:.3f} | bits per byte {bpb}")
    return out


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
