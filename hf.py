"""
hf.py: model weights in and out of nanoFP4: safetensors, and Hugging Face model directories.

    python hf.py export out/gpt_small_ufp4 hf/gpt_small_ufp4   # or a ckpt.pt path; --dtype=bfloat16
    python hf.py export out/gpt2_style/ckpt.pt hf/gpt2_style
    python hf.py export out/gpt_small_ufp4/model.safetensors hf/gpt_small_ufp4

Export writes a transformers model directory (config.json, model.safetensors, tokenizer files,
nanofp4.json with the checkpoint's model_args, recipe, iteration and dataset meta):
  - LlamaForCausalLM for the default dense model: RMSNorm, rotate-half RoPE, SwiGLU (fc1 holds
    gate then up), tied or untied lm_head, with or without biases (attention_bias = mlp_bias);
    rms_norm_eps is float32's machine epsilon, the eps of model.py's nn.RMSNorm in fp32.
  - GPT2LMHeadModel for GPT-2-style models: LayerNorm, exact (erf) GELU (activation_function
    "gelu", not GPT-2's own tanh "gelu_new"), learned positions; Conv1D weights are the
    transposed nn.Linear ones; a model without biases gets zero biases.
  Mixture-of-experts models and other combinations of norm / mlp / pos_emb are refused.
  Tokenizer: a GPT-2 BPE dataset gives GPT-2's tokenizer (vocab.json and merges.txt, the files
  tiktoken uses, provisioned offline by data.common); a char dataset gives a tokenizer.json that
  maps each character to its id (tokenizers' WordLevel, one token per character) plus
  char_vocab.json ({"itos": [...]}, index = token id). Into a folder that holds an earlier
  export, export first removes that export's tokenizer files (TOKENIZER_FILES, and only those), so
  the folder describes the one tokenizer written now (or none); other files there are kept.

What is exported is the high-precision (fp32) master weights, i.e. the model's unquantized
forward: transformers runs plain matmuls, not the FP4 recipe the model was trained with. The two
forwards differ. A 0.86M-parameter char model trained 300 iterations under ufp4 (4 layers, 128
wide, tests/train_helpers.py's corpus): val cross-entropy 0.3069 with the fp32 forward, 0.3073
with the ufp4 one; logits 3.6% apart in RMS, the same top-1 token at 99.6% of positions. On
tests/test_hf.py's random model (near-uniform logits) they are 25% apart. Evaluate the exported
model if the quantized forward's quality is what matters.

Import: load_hf(dir) -> (GPTConfig kwargs, state_dict) from a local Llama or GPT-2 directory, for
train.py to start from (e.g. an FP4 fine-tune). Llama with grouped-query attention, RoPE scaling
or another activation, and GPT-2 variants that scale attention per layer, are refused. Two
approximations are accepted with a printed note: another rms_norm_eps (model.py uses float32's)
and GPT-2's tanh GELU (model.py's is exact).

save_weights / load_weights: a state dict as .safetensors (tied tensors stored once), for
train.py to write beside ckpt.pt: a file any framework can read without running code.
"""
import dataclasses
import json
import os
import sys

import torch

FP32_EPS = torch.finfo(torch.float32).eps   # nn.RMSNorm's eps (None) on fp32 activations
GPT2_LN_EPS = 1e-5                          # nn.LayerNorm's default, GPT-2's too

# The files by which an export says its tokenizer (nanofp4.json by its dataset meta). Export
# removes them before writing: an earlier export's other tokenizer must not stay beside the new one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "char_vocab.json", "nanofp4.json")

class HFError(ValueError):
    pass

# -----------------------------------------------------------------------------
# safetensors

def save_weights(state_dict, path, metadata=None):
    """Write a state dict as safetensors, atomically. Tensors that share memory (tied embeddings)
    are stored once; the other names are kept in the metadata ("aliases") and load_weights
    restores them. metadata: extra str -> str (or JSON-able) entries, e.g. model_args."""
    from safetensors.torch import save_file
    tensors, aliases, seen = {}, {}, {}
    for name, t in state_dict.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               t.stride(), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    meta = {"format": "pt", "aliases": json.dumps(aliases)}
    for k, v in (metadata or {}).items():
        meta[k] = v if isinstance(v, str) else json.dumps(v)
    tmp = path + ".tmp"
    try:
        save_file(tensors, tmp, metadata=meta)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)
    return path

