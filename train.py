"""
train.py: train a GPT or MoE with a 4-bit (FP4) recipe, on one CPU/GPU or several GPUs (DDP).

    python train.py configs/moe_ufp4.py                          # one process
    python train.py configs/moe_ufp4.py --recipe=e2m1 --max_iters=100
    torchrun --standalone --nproc_per_node=8 train.py configs/gpu/gpt2_small_ufp4.py
    python train.py configs/moe_ufp4.py --init_from=resume       # continue from out_dir/ckpt.pt

Config: the defaults below, then config files (plain Python that assigns some of these names),
then --key=value (checked against the default's type). Outputs in out_dir: ckpt.pt (written
atomically; the one before is kept as ckpt_prev.pt) and log.jsonl (one JSON record per logged
step and per eval), both by rank 0 alone. A checkpoint resumes on any number of processes; on
the same number it continues every rank's data and RNG streams exactly, on another number the
data order changes (ranks that existed continue theirs, new ranks start new ones).

Tokens per micro-step (batch_size * block_size) need not be a multiple of the FP4 Wgrad block
(16 or 32): fp4.py pads the token dimension with zero rows, which add nothing to dW.
"""
import ast
import builtins
import contextlib
import dataclasses
import datetime
import difflib
import json
import math
import os
import random
import sys
import time
import traceback
import types
from types import SimpleNamespace

import numpy as np
import torch

# -----------------------------------------------------------------------------
# default config values
# I/O
out_dir = "out"              # may name other keys: "out/moe_{recipe}"
init_from = "scratch"        # "scratch" or "resume" (from resume_from, default out_dir/ckpt.pt)
resume_from = ""
eval_interval = 250          # eval + checkpoint every this many iterations
eval_iters = 50              # batches per split per eval
eval_only = False
log_interval = 10
always_save_checkpoint = True  # else only when val loss improves
dry_run = False              # build and check everything, run one step, write nothing
# wandb (never online unless asked for)
wandb_log = False
wandb_mode = "offline"       # "offline", "online" or "disabled"
wandb_project = "nanofp4"
wandb_run_name = ""
# data
dataset = "shakespeare_char"  # prepared into data_dir/<dataset> on first use (data.DATASETS)
data_dir = "data"
dataset_input = ""           # or: build data_dir/<dataset> from these text files (comma-separated)
dataset_tokenizer = "char"   # ... with this tokenizer: "char" or "gpt2"
batch_size = 12              # per micro-step and per process
block_size = 256
gradient_accumulation_steps = 1  # global: divided among DDP processes
# model (see model.GPTConfig); vocab_size 0 = from the dataset's meta
vocab_size = 0
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.0
bias = False
mlp = "swiglu"               # "swiglu" or "gelu"
norm = "rmsnorm"             # "rmsnorm" or "layernorm"
pos_emb = "rope"             # "rope" or "learned"
mlp_hidden = 0               # 0 = the model's default (4d for gelu, 8d/3 for swiglu)
tie_embeddings = False
n_expert = 0                 # 0 = dense
top_k = 2
expert_hidden = 0            # 0 = the model's default (mlp hidden / top_k)
n_shared_expert = 0
moe_dense_layers = 0
router = "softmax"           # "softmax" or "sigmoid"
aux_loss_weight = 0.01
z_loss_weight = 0.001
router_bias_rate = 0.001     # aux-loss-free balancing step (sigmoid router)
# quantization: a recipe from fp4.RECIPES, plus ablation overrides (None = the preset's choice)
recipe = "bf16"
recipe_format = None         # e.g. "e2m1", "ufp4", "e1m2/32/e4m3"
recipe_rht = None            # "all", "none" or e.g. "fprop,wgrad"
recipe_sr_dy = None
recipe_rht_size = None
recipe_weight_2d = None
recipe_bf16_first = None
recipe_bf16_last = None
backend = "auto"             # fp4 backend: "auto", "torch" or "triton"
sr_bits = 8                  # random bits per stochastic-rounding draw in the Triton kernels: 8 or 16
# AdamW (fp32 master weights and states)
learning_rate = 6e-4
max_iters = 5000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0              # 0 = no clipping
# learning rate schedule: linear warmup, then "cosine", "wsd" (warmup-stable-decay) or "constant"
lr_schedule = "cosine"
warmup_iters = 100
lr_decay_iters = 0           # 0 = max_iters
min_lr = 6e-5
wsd_decay_frac = 0.2         # wsd: the last fraction of lr_decay_iters decays linearly to min_lr
# system
device = "auto"              # "auto" (cuda when present), "cpu", "cuda", "cuda:1"...
dtype = "auto"               # "auto" (bf16 autocast on GPU, fp32 on CPU), "bfloat16", "float32"
compile = False
compile_mode = "default"     # torch.compile mode; "reduce-overhead" replays CUDA graphs: no host cost per kernel
seed = 1337
peak_tflops = 989.0          # for MFU: dense bf16 peak of one H100/H200
# robustness
nonfinite_policy = "skip"    # NaN/Inf loss or grad norm: "skip" the step, or "stop"
max_nonfinite = 5            # stop after this many non-finite steps in a row
telemetry_interval = 0       # every N iters log alpha/SQNR of each quantized GEMM operand; 0 = off
final_sample_tokens = 0      # print a sample of this many tokens at the end
debug_nan_at_iter = -1       # test hook: make the loss NaN at this iteration...
debug_nan_iters = 1          # ... and the next ones, this many in all
debug_fail_rank = -1         # test hook: raise an exception on this rank...
debug_fail_at_iter = -1      # ... at this iteration
dist_timeout_s = 600         # DDP: a collective waiting longer than this fails instead of hanging
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items()
            if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))}
