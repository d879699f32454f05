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

# -----------------------------------------------------------------------------
out_dir = "out"
ckpt_path = ""           # "" = out_dir/ckpt.pt
start = "\n"             # the prompt, or "FILE:path" to read it from a file
num_samples = 3
max_new_tokens = 500
temperature = 0.8        # < 1 sharpens, > 1 flattens the distribution
top_k = 200              # keep only the top_k most likely tokens (0 = all)
seed = 1337
device = "auto"
dtype = "auto"
recipe = ""              # "" = the checkpoint's recipe (with its ablation overrides)
backend = "auto"
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items()
            if not k.startswith("_") and isinstance(v, (bool, int, float, str))}

def decoder(meta):
    """token ids -> str for a dataset's meta (char or gpt2)."""
    if meta["tokenizer"] == "char":
        itos = meta["itos"]
        return lambda ids: "".join(itos[i] for i in ids)
    from data.common import get_gpt2_encoding
    enc = get_gpt2_encoding()
    return lambda ids: enc.decode([i for i in ids if i < enc.n_vocab])

def encoder(meta):
    """str -> token ids for a dataset's meta; unknown characters are an error."""
    if meta["tokenizer"] == "char":
        stoi = meta["stoi"]
        def encode(text):
            bad = sorted(set(ch for ch in text if ch not in stoi))
            if bad:
                raise ValueError(f"characters {bad} are not in the dataset's vocabulary")
            return [stoi[ch] for ch in text]
        return encode
    from data.common import get_gpt2_encoding
    enc = get_gpt2_encoding()
    return lambda text: enc.encode(text, allowed_special={"<|endoftext|>"})

def main(argv=None):
    import fp4
    import train
    from model import GPT, GPTConfig

    c = train.get_config(sys.argv[1:] if argv is None else argv, defaults=DEFAULTS)
    fp4.set_backend(c["backend"])
    dev = c["device"] if c["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dt = c["dtype"] if c["dtype"] != "auto" else ("bfloat16" if dev.startswith("cuda") else "float32")
    ckpt, path = train.load_checkpoint(c["ckpt_path"] or os.path.join(c["out_dir"], "ckpt.pt"), dev)
    if "meta" not in ckpt:
        raise train.CheckpointError(f"{path} holds no tokenizer (meta): cannot decode")
    tcfg = dict(ckpt["config"])
    if c["recipe"]:  # another recipe, without the checkpoint's ablation overrides
        tcfg.update({k: None for k in train.RECIPE_KEYS}, recipe=c["recipe"])
    recipe = train.make_recipe_from(tcfg)
    model = fp4.convert(GPT(GPTConfig(**ckpt["model_args"])), recipe)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise train.CheckpointError(f"{path}: the weights do not fit the model: {e}") from e
    model.eval().to(dev)

    prompt = c["start"]
    if prompt.startswith("FILE:"):
        with open(prompt[5:], encoding="utf-8") as f:
            prompt = f.read()
    meta = ckpt["meta"]
    ids = encoder(meta)(prompt) or [0]
    decode = decoder(meta)
    torch.manual_seed(c["seed"])
    x = torch.tensor(ids, dtype=torch.long, device=dev)[None]
    ctx = torch.autocast(dev.split(":")[0], dtype=torch.bfloat16) if dt == "bfloat16" else \
        torch.autocast("cpu", enabled=False)
    print(f"# {path}: iter {ckpt['iter_num']}, recipe {recipe.name}, val loss "
          f"{ckpt['best_val_loss']:.4f}", file=sys.stderr)
    outs = []
    with torch.no_grad(), ctx:
        for _ in range(c["num_samples"]):
            y = model.generate(x, c["max_new_tokens"], temperature=c["temperature"],
                               top_k=c["top_k"] or None)
            outs.append(decode(y[0].tolist()))
            print(outs[-1])
            print("---------------")
    return outs

if __name__ == "__main__":
    import train
    try:
        main()
    except (train.ConfigError, train.CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