def load_weights(path):
    """-> (state_dict, metadata) of a file written by save_weights (tied names restored)."""
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        state = {k: f.get_tensor(k) for k in f.keys()}
    for name, target in json.loads(meta.get("aliases", "{}")).items():
        state[name] = state[target]
    return state, meta

# -----------------------------------------------------------------------------
# reading a nanoFP4 checkpoint

def read_safetensors(path):
    """A save_weights file that carries model_args (and maybe recipe, iter_num, the dataset's
    meta) in its metadata, as a checkpoint dict."""
    from safetensors import SafetensorError
    try:
        state, meta = load_weights(path)
    except SafetensorError as e:
        raise HFError(f"cannot read {path} ({e}): a cut or damaged file; export the run's "
                      f"ckpt.pt instead, or save the weights again") from None
    if "model_args" not in meta:
        raise HFError(f"{path} has no model_args in its metadata: export its ckpt.pt instead")
    info = {k: json.loads(meta[k]) for k in ("model_args", "meta", "iter_num") if k in meta}
    return dict(info, model=state, recipe=meta.get("recipe"))

def read_checkpoint(src):
    """A train.py checkpoint (path, or out_dir holding ckpt.pt), loaded with weights_only=True:
    a file from elsewhere cannot run code; or a model.safetensors that save_weights wrote with
    model_args. -> the checkpoint dict (model, model_args, ...)."""
    path = os.path.join(src, "ckpt.pt") if os.path.isdir(src) else src
    if not os.path.isfile(path):
        raise HFError(f"no checkpoint at {path}: pass a ckpt.pt, a model.safetensors or a "
                      f"train.py out_dir")
    if path.endswith(".safetensors"):
        return read_safetensors(path)
    from checkpoint import CheckpointError, load_checkpoint
    try:   # weights-only, its checksum checked, as train.py and eval.py read it
        ckpt, _ = load_checkpoint(path, flag=None)
    except CheckpointError as e:
        raise HFError(str(e)) from None
    prefixes = ("_orig_mod.", "module.")   # torch.compile and DDP wrappers
    state = {}
    for k, v in ckpt["model"].items():
        for p in prefixes:
            k = k[len(p):] if k.startswith(p) else k
        state[k] = v
    ckpt["model"] = state
    return ckpt

def gpt_config(model_args):
    """GPTConfig from a checkpoint's model_args; keys model.py no longer knows are an error."""
    from model import GPTConfig
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(model_args) - names)
    if unknown:
        raise HFError(f"model_args {unknown} are unknown to model.GPTConfig")
    return GPTConfig(**model_args)

# -----------------------------------------------------------------------------
# nanoFP4 -> Hugging Face

def hf_kind(cfg):
    """'llama' or 'gpt2' for a GPTConfig, or HFError saying why neither fits."""
    if cfg.n_expert:
        raise HFError(f"a mixture-of-experts model (n_expert={cfg.n_expert}) has no Llama or GPT-2 "
                      f"equivalent: export supports dense models only")
    combo = (cfg.norm, cfg.mlp, cfg.pos_emb)
    if combo == ("rmsnorm", "swiglu", "rope"):
        return "llama"
    if combo == ("layernorm", "gelu", "learned"):
        return "gpt2"
    raise HFError(f"norm={cfg.norm}, mlp={cfg.mlp}, pos_emb={cfg.pos_emb} has no Hugging Face "
                  f"equivalent here: export supports rmsnorm+swiglu+rope (Llama) and "
                  f"layernorm+gelu+learned (GPT-2)")