# keys whose default is None: the type a value must have otherwise
NULLABLE = dict(recipe_format=str, recipe_rht=str,
                recipe_sr_dy=bool, recipe_rht_size=int, recipe_weight_2d=bool,
                recipe_bf16_first=int, recipe_bf16_last=int)
CHOICES = dict(init_from=("scratch", "resume"), wandb_mode=("offline", "online", "disabled"),
               mlp=("swiglu", "gelu"), norm=("rmsnorm", "layernorm"), pos_emb=("rope", "learned"),
               router=("softmax", "sigmoid"), backend=("auto", "torch", "triton"), sr_bits=(8, 16),
               lr_schedule=("cosine", "wsd", "constant"), dtype=("auto", "bfloat16", "float32"),
               nonfinite_policy=("skip", "stop"),
               compile_mode=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay CUDA graphs
MODEL_KEYS = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "mlp",
              "norm", "pos_emb", "mlp_hidden", "tie_embeddings", "n_expert", "top_k",
              "expert_hidden", "n_shared_expert", "moe_dense_layers", "router", "aux_loss_weight",
              "z_loss_weight", "router_bias_rate")
RECIPE_KEYS = dict(recipe_format="fmt", recipe_rht="rht", recipe_sr_dy="sr_dy",
                   recipe_rht_size="rht_size", recipe_weight_2d="weight_2d",
                   recipe_bf16_first="bf16_first", recipe_bf16_last="bf16_last")

class ConfigError(ValueError):
    pass

class CheckpointError(RuntimeError):
    pass

class NonFiniteError(RuntimeError):
    pass

# -----------------------------------------------------------------------------
# config: defaults, then config files, then --key=value

def _set(cfg, defaults, key, value, source):
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else \
            "; the valid keys are the defaults at the top of the script"
        raise ConfigError(f"unknown config key {key!r} (from {source}){hint}")
    default = defaults[key]
    want = NULLABLE.get(key, type(default))
    if isinstance(default, float) and type(value) is int:
        value = float(value)
    ok = (value is None and key in NULLABLE) or (type(value) is want)
    if not ok:
        raise ConfigError(f"config key {key!r} (from {source}) must be {want.__name__}"
                          f"{' or None' if key in NULLABLE else ''}, got {type(value).__name__} "
                          f"{value!r}")
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"config key {key!r} (from {source}) must be one of {CHOICES[key]}, "
                          f"got {value!r}")
    cfg[key] = value

def _parse_value(raw, key, defaults):
    """--key=value: a Python literal (True, 3, 1e-3, None...), else the raw string."""
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw
    want = NULLABLE.get(key, type(defaults.get(key)))
    if want is str and value is not None and not isinstance(value, str):
        return raw  # --out_dir=2024 is the string "2024"
    return value