def llama_state(sd, cfg):
    """nanoFP4 names -> LlamaForCausalLM names; qkv rows are [q; k; v], fc1 rows [gate; up]."""
    C, H = cfg.n_embd, cfg.hidden
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["norm_f.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layer):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = sd[b + "norm1.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[b + "norm2.weight"]
        pairs = [("qkv", ("q_proj", "k_proj", "v_proj"), (C, C, C), "self_attn."),
                 ("proj", ("o_proj",), (C,), "self_attn."),
                 ("fc1", ("gate_proj", "up_proj"), (H, H), "mlp."),
                 ("fc2", ("down_proj",), (C,), "mlp.")]
        for ours, theirs, rows, where in pairs:
            src = b + ("attn." if where == "self_attn." else "mlp.") + ours
            for param in ("weight", "bias") if cfg.bias else ("weight",):
                for name, part in zip(theirs, sd[f"{src}.{param}"].split(rows, dim=0)):
                    out[f"{h}{where}{name}.{param}"] = part
    return out

def gpt2_state(sd, cfg):
    """nanoFP4 names -> GPT2LMHeadModel names; Conv1D weights are [in, out] (transposed)."""
    t = "transformer."
    out = {t + "wte.weight": sd["wte.weight"], t + "wpe.weight": sd["wpe.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    def norm(ours, theirs):
        out[theirs + ".weight"] = sd[ours + ".weight"]
        out[theirs + ".bias"] = sd.get(ours + ".bias", torch.zeros_like(sd[ours + ".weight"]))
    norm("norm_f", t + "ln_f")
    for i in range(cfg.n_layer):
        b, h = f"blocks.{i}.", f"{t}h.{i}."
        norm(b + "norm1", h + "ln_1")
        norm(b + "norm2", h + "ln_2")
        for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                             ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            w = sd[b + ours + ".weight"]
            out[h + theirs + ".weight"] = w.t()
            out[h + theirs + ".bias"] = sd.get(b + ours + ".bias", w.new_zeros(w.shape[0]))
    return out

def hf_config(cfg, kind, meta=None, dtype="float32"):
    """The transformers config object of the same model."""
    import transformers
    eot = meta.get("eot_token") if meta and meta.get("tokenizer") == "gpt2" else None
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings,
                  bos_token_id=eot, eos_token_id=eot, dtype=dtype)
    if kind == "llama":
        return transformers.LlamaConfig(
            hidden_size=cfg.n_embd, intermediate_size=cfg.hidden, num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
            head_dim=cfg.n_embd // cfg.n_head, hidden_act="silu",
            max_position_embeddings=cfg.block_size, rms_norm_eps=FP32_EPS,
            rope_theta=cfg.rope_theta, attention_bias=cfg.bias, mlp_bias=cfg.bias,
            attention_dropout=0.0, **common)
    return transformers.GPT2Config(
        n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
        n_inner=cfg.hidden, activation_function="gelu", layer_norm_epsilon=GPT2_LN_EPS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)

def export(src, hf_dir, dtype="float32"):
    """Checkpoint (path or out_dir) -> Hugging Face model directory. Returns a one-line summary."""
    from safetensors.torch import save_file
    if dtype not in ("float32", "bfloat16"):
        raise HFError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        raise HFError(f"{hf_dir} is a file: export into a folder")
    if os.path.exists(os.path.join(hf_dir, "ckpt.pt")):
        raise HFError(f"{hf_dir} holds a nanoFP4 run (ckpt.pt): export into a folder of its own, "
                      f"e.g. hf/{os.path.basename(os.path.normpath(hf_dir))}")
    ckpt = read_checkpoint(src)
    cfg = gpt_config(ckpt["model_args"])
    kind = hf_kind(cfg)
    meta = ckpt.get("meta")
    state = (llama_state if kind == "llama" else gpt2_state)(ckpt["model"], cfg)
    os.makedirs(hf_dir, exist_ok=True)
    old = []   # only an earlier export's files (every export writes nanofp4.json): others stay
    if os.path.isfile(os.path.join(hf_dir, "nanofp4.json")):
        old = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, f))]
    for f in old:
        os.remove(os.path.join(hf_dir, f))
    hf_config(cfg, kind, meta, dtype).save_pretrained(hf_dir)
    state = {k: v.detach().to(getattr(torch, dtype)).contiguous().clone() for k, v in state.items()}
    save_file(state, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    tok = save_tokenizer(meta, hf_dir)
    info = dict(model_args=dataclasses.asdict(cfg), recipe=ckpt.get("recipe"),
                iter_num=ckpt.get("iter_num"), best_val_loss=ckpt.get("best_val_loss"),
                meta=meta, weights="fp32 master weights (the unquantized forward)")
    with open(os.path.join(hf_dir, "nanofp4.json"), "w") as f:
        json.dump(info, f, indent=1)
    gone = [f for f in old if not os.path.exists(os.path.join(hf_dir, f))]   # not written again
    if gone:
        tok += f"; removed the earlier export's {', '.join(gone)}"
    arch = "LlamaForCausalLM" if kind == "llama" else "GPT2LMHeadModel"
    return f"{hf_dir}: {arch}, {sum(v.numel() for v in state.values()) / 1e6:.2f}M {dtype} " \
           f"params from {src} (recipe {ckpt.get('recipe')}, iter {ckpt.get('iter_num')}); {tok}"

# -----------------------------------------------------------------------------
# tokenizers

def save_tokenizer(meta, hf_dir):
    """The dataset's tokenizer as Hugging Face tokenizer files; returns what was written."""
    kind = (meta or {}).get("tokenizer")
    if kind == "char":
        return save_char_tokenizer(meta["itos"], hf_dir)
    if kind == "gpt2":
        return save_gpt2_tokenizer(hf_dir)
    return "no tokenizer (the checkpoint holds no dataset meta)"

def save_char_tokenizer(itos, hf_dir):
    """One token per character, id = index in itos (the order data.common.encode_chars uses)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    with open(os.path.join(hf_dir, "char_vocab.json"), "w") as f:
        json.dump({"tokenizer": "char", "itos": list(itos)}, f, ensure_ascii=False)
    tok = Tokenizer(models.WordLevel({ch: i for i, ch in enumerate(itos)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()   # join the characters back with nothing between them
    PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False) \
        .save_pretrained(hf_dir)
    return f"char tokenizer ({len(itos)} characters): tokenizer.json, char_vocab.json"

def save_gpt2_tokenizer(hf_dir):
    """GPT-2's BPE from the files tiktoken uses (checked by their sha256), offline once cached:
    encoder.json and vocab.bpe are GPT-2's vocab.json and merges.txt."""
    import hashlib
    import shutil
    from data import common
    from transformers import GPT2TokenizerFast
    common.get_gpt2_encoding()   # provisions the files if tiktoken's cache lacks them
    for name, hf_name in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
        url, sha = common.GPT2_FILES[name]
        path = os.path.join(common.tiktoken_cache_dir(), hashlib.sha1(url.encode()).hexdigest())
        if not os.path.isfile(path) or common.sha256_file(path) != sha:
            return f"no tokenizer: GPT-2's {name} is not in tiktoken's cache ({path})"
        shutil.copyfile(path, os.path.join(hf_dir, hf_name))
    # from the two files (the constructor's arguments differ across transformers versions)
    GPT2TokenizerFast.from_pretrained(hf_dir).save_pretrained(hf_dir)
    return "GPT-2 tokenizer (vocab.json, merges.txt, tokenizer.json)"

# -----------------------------------------------------------------------------
# Hugging Face -> nanoFP4

def tokenizer_of(hf_dir):
    """What a model directory says of its tokenizer: ("char", itos) from an export's
    char_vocab.json or nanofp4.json; ("gpt2", None) from GPT-2's vocab.json and merges.txt (a
    vocab.json of GPT-2's 50257 entries); ("other", file names) for any other tokenizer files;
    (None, None) where there are none (a model saved without its tokenizer)."""
    def read(name):   # a JSON object, or {}
        try:
            with open(os.path.join(hf_dir, name), encoding="utf-8") as f:
                obj = json.load(f)
        except (OSError, ValueError):
            return {}
        return obj if isinstance(obj, dict) else {}
    meta = read("nanofp4.json").get("meta") or read("char_vocab.json")
    meta = meta if isinstance(meta, dict) else {}
    if meta.get("tokenizer") == "char" and isinstance(meta.get("itos"), list):
        return "char", meta["itos"]
    if meta.get("tokenizer") == "gpt2":
        return "gpt2", None
    from data.common import GPT2_VOCAB_SIZE
    if len(read("vocab.json")) == GPT2_VOCAB_SIZE and os.path.isfile(os.path.join(hf_dir, "merges.txt")):
        return "gpt2", None
    files = [f for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
             if os.path.isfile(os.path.join(hf_dir, f))]
    return ("other", files) if files else (None, None)

def read_hf_weights(hf_dir):
    """All tensors of a model directory: model.safetensors, its sharded index, or
    pytorch_model.bin (weights_only)."""
    from safetensors.torch import load_file
    single, index = os.path.join(hf_dir, "model.safetensors"), \
        os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(load_file(os.path.join(hf_dir, shard)))
        return state
    binary = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise HFError(f"{hf_dir} has no model.safetensors, model.safetensors.index.json or "
                  f"pytorch_model.bin")

def _note(msg):
    print(f"note: {msg}", file=sys.stderr)

def _rope_theta(conf):
    params = conf.get("rope_parameters") or conf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise HFError(f"RoPE scaling {kind!r} is not supported (model.py has plain RoPE)")
    return float(params.get("rope_theta", conf.get("rope_theta", 10000.0)))

def llama_args(conf):
    """GPTConfig kwargs of a Llama config.json (refusing what model.py cannot express)."""
    C, n_head = conf["hidden_size"], conf["num_attention_heads"]
    if conf.get("hidden_act", "silu") != "silu":
        raise HFError(f"hidden_act={conf['hidden_act']!r}: model.py's SwiGLU uses silu")
    if conf.get("num_key_value_heads", n_head) not in (None, n_head):
        raise HFError(f"grouped-query attention (num_key_value_heads="
                      f"{conf['num_key_value_heads']} < {n_head} heads) is not supported")
    if conf.get("head_dim", C // n_head) not in (None, C // n_head):
        raise HFError(f"head_dim={conf['head_dim']} is not hidden_size / num_attention_heads")
    if bool(conf.get("attention_bias")) != bool(conf.get("mlp_bias")):
        raise HFError("attention_bias and mlp_bias differ: model.py's `bias` sets both")
    if conf.get("rms_norm_eps", FP32_EPS) != FP32_EPS:
        _note(f"rms_norm_eps={conf['rms_norm_eps']} becomes float32's eps ({FP32_EPS:.3g}), "
              f"model.py's: logits move slightly")
    return dict(vocab_size=conf["vocab_size"], n_layer=conf["num_hidden_layers"], n_head=n_head,
                n_embd=C, mlp_hidden=conf["intermediate_size"], bias=bool(conf.get("mlp_bias")),
                norm="rmsnorm", mlp="swiglu", pos_emb="rope", rope_theta=_rope_theta(conf),
                tie_embeddings=bool(conf.get("tie_word_embeddings", False)),
                block_size=conf.get("max_position_embeddings", 2048))

def from_llama(conf, hf):
    """-> (kwargs, nanoFP4 state dict) from a Llama config.json dict and its tensors."""
    args = llama_args(conf)
    get = lambda k: hf[k].float()   # noqa: E731 (fp32 master weights, whatever the file's dtype)
    sd = {"wte.weight": get("model.embed_tokens.weight"), "norm_f.weight": get("model.norm.weight")}
    sd["lm_head.weight"] = sd["wte.weight"] if args["tie_embeddings"] else get("lm_head.weight")
    params = ("weight", "bias") if args["bias"] else ("weight",)
    for i in range(args["n_layer"]):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        sd[b + "norm1.weight"] = get(h + "input_layernorm.weight")
        sd[b + "norm2.weight"] = get(h + "post_attention_layernorm.weight")
        for p in params:
            sd[f"{b}attn.qkv.{p}"] = torch.cat([get(f"{h}self_attn.{n}_proj.{p}") for n in "qkv"])
            sd[f"{b}attn.proj.{p}"] = get(f"{h}self_attn.o_proj.{p}")
            sd[f"{b}mlp.fc1.{p}"] = torch.cat([get(f"{h}mlp.gate_proj.{p}"),
                                                get(f"{h}mlp.up_proj.{p}")])
            sd[f"{b}mlp.fc2.{p}"] = get(f"{h}mlp.down_proj.{p}")
    return args, sd

def gpt2_args(conf):
    act = conf.get("activation_function", "gelu_new")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise HFError(f"activation_function={act!r}: model.py's GPT-2 style uses GELU")
    if act != "gelu":
        _note(f"activation_function={act!r} (tanh GELU) becomes model.py's exact GELU: logits "
              f"move slightly")
    if not conf.get("scale_attn_weights", True) or conf.get("scale_attn_by_inverse_layer_idx"):
        raise HFError("GPT-2 attention scaled other than by 1/sqrt(head_dim) is not supported")
    if conf.get("layer_norm_epsilon", GPT2_LN_EPS) != GPT2_LN_EPS:
        _note(f"layer_norm_epsilon={conf['layer_norm_epsilon']} becomes {GPT2_LN_EPS}")
    C = conf["n_embd"]
    return dict(vocab_size=conf["vocab_size"], n_layer=conf["n_layer"], n_head=conf["n_head"],
                n_embd=C, mlp_hidden=conf.get("n_inner") or 4 * C, bias=True, norm="layernorm",
                mlp="gelu", pos_emb="learned", block_size=conf["n_positions"],
                tie_embeddings=bool(conf.get("tie_word_embeddings", True)))

def from_gpt2(conf, hf):
    args = gpt2_args(conf)
    hf = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in hf.items()}
    get = lambda k: hf[k].float()   # noqa: E731
    sd = {"wte.weight": get("wte.weight"), "wpe.weight": get("wpe.weight"),
          "norm_f.weight": get("ln_f.weight"), "norm_f.bias": get("ln_f.bias")}
    sd["lm_head.weight"] = sd["wte.weight"] if args["tie_embeddings"] else get("lm_head.weight")
    for i in range(args["n_layer"]):
        b, h = f"blocks.{i}.", f"h.{i}."
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            sd[f"{b}{ours}.weight"], sd[f"{b}{ours}.bias"] = get(h + theirs + ".weight"), \
                get(h + theirs + ".bias")
        for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                             ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            sd[f"{b}{ours}.weight"] = get(h + theirs + ".weight").t().contiguous()
            sd[f"{b}{ours}.bias"] = get(h + theirs + ".bias")
    return args, sd

def load_hf(hf_dir, block_size=None):
    """A local Hugging Face Llama or GPT-2 model directory -> (GPTConfig kwargs, state dict that
    GPT(GPTConfig(**kwargs)).load_state_dict takes). block_size: the context to train with
    (default: the model's max_position_embeddings / n_positions); learned positions are cut
    to it."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise HFError(f"no config.json in {hf_dir}: pass a Hugging Face model directory")
    try:
        with open(path) as f:
            conf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(conf, dict):
        raise HFError(f"{path} holds no JSON object: a Hugging Face model directory's config.json does")
    kind = conf.get("model_type")
    if kind not in ("llama", "gpt2"):
        raise HFError(f"model_type {kind!r} in {path}: import supports 'llama' and 'gpt2'")
    try:
        args, sd = (from_llama if kind == "llama" else from_gpt2)(conf, read_hf_weights(hf_dir))
    except KeyError as e:
        raise HFError(f"{hf_dir} lacks the tensor {e} that a {kind} model of its config.json "
                      f"has") from None
    if block_size is not None:
        if args["pos_emb"] == "learned" and block_size > args["block_size"]:
            raise HFError(f"block_size={block_size} exceeds the model's {args['block_size']} "
                          f"learned positions: pass --block_size={args['block_size']} or less")
        args["block_size"] = block_size
        if "wpe.weight" in sd:
            sd["wpe.weight"] = sd["wpe.weight"][:block_size].clone()
    return args, sd

# -----------------------------------------------------------------------------

USAGE = "usage: python hf.py export CKPT_OR_OUT_DIR HF_DIR [--dtype=float32|bfloat16] (--help)"

def main(argv):
    opts = [a for a in argv if a.startswith("--")]
    args = [a for a in argv if not a.startswith("--")]
    if args[:1] == ["import"]:
        print("error: import runs in train.py: python train.py CONFIG --init_from=hf:HF_DIR "
              "(fine-tunes the model in a recipe)", file=sys.stderr)
        return 2
    if len(args) != 3 or args[0] != "export" or any(not o.startswith("--dtype=") for o in opts):
        print(__doc__.strip() if "--help" in opts or "-h" in argv else USAGE, file=sys.stderr)
        return 0 if "--help" in opts else 2
    dtype = opts[-1].split("=", 1)[1] if opts else "float32"
    try:
        print(export(args[1], args[2], dtype))
    except HFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