def get_config(argv=(), defaults=None):
    """The config dict from argv: config files (paths) and --key=value, applied in order, over
    `defaults` (train.py's by default; sample.py passes its own)."""
    defaults = DEFAULTS if defaults is None else defaults
    cfg = dict(defaults)
    for arg in argv:
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            if not eq and isinstance(defaults.get(key), bool):
                raw = "True"   # bare --flag
            elif not eq:
                raise ConfigError(f"expected --key=value, got {arg!r}")
            _set(cfg, defaults, key, _parse_value(raw, key, defaults), arg)
        else:
            if not os.path.isfile(arg):
                raise ConfigError(f"config file {arg!r} not found")
            root = os.path.dirname(os.path.abspath(__file__))
            if root not in sys.path:   # lets config files `from configs._x import *`
                sys.path.insert(0, root)
            ns = {"__file__": arg, "__name__": "__config__"}
            with open(arg) as f:
                exec(builtins.compile(f.read(), arg, "exec"), ns)  # `compile` is a key here
            for key, value in ns.items():
                if key.startswith("_") or isinstance(value, types.ModuleType) or callable(value):
                    continue
                _set(cfg, defaults, key, value, arg)
    if defaults is DEFAULTS:
        make_recipe_from(cfg)  # unknown recipe names and bad ablation values fail here
        if cfg["telemetry_interval"] and cfg["compile"] and cfg["compile_mode"] in GRAPH_MODES:
            raise ConfigError(f"telemetry_interval needs the layers' Python to run in every step, "
                              f"which a replayed CUDA graph (compile_mode={cfg['compile_mode']!r}) "
                              f"skips: use compile_mode='default', or telemetry_interval=0")
    return cfg

def make_recipe_from(cfg):
    import fp4
    overrides = {arg: cfg[key] for key, arg in RECIPE_KEYS.items() if cfg[key] not in (None, "")}
    try:
        return fp4.make_recipe(cfg["recipe"], **overrides)
    except ValueError as e:
        raise ConfigError(f"recipe: {e}") from None

def model_config(cfg, vocab):
    """GPTConfig from the config's model keys (None keeps the model's default)."""
    from model import GPTConfig
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    args = {k: cfg[k] for k in MODEL_KEYS if k in names and cfg[k] is not None}
    args["vocab_size"] = cfg["vocab_size"] or vocab
    if args["vocab_size"] < vocab:
        raise ConfigError(f"vocab_size={args['vocab_size']} is smaller than the dataset's {vocab}")
    try:
        return GPTConfig(**args)
    except ValueError as e:
        raise ConfigError(f"model config: {e}") from None

# -----------------------------------------------------------------------------
# learning rate schedule

def get_lr(it, c):
    total = c.lr_decay_iters or c.max_iters
    if it < c.warmup_iters:
        return c.learning_rate * (it + 1) / (c.warmup_iters + 1)
    if c.lr_schedule == "constant":
        return c.learning_rate
    if it >= total:
        return c.min_lr
    if c.lr_schedule == "wsd":  # stable at the peak, then a linear decay over the last fraction
        start = max(total - int(c.wsd_decay_frac * total), c.warmup_iters)
        if it < start:
            return c.learning_rate
        return c.learning_rate + (it - start) / max(total - start, 1) * (c.min_lr - c.learning_rate)
    ratio = (it - c.warmup_iters) / max(total - c.warmup_iters, 1)
    return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c.learning_rate - c.min_lr)

# -----------------------------------------------------------------------------
# checkpoints: atomic writes, clear errors on reading

def rng_state():
    return dict(python=random.getstate(), numpy=np.random.get_state(),
                torch=torch.get_rng_state(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

def set_rng_state(s):
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])

def prev_path(path):
    root, ext = os.path.splitext(path)
    return root + "_prev" + ext

def save_checkpoint(ckpt, path):
    """Write to a temp file, fsync, keep the old file as *_prev.pt, then rename into place:
    a crash at any moment leaves `path` either the old or the new complete checkpoint."""
    tmp, prev = path + ".tmp", prev_path(path)
    with open(tmp, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        try:   # a hard link keeps `path` in place the whole time
            if os.path.exists(prev + ".tmp"):
                os.remove(prev + ".tmp")
            os.link(path, prev + ".tmp")
            os.replace(prev + ".tmp", prev)
        except OSError:
            os.replace(path, prev)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)

CKPT_KEYS = ("model", "optimizer", "iter_num", "best_val_loss", "config", "model_args", "recipe")

def load_checkpoint(path, map_location="cpu"):
    """torch.load with errors that name the file and say what is wrong."""
    prev = prev_path(path)
    if not os.path.exists(path):
        if os.path.exists(prev):   # a crash between the two renames of save_checkpoint
            print(f"warning: {path} is missing; using the previous checkpoint {prev}")
            return load_checkpoint(prev, map_location)
        raise CheckpointError(f"no checkpoint at {path}; train with --init_from=scratch first")
    try:
        # our own files: they hold numpy/python RNG states, hence weights_only=False
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:
        hint = f"; the previous checkpoint {prev} may be good: --resume_from={prev}" \
            if os.path.exists(prev) and prev != path else ""
        raise CheckpointError(f"cannot read checkpoint {path} ({os.path.getsize(path)} bytes): "
                              f"it is truncated or corrupt ({type(e).__name__}: {e}){hint}") from e
    missing = [k for k in CKPT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a nanoFP4 checkpoint: missing {missing}")
    return ckpt, path

def check_compatible(ckpt, path, margs):
    """A checkpoint resumes only into the same model (regularization weights may change)."""
    theirs, ours = ckpt["model_args"], dataclasses.asdict(margs)
    free = ("dropout", "aux_loss_weight", "z_loss_weight", "router_bias_rate")
    diff = [f"{k}: {theirs.get(k)!r} in the checkpoint, {ours.get(k)!r} now"
            for k in sorted(set(theirs) | set(ours))
            if k not in free and theirs.get(k) != ours.get(k)]
    if diff:
        raise CheckpointError(f"{path} was written for a different model ({'; '.join(diff)}): "
                              f"resume with the config it was trained with, or start from scratch")

# -----------------------------------------------------------------------------
# helpers for the loop

def trim_log(path, iter_num):
    """On resume: drop the records a crashed run wrote after its checkpoint (and a line cut by a
    kill), so that log.jsonl reads as one uninterrupted run."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("iter", 0) < iter_num or (rec.get("type") == "eval" and rec["iter"] == iter_num):
                keep.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)

def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"

def all_finite(module):
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())

OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")

def telemetry_record(iter_num, summary):
    """One log record from fp4.probe_summary(): alpha and SQNR per GEMM operand, mean over
    layers, and alpha per layer."""
    ops = [op for op in OPERANDS if op in summary]
    mean = lambda op, i: sum(v[i] for v in summary[op].values()) / len(summary[op])  # noqa: E731
    num = lambda v, d: round(v, d) if math.isfinite(v) else None  # noqa: E731 (JSON: no NaN/inf)
    layers = {}
    for op in ops:
        for tag, (alpha, _) in summary[op].items():
            layers.setdefault(tag, {})[op] = num(alpha, 6)
    return dict(type="telemetry", iter=iter_num, alpha={op: num(mean(op, 0), 6) for op in ops},
                sqnr_db={op: num(mean(op, 1), 3) for op in ops}, layers=layers)

def moe_record(raw_model):
    stats = raw_model.moe_stats() if hasattr(raw_model, "moe_stats") else {}
    out = {}
    for k, v in stats.items():
        v = v.detach().float().cpu()
        out[k] = round(v.item(), 6) if v.numel() == 1 else [[round(x, 4) for x in row]
                                                           for row in v.reshape(v.shape[0], -1).tolist()]
    return out

# -----------------------------------------------------------------------------

def flat_grads(model):
    """Makes every parameter's .grad a view of one flat zeroed buffer (which it returns), so that
    backward accumulates into it in place and one collective reduces all gradients."""
    params = list(model.parameters())
    kinds = {(p.device, p.dtype) for p in params}
    if len(kinds) > 1:
        raise ValueError(f"flat_grads needs all parameters on one device in one dtype, got {kinds}")
    flat = torch.zeros(sum(p.numel() for p in params), device=params[0].device, dtype=params[0].dtype)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat

def main(argv=None):
    import fp4
    import data
    from data.loader import BinLoader
    from model import GPT

    cfg = get_config(sys.argv[1:] if argv is None else argv)
    cfg["out_dir"] = cfg["out_dir"].format(**cfg)
    c = SimpleNamespace(**cfg)
    fp4.set_backend(c.backend)
    if c.sr_bits != 8 or "kernels" in sys.modules:  # (also resets an earlier run's 16 in this process)
        import kernels  # the torch reference draws fp32 uniforms: sr_bits is the kernels' knob
        kernels.SR_BITS = c.sr_bits

    # processes and devices
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    master = rank == 0
    if c.gradient_accumulation_steps % world:
        raise ConfigError(f"gradient_accumulation_steps={c.gradient_accumulation_steps} must be a "
                          f"multiple of the number of processes ({world})")
    if c.device == "auto":
        c.device = "cuda" if torch.cuda.is_available() else "cpu"
    if ddp:   # torchrun: NCCL between GPUs, gloo between CPU processes
        import torch.distributed as dist
        if c.device.startswith("cuda"):
            c.device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(c.device)
        dist.init_process_group("nccl" if c.device.startswith("cuda") else "gloo",
                                timeout=datetime.timedelta(seconds=c.dist_timeout_s))
    accum = c.gradient_accumulation_steps // world
    device_type = "cuda" if c.device.startswith("cuda") else "cpu"
    if c.dtype == "auto":
        c.dtype = "bfloat16" if device_type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    ctx = contextlib.nullcontext() if c.dtype == "float32" else \
        torch.autocast(device_type, dtype=torch.bfloat16)
    tokens_per_iter = c.gradient_accumulation_steps * c.batch_size * c.block_size
    logf = wandb = None
    log = (lambda *a: print(*a, flush=True)) if master else (lambda *a: None)

    try:
        torch.set_flush_denormal(True)  # CPU: ops on denormal floats (tiny grads) are ~100x slower
        # data: prepared on first use; vocab_size from its meta
        data_path = os.path.join(c.data_dir, c.dataset)
        if not all(os.path.exists(os.path.join(data_path, f))
                   for f in ("train.bin", "val.bin", "meta.json")):
            if master:
                log(f"preparing dataset {c.dataset!r} in {data_path} (first use only)...")
                t = time.time()
                if c.dataset_input:
                    import data.prepare
                    data.prepare.prepare(c.dataset_input.split(","), data_path, c.dataset_tokenizer)
                else:
                    data.prepare_dataset(c.dataset, data_dir=c.data_dir)
                log(f"dataset prepared in {time.time() - t:.1f}s")
            if ddp:
                dist.barrier()
        meta = data.load_meta(data_path)
        recipe = make_recipe_from(cfg)
        margs = model_config(cfg, meta["vocab_size"])

        def loader(split, seed_):
            try:
                return BinLoader(data_path, split, c.block_size, c.batch_size, seed_,
                                 device=c.device, rank=rank, world_size=world)
            except ValueError as e:  # too short for one window, token ids >= vocab_size
                raise ConfigError(f"dataset {data_path} ({split}): {e}") from None

        train_loader = loader("train", c.seed)
        loader("val", c.seed)  # fail now, not at the first eval, if val.bin is too short

        # model: fp32 master weights, the recipe's linears
        random.seed(c.seed)
        np.random.seed(c.seed)
        torch.manual_seed(c.seed)
        try:
            raw_model = fp4.convert(GPT(margs), recipe)
        except ValueError as e:
            raise ConfigError(f"the model does not fit recipe {recipe.name!r}: {e}") from None
        raw_model.to(c.device)
        optimizer = raw_model.configure_optimizers(c.weight_decay, c.learning_rate,
                                                   (c.beta1, c.beta2), device_type)
        if ddp:   # same init everywhere; dropout and SR draw per-process streams from here on
            torch.manual_seed(c.seed + rank)
        if (c.batch_size * c.block_size) % 32 and recipe.quantized:
            log(f"note: {c.batch_size * c.block_size} tokens per micro-step are not a multiple of "
                f"the Wgrad block: fp4 pads them with zero rows")

        iter_num, best_val_loss, n_nonfinite = 0, float("inf"), 0
        ckpt_path = os.path.join(c.out_dir, "ckpt.pt")
        if c.init_from == "resume":
            ckpt, src = load_checkpoint(c.resume_from or ckpt_path)  # on the CPU: RNG states
            check_compatible(ckpt, src, margs)
            try:
                raw_model.load_state_dict(ckpt["model"])
                optimizer.load_state_dict(ckpt["optimizer"])
            except (RuntimeError, ValueError, KeyError) as e:
                raise CheckpointError(f"{src} does not fit this model/optimizer: {e}") from e
            iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
            n_nonfinite = ckpt.get("n_nonfinite", 0)
            if ckpt["recipe"] != recipe.name:
                log(f"note: {src} was trained with recipe {ckpt['recipe']!r}, continuing with "
                    f"{recipe.name!r}")
            old_bits = ckpt.get("config", {}).get("sr_bits", 8)
            if old_bits != c.sr_bits:
                log(f"note: {src} was trained with sr_bits={old_bits}, continuing with "
                    f"sr_bits={c.sr_bits}")
            old_world = ckpt.get("world_size", len(ckpt.get("rng", [])))
            if rank < old_world:   # this rank's streams continue where they were
                train_loader.load_state_dict(ckpt["loader"][rank])
                set_rng_state(ckpt["rng"][rank])
            elif old_world:   # a new rank: rank 0's host RNGs, fresh torch and data streams
                set_rng_state(ckpt["rng"][0])
                torch.manual_seed(int(np.random.SeedSequence([c.seed, rank, iter_num])
                                      .generate_state(1)[0]))
            if old_world != world:
                log(f"note: {src} was written by {old_world} process(es), now {world}: ranks "
                    f"below {min(old_world, world)} continue their data/RNG streams, the others "
                    f"start new ones, so the data order differs from an uninterrupted "
                    f"{old_world}-process run")
            log(f"resumed from {src} at iter {iter_num} (best val loss {best_val_loss:.4f})")
            del ckpt
            if master:
                trim_log(os.path.join(c.out_dir, "log.jsonl"), iter_num)
        start_iter = iter_num

        model = raw_model
        if c.compile:
            model = torch.compile(model, mode=c.compile_mode)
        graphs = c.compile and c.compile_mode in GRAPH_MODES and device_type == "cuda"
        # Under CUDA graphs and under DDP, the gradients are views of one flat buffer that stays
        # put and accumulates in place over the micro-steps. Graphs need them outside their
        # memory pool (a .grad taken from the pool would be overwritten by the next replay); DDP
        # all-reduces that buffer in one call after the last micro-step (no DDP wrapper, whose
        # hooks would run inside replayed graphs; the price is no overlap of that call with the
        # last backward, small next to a step of several micro-steps). A parameter with no
        # gradient in a step then gets AdamW's update of a zero grad; every parameter here gets one.
        flat_grad = flat_grads(raw_model) if graphs or ddp else None
        if ddp:   # rank 0's weights everywhere, whatever each process drew or loaded
            for t in list(raw_model.parameters()) + list(raw_model.buffers()):
                dist.broadcast(t.data, 0)
        def all_reduce_mean(t):   # gloo has no ReduceOp.AVG
            dist.all_reduce(t)
            t /= world

        flops_per_token = raw_model.estimate_flops_per_token()
        log(f"model: {raw_model.num_params() / 1e6:.2f}M params ({raw_model.active_params() / 1e6:.2f}M "
            f"active), recipe {recipe.name}, {world} process(es) on {c.device}, {c.dtype}, "
            f"{tokens_per_iter} tokens/iter")

        @torch.no_grad()
        def estimate_loss():
            """Mean CE loss over eval_iters fixed batches per split; leaves every RNG as it was."""
            out = {}
            model.eval()
            with torch.random.fork_rng(devices=[c.device] if device_type == "cuda" else []):
                for split in ("train", "val"):
                    ld = loader(split, c.seed + 1)
                    losses = torch.zeros(c.eval_iters, device=c.device)
                    for k in range(c.eval_iters):
                        x, y = ld.next_batch()
                        with ctx:
                            _, loss = raw_model(x, y)
                        losses[k] = loss   # in eval mode the model returns the CE alone
                    m = losses.mean()
                    if ddp:
                        all_reduce_mean(m)
                    out[split] = m.item()
            model.train()
            return out

        def checkpoint(iter_num):
            if not all_finite(raw_model):
                log(f"warning: non-finite weights at iter {iter_num}: not overwriting {ckpt_path}")
                return
            states = dict(rng=rng_state(), loader=train_loader.state_dict())
            gathered = [None] * world
            if ddp:
                dist.all_gather_object(gathered, states)
            else:
                gathered = [states]
            if master:
                save_checkpoint(dict(
                    model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
                    iter_num=iter_num, best_val_loss=best_val_loss, config=cfg,
                    model_args=dataclasses.asdict(margs), recipe=recipe.name,
                    recipe_spec=repr(recipe), meta=meta, n_nonfinite=n_nonfinite,
                    world_size=world, rng=[g["rng"] for g in gathered],
                    loader=[g["loader"] for g in gathered]), ckpt_path)
                log(f"saved checkpoint {ckpt_path} at iter {iter_num}")

        if master and not c.dry_run:
            os.makedirs(c.out_dir, exist_ok=True)
            logf = open(os.path.join(c.out_dir, "log.jsonl"), "a")
        if c.wandb_log and master and not c.dry_run:
            import wandb
            wandb.init(project=c.wandb_project, name=c.wandb_run_name or None, config=cfg,
                       mode=c.wandb_mode, dir=c.out_dir)

        def record(rec):
            if logf:
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
            if wandb:
                wandb.log({k: v for k, v in rec.items() if not isinstance(v, list)},
                          step=rec["iter"])

        def do_eval(iter_num):
            nonlocal best_val_loss
            losses = estimate_loss()
            log(f"eval iter {iter_num}: train loss {losses['train']:.4f}, val loss "
                f"{losses['val']:.4f}")
            record(dict(type="eval", iter=iter_num, train_loss=losses["train"],
                        val_loss=losses["val"]))
            improved = losses["val"] < best_val_loss
            best_val_loss = min(best_val_loss, losses["val"])
            if (improved or c.always_save_checkpoint) and iter_num > start_iter and not c.dry_run:
                checkpoint(iter_num)

        if c.eval_only:
            do_eval(iter_num)
            return best_val_loss

        # the training loop; a checkpoint is always taken at an iteration boundary
        t0, dt_avg, bad_in_row, last = time.time(), None, 0, {}
        t_start = t0
        while iter_num < c.max_iters:
            if iter_num % c.eval_interval == 0 and not c.dry_run and (
                    iter_num > start_iter or c.init_from == "scratch"):
                do_eval(iter_num)
                t0 = time.time()   # step timings leave the eval out
            lr = get_lr(iter_num, c)
            for group in optimizer.param_groups:
                group["lr"] = lr

            loss_sum = torch.zeros((), device=c.device)
            probing = c.telemetry_interval and iter_num % c.telemetry_interval == 0 and master
            probe = fp4.probe_alphas() if probing else contextlib.nullcontext()
            with probe as alphas:
                for _ in range(accum):
                    x, y = train_loader.next_batch()
                    if rank == c.debug_fail_rank and iter_num == c.debug_fail_at_iter:
                        raise RuntimeError(f"debug_fail_at_iter: rank {rank} fails at iter {iter_num}")
                    if graphs:  # a new replay may reuse the previous micro-step's buffers
                        torch.compiler.cudagraph_mark_step_begin()
                    with ctx:
                        _, loss = model(x, y)
                    if c.debug_nan_at_iter <= iter_num < c.debug_nan_at_iter + c.debug_nan_iters:
                        loss = loss * float("nan")
                    loss_sum += loss.detach()
                    (loss / accum).backward()
            if ddp:
                all_reduce_mean(loss_sum)
                all_reduce_mean(flat_grad)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                raw_model.parameters(), c.grad_clip if c.grad_clip > 0 else float("inf"))
            loss_val, norm_val = loss_sum.item() / accum, grad_norm.item()
            finite = math.isfinite(loss_val) and math.isfinite(norm_val)
            if finite:
                optimizer.step()
                if hasattr(raw_model, "update_router_bias"):
                    raw_model.update_router_bias(all_reduce=dist.all_reduce if ddp else None)
                bad_in_row = 0
            else:
                n_nonfinite += 1
                bad_in_row += 1
                record(dict(type="nonfinite", iter=iter_num, loss=loss_val, grad_norm=norm_val))
                log(f"iter {iter_num}: non-finite loss {loss_val} / grad norm {norm_val}: "
                    f"step skipped ({bad_in_row} in a row, {n_nonfinite} in all)")
                if c.nonfinite_policy == "stop" or bad_in_row >= c.max_nonfinite:
                    kept = f"the last good checkpoint is {ckpt_path}" if os.path.exists(ckpt_path) \
                        else "no checkpoint was written yet"
                    raise NonFiniteError(
                        f"stopping at iter {iter_num}: {bad_in_row} non-finite step(s) in a row "
                        f"(policy {c.nonfinite_policy!r}, max_nonfinite={c.max_nonfinite}); {kept}")
            optimizer.zero_grad(set_to_none=flat_grad is None)
            if probing and alphas:
                tel = telemetry_record(iter_num, fp4.probe_summary(alphas))
                record(tel)
                log(f"iter {iter_num} alpha | " + " ".join(
                    f"{k} {'-' if v is None else f'{v:.4f}'}" for k, v in tel["alpha"].items()))
            if c.dry_run:
                log(f"dry run: one step done, loss {loss_val:.4f}; nothing written")
                return loss_val

            t1 = time.time()
            dt, t0 = t1 - t0, t1
            iter_num += 1
            if iter_num - start_iter > 1:   # the first step includes warm-up work
                dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
            if (iter_num - 1) % c.log_interval == 0 or iter_num == c.max_iters:
                step = dt_avg or dt
                tok_s = tokens_per_iter / step
                mfu = flops_per_token * tok_s / (c.peak_tflops * 1e12 * world)
                rec = dict(type="train", iter=iter_num - 1, loss=loss_val, lr=lr,
                           grad_norm=norm_val, dt_ms=dt * 1000, tok_per_s=tok_s, mfu=mfu,
                           elapsed_s=t1 - t_start)
                rec.update(moe_record(raw_model))
                record(rec)
                last = rec
                log(f"iter {iter_num - 1} | loss {loss_val:.4f} | lr {lr:.2e} | {dt * 1000:.0f} ms | "
                    f"{tok_s:,.0f} tok/s | MFU {100 * mfu:.2f}% | "
                    f"ETA {fmt_time((c.max_iters - iter_num) * step)}")
        if iter_num > start_iter:
            do_eval(iter_num)
        else:
            log(f"nothing to train: at iter {iter_num}, max_iters={c.max_iters}")
        if c.final_sample_tokens and master:
            from sample import decoder
            first = meta["stoi"].get("\n", 0) if meta["tokenizer"] == "char" else meta.get("eot_token", 0)
            x = torch.full((1, 1), first, dtype=torch.long, device=c.device)
            raw_model.eval()
            with ctx:
                out = raw_model.generate(x, c.final_sample_tokens, temperature=0.8, top_k=200)
            log("sample:\n" + decoder(meta)(out[0].tolist()))
        return last.get("loss")
    finally:
        if logf:
            logf.close()
        if wandb:
            wandb.finish()
        if ddp:
            dist.destroy_process_group()
        # torch's default: leave the process as we found it. Only this thread's flag can be reset:
        # torch's worker threads that this run created inherited the flag and keep flushing
        # subnormals in later parallel CPU ops of this process.
        torch.set_flush_denormal(False)

def _exit(code):
    """Under torchrun, leave without finalizing the interpreter: gloo's worker threads can outlive
    destroy_process_group(), and a gloo worker thread that frees a finished
    collective's tensors during interpreter shutdown is ended by CPython, which aborts the rank
    ("terminate called without an active exception") after a run that succeeded. main() has
    closed and fsynced everything it wrote."""
    if "RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CheckpointError, NonFiniteError) as e:
        print(f"error: {e}", file=sys.stderr)
        _exit(1)
    except Exception:   # e.g. a collective timeout: its traceback, then the same clean exit
        traceback.print_exc()
        _exit(1)
    _exit(0)
