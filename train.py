"""
train.py: train a GPT or MoE with a 4-bit (FP4) recipe, on one CPU/GPU or several GPUs (DDP).

    python train.py configs/moe_ufp4.py                          # one process
    python train.py configs/moe_ufp4.py --recipe=e2m1 --max_iters=100
    torchrun --standalone --nproc_per_node=8 train.py configs/gpu/gpt2_small_ufp4.py
    python train.py configs/moe_ufp4.py --init_from=resume       # continue from out_dir/ckpt.pt
    python train.py --init_from=hf:DIR --dataset=... --recipe=ufp4  # fine-tune a HF Llama/GPT-2
    torchrun --standalone --nproc_per_node=8 train.py CONFIG --fsdp=True  # FSDP2-sharded
    python train.py --help                                       # every config key

Config: the defaults below, then config files (plain Python that assigns some of these names),
then --key=value (checked against the default's type and range before anything starts).

Outputs in out_dir, by rank 0 alone: ckpt.pt (the latest healthy checkpoint, written atomically;
the one before is kept as ckpt_prev.pt), ckpt_best.pt (the lowest val loss), model.safetensors
(ckpt.pt's weights alone, for hf.py and other frameworks), log.jsonl (one JSON record per logged
step and per eval), log.png (plot.py's picture of it, at the end) and, while the run lives,
`lock`. A run owns its out_dir: a scratch run into a folder that holds a run stops
(--overwrite=True replaces it), and so do a second live run and a resume from an older
checkpoint of the folder's own run (ckpt_best.pt) that would replace its later ckpt.pt
(--overwrite=True goes back). No checkpoint is written from a non-finite val loss or inside a
streak of non-finite steps (see checkpoint.py for the checksum and the rotation).

A checkpoint resumes on any number of processes; on the same number it continues every rank's
data and RNG streams exactly, on another number the data order changes (ranks that existed
continue theirs, new ranks start new ones). `--init_from=resume --resume_from=OTHER/ckpt.pt
--out_dir=NEW` forks another run's checkpoint into a new folder, leaving that run as it was.

Several processes keep a full copy of the model each and all-reduce one flat gradient buffer; with
fsdp=True (parallel.py) each block's weights, gradients and AdamW states are sharded instead (the
same steps; one process works too, e.g. to compare). Checkpoints hold full tensors either way, so
a run resumes with or without fsdp.

Tokens per micro-step (batch_size * block_size) need not be a multiple of the FP4 Wgrad block
(16 or 32): fp4.py pads the token dimension with zero rows, which add nothing to dW.
"""
import contextlib
import dataclasses
import datetime
import functools
import importlib
import json
import math
import os
import random
import re
import sys
import time
import traceback
from types import SimpleNamespace

import numpy as np
import torch

import data
import data.loader
import data.prepare
import fp4
import hf
import parallel
from checkpoint import (BEST, LATEST, LOG, PREVIOUS_LOG, RECIPE_KEYS, WEIGHTS, CheckpointError,
                        check_rewind, claim_out_dir, data_changes, in_folder, load_checkpoint,
                        lock_out_dir, make_recipe_from, recipe_misfit, remove_run_files, rng_state,
                        save_checkpoint, set_rng_state, unlock_out_dir)
from configurator import (ConfigError, check_backend, check_device, check_ranges, defaults_of,
                          help_text, parse, wants_help)
from data.common import decoder, sha256_file
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
# default config values
# I/O
out_dir = "out"              # may name other keys: "out/moe_{recipe}"
init_from = "scratch"        # "scratch", "resume" (resume_from) or "hf:DIR" (a local HF Llama/GPT-2 model)
resume_from = ""             # the checkpoint to resume from ("" = out_dir/ckpt.pt)
eval_interval = 250          # eval + checkpoint every this many iterations
eval_iters = 50              # batches per split per eval
eval_only = False            # evaluate once (the checkpoint with init_from=resume), print, write nothing
log_interval = 10            # log the training loss every this many iterations
always_save_checkpoint = True  # else only when val loss improves
checkpoint = True              # False: write no checkpoint at all (benchmarks)
overwrite = False            # a scratch run may replace out_dir's run; a resume may go back in it
dry_run = False              # build and check everything, run one step, write nothing
# wandb (never online unless asked for: by this key or the WANDB_MODE environment variable)
wandb_log = False            # log to Weights & Biases
wandb_mode = ""              # "" = $WANDB_MODE, else "offline"; or "offline", "online", "disabled"
wandb_project = ""           # "" = $WANDB_PROJECT, else "nanofp4"
wandb_run_name = ""          # wandb run name ("" = wandb's own)
# data
dataset = "shakespeare_char"  # prepared into data_dir/<dataset> on first use (data.DATASETS)
data_dir = "data"            # the folder that holds the prepared datasets
dataset_input = ""           # or: build data_dir/<dataset> from these text files (comma-separated)
dataset_tokenizer = ""       # ... with this tokenizer: "char" ("" too) or "gpt2"
batch_size = 12              # sequences per micro-step and per process
block_size = 256             # context length in tokens
gradient_accumulation_steps = 1  # micro-steps per iteration, global: divided among DDP processes
# model (see model.GPTConfig); vocab_size 0 = from the dataset's meta
vocab_size = 0               # 0 = the dataset's vocabulary size
n_layer = 6                  # transformer blocks
n_head = 6                   # attention heads
n_embd = 384                 # model width
dropout = 0.0                # dropout probability (0 = off)
bias = False                 # biases in the linears and norms
mlp = "swiglu"               # "swiglu" or "gelu"
norm = "rmsnorm"             # "rmsnorm" or "layernorm"
pos_emb = "rope"             # "rope" or "learned"
mlp_hidden = 0               # 0 = the model's default (4d for gelu, 8d/3 for swiglu)
tie_embeddings = False       # share the token embedding with the output head
n_expert = 0                 # 0 = dense
top_k = 2                    # experts per token (MoE)
expert_hidden = 0            # 0 = the model's default (mlp hidden / top_k)
n_shared_expert = 0          # dense experts every token goes through (MoE)
moe_dense_layers = 0         # the first this many blocks keep a dense MLP (MoE)
router = "softmax"           # "softmax" or "sigmoid"
aux_loss_weight = 0.01       # load-balancing loss weight (MoE)
z_loss_weight = 0.001        # router z-loss weight (MoE)
router_bias_rate = 0.001     # aux-loss-free balancing step (sigmoid router)
loss_chunk = 4096            # tokens per chunk of lm_head + loss in training (0: whole logits)
# quantization: a recipe from fp4.RECIPES, plus ablation overrides (None = the preset's choice)
recipe = "bf16"              # "bf16", "ufp4", "e2m1", "nvfp4", "mxfp4", "mxint4" (fp4.RECIPES)
recipe_format = None         # e.g. "e2m1", "ufp4", "e1m2/32/e4m3"
recipe_rht = None            # "all", "none" or e.g. "fprop,wgrad"
recipe_sr_dy = None          # stochastic rounding of the gradients dy
recipe_rht_size = None       # Hadamard transform size
recipe_weight_2d = None      # 2D (16x16) scale blocks for the weights
recipe_bf16_first = None     # the first this many blocks stay in bf16
recipe_bf16_last = None      # the last this many blocks stay in bf16
recipe_fp8_gemm = None       # True: power-of-two-scaled formats run FP8 GEMMs (opt-in; default bf16)
recipe_fp8_fast_accum = None # FP8 GEMMs in fast accumulation ("all", "none", "fprop/dgrad": the default)
recipe_fp8_wgrad_x = None    # FP8 GEMMs keep Wgrad's x "packed" (the default) or as "fp8" (faster, more memory)
recipe_fp8_x_scale = None    # FP8 GEMMs scale Fprop's x by its "amax" (the default) or at "unit" scale (faster)
recipe_fp8_weight_cache = None  # FP8 GEMMs cache each weight's operands as "fp8" (the default) or "packed" (less memory)
recipe_fp8_dy_scale = None   # FP8 GEMMs scale dy by its "amax" in every call (the default) or once per "step" (faster;
                             # warm-up finds it in every micro-step)
recipe_fp8_step_room = None  # under "step": binades of room above the kept amax (6 by default; at most 10 with RHT 16)
backend = "auto"             # fp4 backend: "auto", "torch" or "triton"
sr_bits = 8                  # random bits per stochastic-rounding draw in the Triton kernels: 8 or 16
# AdamW (fp32 master weights and states)
learning_rate = 6e-4         # peak learning rate
max_iters = 5000             # iterations in all
weight_decay = 0.1           # AdamW weight decay (matrices only)
beta1 = 0.9                  # AdamW beta1
beta2 = 0.95                 # AdamW beta2
grad_clip = 1.0              # 0 = no clipping
# learning rate schedule: linear warmup, then "cosine", "wsd" (warmup-stable-decay) or "constant"
lr_schedule = "cosine"       # "cosine", "wsd" or "constant"
warmup_iters = 100           # linear warmup iterations
lr_decay_iters = 0           # 0 = max_iters
min_lr = 6e-5                # the learning rate at the end of the decay
wsd_decay_frac = 0.2         # wsd: the last fraction of lr_decay_iters decays linearly to min_lr
# system
device = "auto"              # "auto" (cuda when present), "cpu", "cuda", "cuda:1"...
dtype = "auto"               # "auto" (bf16 autocast on GPU, fp32 on CPU), "bfloat16", "float32"
compile = False              # torch.compile the model
compile_mode = "default"     # torch.compile mode; "reduce-overhead" replays CUDA graphs: no host cost per kernel
seed = 1337                  # seeds the model init, the data order and the SR draws
peak_tflops = 0.0            # for MFU: one device's dense bf16 peak (0 = known GPUs' own; none: no MFU)
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
fsdp = False                 # FSDP2: shard weights, grads, AdamW states per block (not one copy each)
plot = True                  # write out_dir/log.png from log.jsonl at the end of a run
# -----------------------------------------------------------------------------
DEFAULTS = defaults_of(globals())
# keys whose default is None: the type a value must have otherwise
NULLABLE = dict(recipe_format=str, recipe_rht=str,
                recipe_sr_dy=bool, recipe_rht_size=int, recipe_weight_2d=bool,
                recipe_bf16_first=int, recipe_bf16_last=int, recipe_fp8_gemm=bool,
                recipe_fp8_fast_accum=str, recipe_fp8_wgrad_x=str, recipe_fp8_x_scale=str,
                recipe_fp8_weight_cache=str, recipe_fp8_dy_scale=str, recipe_fp8_step_room=int)
CHOICES = dict(wandb_mode=("", "offline", "online", "disabled"),
               mlp=("swiglu", "gelu"), norm=("rmsnorm", "layernorm"), pos_emb=("rope", "learned"),
               router=("softmax", "sigmoid"), backend=("auto", "torch", "triton"), sr_bits=(8, 16),
               lr_schedule=("cosine", "wsd", "constant"), dtype=("auto", "bfloat16", "float32"),
               nonfinite_policy=("skip", "stop"), dataset_tokenizer=("", "char", "gpt2"),
               compile_mode=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay CUDA graphs
# dense bf16 peak TFLOPS of one GPU (vendor datasheets, without sparsity), by name: for MFU
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
               ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0))
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(GPTConfig))
# on resume, the model, its data, its recipe and its training schedule come from the checkpoint
# unless given (how this process runs them, e.g. device, compile or fsdp, does not)
FROM_CHECKPOINT = tuple(k for k in MODEL_KEYS if k in DEFAULTS) + (
    "dataset", "data_dir", "dataset_tokenizer", "recipe", "sr_bits") + tuple(RECIPE_KEYS) + (
    "batch_size", "gradient_accumulation_steps", "learning_rate", "max_iters", "weight_decay",
    "beta1", "beta2", "grad_clip", "lr_schedule", "warmup_iters", "lr_decay_iters", "min_lr",
    "wsd_decay_frac", "seed", "eval_interval", "eval_iters", "log_interval", "nonfinite_policy",
    "max_nonfinite", "telemetry_interval", "always_save_checkpoint")
FP32_MAX = float(torch.finfo(torch.float32).max)
_positive, _non_negative = (lambda v: v > 0, "> 0"), (lambda v: v >= 0, ">= 0")
_unit = (lambda v: 0 <= v < 1, "in [0, 1)")
RANGES = dict(  # checked before anything starts; GPTConfig and fp4.make_recipe check the rest
    eval_interval=_positive, eval_iters=_positive, log_interval=_positive,
    batch_size=_positive, block_size=_positive, gradient_accumulation_steps=_positive,
    vocab_size=_non_negative, n_layer=_positive, n_head=_positive, n_embd=_positive,
    dropout=_unit, mlp_hidden=_non_negative, n_expert=_non_negative, top_k=_positive,
    expert_hidden=_non_negative, n_shared_expert=_non_negative, moe_dense_layers=_non_negative,
    aux_loss_weight=_non_negative, z_loss_weight=_non_negative, router_bias_rate=_non_negative,
    recipe_rht_size=_positive, recipe_bf16_first=_non_negative, recipe_bf16_last=_non_negative,
    learning_rate=(lambda v: 0 < v <= FP32_MAX, f"> 0 and at most float32's {FP32_MAX:.3g}"),
    min_lr=(lambda v: 0 <= v <= FP32_MAX, f">= 0 and at most float32's {FP32_MAX:.3g}"),
    max_iters=_non_negative, weight_decay=_non_negative, beta1=_unit, beta2=_unit,
    grad_clip=(_non_negative[0], ">= 0 (0 = no clipping)"), warmup_iters=_non_negative,
    lr_decay_iters=_non_negative, wsd_decay_frac=(lambda v: 0 <= v <= 1, "in [0, 1]"),
    seed=(lambda v: 0 <= v < 2**32, "in [0, 2^32) (numpy's seed range)"), peak_tflops=_non_negative,
    max_nonfinite=_positive, telemetry_interval=_non_negative,
    final_sample_tokens=_non_negative, debug_nan_iters=_positive, dist_timeout_s=_positive)


class NonFiniteError(RuntimeError):
    pass


class PeerFailed(RuntimeError):
    """Another rank failed and printed its error: this rank stops with one line."""

# -----------------------------------------------------------------------------
# config: defaults, then config files, then --key=value


def get_config(argv=()):
    """The config dict from argv (config files and --key=value, in order), checked."""
    cfg, _ = parse(argv, DEFAULTS, NULLABLE, CHOICES)
    check_config(cfg)
    return cfg


def spec_args(spec):
    """A recipe spec as bench.py and the scripts take it, a recipe name then train.py overrides
    after '+' (mxfp4+recipe_fp8_gemm=True), as (--recipe=name, [the overrides as --key=value])."""
    name, *own = spec.split("+")
    return f"--recipe={name}", [f"--{kv}" for kv in own]


def recipe_from_spec(config, spec):
    """The fp4 recipe of a recipe spec (spec_args) for a config file."""
    recipe, own = spec_args(spec)
    return make_recipe_from(get_config([config, recipe, *own]))


def gpu_script_setup(config, specs, script):
    """A GPU measuring script's config and {spec: recipe} for a comma list of recipe specs; a
    bad config or recipe, or no CUDA GPU, ends it with one line."""
    try:
        cfg = get_config([config])
        recipes = {r: recipe_from_spec(config, r) for r in specs.split(",")}
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if not torch.cuda.is_available():
        sys.exit(f"error: {script} measures CUDA kernels and needs a CUDA GPU; none is visible")
    return cfg, recipes


def check_config(cfg):
    """Every value in its range, the device present, the combinations possible: before
    anything starts, one line for the first problem found."""
    check_ranges(cfg, RANGES)
    for key in ("recipe_bf16_first", "recipe_bf16_last"):
        if (cfg[key] or 0) > cfg["n_layer"]:
            raise ConfigError(f"{key}={cfg[key]} is more blocks than n_layer={cfg['n_layer']}")
    check_device(cfg["device"])
    check_backend(cfg["backend"], cfg["device"])
    init = cfg["init_from"]
    if init not in ("scratch", "resume") and not (init.startswith("hf:") and init[3:]):
        raise ConfigError(f"init_from={init!r}: use 'scratch', 'resume' or 'hf:DIR' (a local "
                          f"Hugging Face model directory)")
    if init.startswith("hf:") and not os.path.isfile(os.path.join(init[3:], "config.json")):
        raise ConfigError(f"init_from={init!r}: {init[3:]} holds no config.json: name a local "
                          f"Hugging Face model directory")
    if cfg["resume_from"] and init != "resume":
        raise ConfigError(f"resume_from={cfg['resume_from']!r} is read only with --init_from=resume "
                          f"(init_from is {init!r}): add that, or drop --resume_from")
    recipe = make_recipe_from(cfg)  # unknown recipe names and bad ablation values fail here
    if not init.startswith("hf:"):   # (an HF model's shape comes from its directory)
        check_model_fits(cfg, recipe)
    if cfg["eval_only"] and init == "scratch":
        raise ConfigError("eval_only=True would evaluate a freshly initialized model: add "
                          "--init_from=resume (out_dir's ckpt.pt, or --resume_from=PATH)")
    if cfg["min_lr"] > cfg["learning_rate"] and cfg["lr_schedule"] != "constant":
        raise ConfigError(f"min_lr={cfg['min_lr']} is above learning_rate={cfg['learning_rate']}: "
                          f"the decay would raise the learning rate")
    if 0 < cfg["lr_decay_iters"] <= cfg["warmup_iters"] and cfg["lr_schedule"] != "constant":
        raise ConfigError(f"lr_decay_iters={cfg['lr_decay_iters']} is not past warmup_iters="
                          f"{cfg['warmup_iters']}: the learning rate would drop to min_lr right "
                          f"after warmup; raise lr_decay_iters (0 = max_iters) or lower warmup_iters")
    if cfg["lr_schedule"] != "wsd" and cfg["wsd_decay_frac"] != DEFAULTS["wsd_decay_frac"]:
        raise ConfigError(f"wsd_decay_frac={cfg['wsd_decay_frac']} is read only with lr_schedule="
                          f"'wsd' (it is {cfg['lr_schedule']!r}): add --lr_schedule=wsd, or drop it")
    if not cfg["wandb_log"]:
        for key in ("wandb_mode", "wandb_project", "wandb_run_name"):
            if cfg[key] != DEFAULTS[key]:
                raise ConfigError(f"{key}={cfg[key]!r} is read only with wandb_log=True (it is "
                                  f"False): add --wandb_log=True, or drop {key} (--{key}= on the "
                                  f"command line clears a config file's)")
    if not cfg["dataset"] or os.path.basename(cfg["dataset"]) != cfg["dataset"] \
            or cfg["dataset"] in (".", ".."):
        raise ConfigError(f"dataset={cfg['dataset']!r} must be a plain name (a folder under "
                          f"data_dir): use --data_dir for another place")
    if cfg["fsdp"] and cfg["compile"] and cfg["compile_mode"] in GRAPH_MODES:
        raise ConfigError(f"fsdp=True does not run under CUDA graphs (compile_mode="
                          f"{cfg['compile_mode']!r}): FSDP2 gathers and frees weights in hooks "
                          f"that a replayed graph skips; use compile_mode='default'")
    if cfg["telemetry_interval"] and cfg["compile"] and cfg["compile_mode"] in GRAPH_MODES:
        raise ConfigError(f"telemetry_interval needs the layers' Python to run in every step, "
                          f"which a replayed CUDA graph (compile_mode={cfg['compile_mode']!r}) "
                          f"skips: use compile_mode='default', or telemetry_interval=0")
    formatted_out_dir(cfg)


def recipe_variant(cfg):
    """'' for a recipe as its preset is, else '_' and each override (recipe_rht=wgrad ->
    '_rht-wgrad'): out_dir's {variant}, so that a config's ablation arms get folders of their own."""
    return "".join(f"_{k[len('recipe_'):]}-" + re.sub(r"[^\w.+-]", "-", str(v))
                   for k, v in cfg.items() if k in RECIPE_KEYS and v is not None)


def formatted_out_dir(cfg):
    """out_dir with its {key} templates filled in from the config ({variant}: recipe_variant);
    a one-line error if it is not such a template or comes out empty."""
    try:
        out_dir = cfg["out_dir"].format(**cfg, variant=recipe_variant(cfg))
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"out_dir={cfg['out_dir']!r} is not a template of config keys "
                          f"({type(e).__name__}: {e}): write e.g. 'out/run_{{recipe}}'") from None
    if not out_dir.strip():
        raise ConfigError("out_dir is empty: name the folder for the checkpoints and log, "
                          "e.g. --out_dir=out/run")
    return out_dir


def configure(argv):
    """(config, (checkpoint, its path) or None). On resume, the keys of FROM_CHECKPOINT that no
    config file or --key=value sets come from the checkpoint's config, so a run resumes (or is
    evaluated) from its checkpoint alone; the keys given still win, and are checked."""
    cfg, given = parse(argv, DEFAULTS, NULLABLE, CHOICES)
    if cfg["init_from"] != "resume":
        check_config(cfg)
        cfg["out_dir"] = formatted_out_dir(cfg)
        return cfg, None
    cfg["out_dir"] = formatted_out_dir(cfg)   # the rest is checked once the checkpoint's keys are in
    ckpt, src = load_checkpoint(cfg["resume_from"] or os.path.join(cfg["out_dir"], LATEST))
    if not (cfg["dry_run"] or cfg["eval_only"]):   # (these write nothing)
        check_rewind(src, ckpt["iter_num"], cfg["out_dir"], cfg["overwrite"])
    stored = ckpt["config"]
    # a fork into another recipe leaves the old recipe's ablation keys behind
    other_recipe = "recipe" in given and cfg["recipe"] != stored.get("recipe")
    # (the tokenizer matters only to a build from --dataset_input; without one it is checked)
    taken = {k: stored[k] for k in FROM_CHECKPOINT
             if k not in given and k in stored and stored[k] != cfg[k]
             and not (other_recipe and k in RECIPE_KEYS)
             and (k != "dataset_tokenizer" or cfg["dataset_input"])}
    cfg.update(taken)
    if taken and int(os.environ.get("RANK", 0)) == 0:
        print(f"from {src}: " + ", ".join(f"{k}={v!r}" for k, v in taken.items()), flush=True)
    try:
        check_config(cfg)
    except ConfigError as e:
        if not taken:
            raise
        raise ConfigError(f"{e} (with {', '.join(taken)} taken from {src}: give a key on the "
                          f"command line to override it)") from None
    return cfg, (ckpt, src)


def model_config(cfg, vocab, fixed=None):
    """GPTConfig from the config's model keys (those the config lacks keep the model's default);
    `fixed`: model args that win over the config (a Hugging Face directory's, or a checkpoint's
    args that are no config key, e.g. rope_theta)."""
    args = {k: cfg[k] for k in MODEL_KEYS if cfg.get(k) is not None}
    args.update(fixed or {})
    args["vocab_size"] = cfg["vocab_size"] or vocab
    if args["vocab_size"] < vocab:
        raise ConfigError(f"vocab_size={args['vocab_size']} is smaller than the dataset's {vocab}")
    try:
        return GPTConfig(**args)
    except ValueError as e:
        raise ConfigError(f"model config: {e}") from None


def check_model_fits(cfg, recipe):
    """The model the config describes is valid and its widths fit the recipe's blocks, before
    any data or weights; no quantized layer sees the vocabulary, so an unknown one (0: the
    dataset's) stands in as 1."""
    why = recipe_misfit(model_config(cfg, cfg["vocab_size"] or 1), recipe)
    if why:
        raise ConfigError(f"the model does not fit recipe {recipe.name!r}: {why}")


def set_sr_bits(bits):
    """The random bits per stochastic-rounding draw of the Triton kernels (the torch reference
    draws fp32 uniforms); also puts back 8 after an earlier run's 16 in this process."""
    try:
        fp4.set_sr_bits(bits)
    except ValueError as e:
        raise ConfigError(str(e)) from None

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
# the run: processes and devices, its output files


class Run:
    """What one training run holds: its config, processes, model, data, counters and outputs.
    The functions below fill it in (setup_*, resume) and advance it (train_step, evaluate)."""

    def __init__(self, cfg):
        self.cfg, self.c = cfg, SimpleNamespace(**cfg)
        self.logf = self.wandb = self.lock = None
        self.claim = [], []   # take_out_dir: (files --overwrite=True replaces, files kept aside)
        self.iter_num, self.best_val_loss, self.n_nonfinite, self.bad_in_row = 0, float("inf"), 0, 0
        self.ckpt_path = os.path.join(self.c.out_dir, LATEST)
        self.writes = not (self.c.dry_run or self.c.eval_only)   # into out_dir
        self.healthy = None   # (path, iter, val loss) of the last checkpoint known good
        self.moe_stats = {}   # the MoE's stats of the last logged step (forward_backward)
        self.resumed = None   # (checkpoint, its path) to resume from, until resume() takes it
        self.ddp = self.own_group = False
        self.weight_cache = None   # fp4.WeightCache, from the first cache_weights(run)

    def log(self, *msg):
        if self.master:
            print(*msg, flush=True)

    def record(self, rec):
        """One record into log.jsonl (and wandb)."""
        if self.logf:
            self.logf.write(json.dumps(rec) + "\n")
            self.logf.flush()
        if self.wandb:
            self.wandb.log(wandb_metrics(rec), step=rec["iter"])

    def close(self):
        if self.logf:
            self.logf.close()
        if self.wandb:
            self.wandb.finish()
        if self.lock:
            unlock_out_dir(self.lock, self.c.out_dir)
        if self.ddp or self.own_group:
            torch.distributed.destroy_process_group()

    def all_reduce_mean(self, t):   # gloo has no ReduceOp.AVG
        torch.distributed.all_reduce(t)
        t /= self.world


def setup_processes(run):
    """DDP from torchrun's environment, the device, and the dtype's autocast context."""
    c = run.c
    run.ddp = int(os.environ.get("RANK", -1)) != -1
    run.rank, run.world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if run.ddp \
        else (0, 1)
    run.master = run.rank == 0
    if c.gradient_accumulation_steps % run.world:
        raise ConfigError(f"gradient_accumulation_steps={c.gradient_accumulation_steps} must be a "
                          f"multiple of the number of processes ({run.world})")
    if c.device == "auto":
        c.device = "cuda" if torch.cuda.is_available() else "cpu"
    if run.ddp:   # torchrun: NCCL between GPUs, gloo between CPU processes
        if c.device.startswith("cuda"):
            c.device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(c.device)
        torch.distributed.init_process_group(
            "nccl" if c.device.startswith("cuda") else "gloo",
            timeout=datetime.timedelta(seconds=c.dist_timeout_s))
        # the others wait for rank 0 to prepare the dataset: as long as that takes, not
        # dist_timeout_s (which is for a rank that hangs in training)
        run.prep_group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(days=1))
    elif c.device.startswith("cuda:"):   # its generator is the one checkpoints save (rng_state)
        torch.cuda.set_device(c.device)
    if not run.ddp and c.fsdp:   # one process without torchrun: FSDP2 needs a (one-rank) process group
        torch.distributed.init_process_group(
            "nccl" if c.device.startswith("cuda") else "gloo", store=torch.distributed.HashStore(),
            rank=0, world_size=1)
        run.own_group = True
    run.accum = c.gradient_accumulation_steps // run.world
    run.device_type = "cuda" if c.device.startswith("cuda") else "cpu"
    if c.dtype == "auto":
        c.dtype = "bfloat16" if run.device_type == "cuda" and torch.cuda.is_bf16_supported() \
            else "float32"
    run.ctx = contextlib.nullcontext() if c.dtype == "float32" else \
        torch.autocast(run.device_type, dtype=torch.bfloat16)
    run.tokens_per_iter = c.gradient_accumulation_steps * c.batch_size * c.block_size


def take_out_dir(run):
    """Rank 0 locks out_dir and checks that this run may write there (a dry run checks only;
    eval_only, which writes nothing, neither: it may evaluate a checkpoint of a live run). What
    --overwrite=True replaces goes only in clear_out_dir, once data and model are set up."""
    c = run.c
    if not run.master or c.eval_only:
        return
    if run.writes:
        run.lock = lock_out_dir(c.out_dir)
    run.claim = claim_out_dir(c.out_dir, "resume" if c.init_from == "resume" else "scratch",
                              c.resume_from, c.overwrite)


def clear_out_dir(run):
    """The earlier run's files that --overwrite=True replaces, removed now that every check of
    this run has passed (a bad dataset or model stops it with that run intact)."""
    c = run.c
    if not run.master or c.eval_only or not run.writes:
        return
    replaced, aside = run.claim
    if replaced:
        remove_run_files(c.out_dir, replaced)
        run.log(f"note: --overwrite=True: removed the earlier run's {', '.join(replaced)} "
                f"from {c.out_dir}")
    if aside:   # the log of a run that saved no checkpoint: nothing to resume, kept for reading
        os.replace(os.path.join(c.out_dir, LOG), os.path.join(c.out_dir, PREVIOUS_LOG))
        run.log(f"note: {c.out_dir} held only the log of a run without a checkpoint: kept as "
                f"{PREVIOUS_LOG}, starting afresh")


def open_outputs(run):
    """log.jsonl (appended to) and wandb, on rank 0 and not in a dry run."""
    c = run.c
    if not run.master or not run.writes:
        return
    run.logf = open(os.path.join(c.out_dir, LOG), "a")
    if c.wandb_log:
        import wandb
        wandb.init(**wandb_settings(c, os.environ), name=c.wandb_run_name or None, config=run.cfg,
                   dir=c.out_dir)
        run.wandb = wandb


def wandb_settings(c, env):
    """wandb.init's project and mode: the config's when given, else the environment's
    (WANDB_PROJECT, WANDB_MODE, which wandb reads itself when no mode is passed), else
    "nanofp4" and offline: never online unless asked for."""
    kw = dict(project=c.wandb_project or env.get("WANDB_PROJECT") or "nanofp4")
    if c.wandb_mode:
        kw["mode"] = c.wandb_mode
    elif not env.get("WANDB_MODE"):
        kw["mode"] = "offline"
    return kw


WANDB_NAMES = dict(  # log.jsonl's keys -> nanoGPT-style wandb names, per record type
    train=dict(loss="train/loss", lr="train/lr", grad_norm="train/grad_norm",
               dt_ms="train/step_ms", tok_per_s="train/tokens_per_s", mfu="train/mfu",
               elapsed_s="train/elapsed_s", ce_loss="train/ce_loss", aux_loss="train/aux_loss",
               z_loss="train/z_loss"),
    eval=dict(train_loss="eval/train_loss", val_loss="val/loss"),
    nonfinite=dict(loss="nonfinite/loss", grad_norm="nonfinite/grad_norm"))


def wandb_metrics(rec):
    """The numeric metrics of one log record under wandb names: the expert load as its
    imbalance per MoE layer (the busiest expert's share x n_expert: 1 = balanced), FP4 telemetry
    as alpha and SQNR per GEMM operand; no strings, no nested lists."""
    kind, out = rec.get("type"), {}
    for key, name in WANDB_NAMES.get(kind, {}).items():
        if isinstance(rec.get(key), (int, float)) and not isinstance(rec[key], bool):
            out[name] = rec[key]
    for layer, load in enumerate(rec.get("expert_load") or []):
        if load:
            out[f"moe/load_imbalance/layer{layer}"] = max(load) * len(load)
            out[f"moe/min_load/layer{layer}"] = min(load) * len(load)
    if kind == "telemetry":
        for group in ("alpha", "sqnr_db"):
            out.update({f"fp4/{group}/{op}": v for op, v in rec.get(group, {}).items()
                        if isinstance(v, (int, float))})
    return out

# -----------------------------------------------------------------------------
# data and model


@contextlib.contextmanager
def rank0_first(run):
    """Work that rank 0 alone does (out_dir's checks, the dataset) while the others wait on
    prep_group, as long as a dataset build takes. They learn whether it failed and stop with one
    line, rather than a traceback of a collective whose peer is gone that buries rank 0's error."""
    def all_ok(ok):
        if not run.ddp:
            return ok
        flag = torch.tensor([int(ok)])
        torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MIN, group=run.prep_group)
        return bool(flag.item())
    try:
        yield
    except Exception:
        all_ok(False)
        raise
    if not all_ok(True):
        raise PeerFailed(f"rank {run.rank}: stopping, another rank failed")


def prepare_data(run):
    """The dataset, prepared by rank 0 on first use, or again when its inputs changed."""
    c = run.c
    run.data_path = os.path.join(c.data_dir, c.dataset)
    inputs = dataset_inputs(c)
    if run.master:
        why = dataset_needs_build(c, run.data_path)
        if why and why != "first use" and not run.writes:
            mode = "a dry run" if c.dry_run else "an eval_only run"
            fix = "drop --dataset_input to use it as it is, or " if inputs else ""
            raise ConfigError(f"dataset {c.dataset!r} in {run.data_path} would be rebuilt ({why}), "
                              f"which {mode} does not do (checkpoints may have been trained on "
                              f"the data there): {fix}rebuild it in a training run")
        if why and why != "first use" and run.resumed:
            refuse_resume_rebuild(run, inputs)
        if why:
            if inputs or why != "first use":   # (prepare_dataset says it on first use)
                run.log(f"preparing dataset {c.dataset!r} in {run.data_path} ({why})...")
            t = time.time()
            try:
                if inputs:
                    data.prepare.prepare(inputs, run.data_path, build_tokenizer(c))
                else:
                    data.prepare_dataset(c.dataset, data_dir=c.data_dir, force=True)
            except (RuntimeError, ValueError, OSError) as e:   # each names the dataset or file
                raise ConfigError(str(e)) from None
            run.log(f"dataset prepared in {time.time() - t:.1f}s")


def setup_data(run):
    """The prepared dataset's meta, the train loader."""
    c, inputs = run.c, dataset_inputs(run.c)
    try:
        run.meta = data.load_meta(run.data_path)
    except (ValueError, OSError) as e:
        raise ConfigError(f"dataset {c.dataset!r}: {e}") from None
    have = run.meta.get("tokenizer")
    if c.dataset_tokenizer and not inputs and have != c.dataset_tokenizer:
        # a named dataset keeps its own tokenizer (check_named_copy): another needs another name
        fix = ("build one of another name with --dataset=NAME --dataset_input=FILE[,FILE...]"
               if c.dataset in data.DATASETS else
               "rebuild the dataset from text files with --dataset_input=FILE[,FILE...]")
        raise ConfigError(f"--dataset_tokenizer={c.dataset_tokenizer} is read only with "
                          f"--dataset_input, and dataset {c.dataset!r} in {run.data_path} is "
                          f"tokenized with {have}: drop it, or {fix}")
    run.train_loader = make_loader(run, "train", c.seed)
    make_loader(run, "val", c.seed)  # fail now, not at the first eval, if val.bin is too short


def dataset_inputs(c):
    """The files --dataset_input names (a stray comma names none)."""
    return [p for p in c.dataset_input.split(",") if p]


def build_tokenizer(c):
    """The tokenizer a build from --dataset_input uses ("" is data/prepare.py's default, char)."""
    return c.dataset_tokenizer or data.prepare.DEFAULT_TOKENIZER


def built_from(meta):
    """(sha256 of each input file, tokenizer): what a dataset's meta.json says it was built from."""
    return [i.get("sha256") for i in meta.get("inputs", [])], meta.get("tokenizer")


def refuse_resume_rebuild(run, inputs):
    """A resume may rebuild its dataset only into the data its checkpoint was trained on: any
    other rebuild would fail resume's data check after replacing the data of other runs."""
    c, (ckpt, src) = run.c, run.resumed
    trained = ckpt.get("meta")
    if not trained or c.dataset != ckpt["config"].get("dataset"):
        return
    if not inputs:   # a named dataset is rebuilt from its own source, with its own tokenizer
        own = named_tokenizer(c.dataset)
        if own and trained.get("tokenizer") not in (None, own):
            raise CheckpointError(f"{src} was trained on dataset {c.dataset!r} tokenized with "
                                  f"{trained['tokenizer']} (built before that name's tokenizer "
                                  f"was checked), which this run would rebuild with {own}: "
                                  f"nothing was rebuilt; move {run.data_path} to a folder of "
                                  f"another name beside it and resume with --dataset=NAME")
        return
    if built_from(trained) != ([sha256_file(p) for p in inputs], build_tokenizer(c)):
        raise CheckpointError(f"--dataset_input would rebuild dataset {c.dataset!r} in "
                              f"{run.data_path} from files or a tokenizer other than {src} was "
                              f"trained on, and resume would then refuse it: nothing was rebuilt; "
                              f"give the new data a name of its own (--dataset=NAME) to continue "
                              f"on it, or drop --dataset_input")


def dataset_needs_build(c, path):
    """Why data_dir/<dataset> must be (re)built, or "" when it holds what the config asks for:
    the data cache is keyed by the input files' sha256 and the tokenizer."""
    inputs = dataset_inputs(c)
    for p in inputs:
        if not os.path.isfile(p):
            raise ConfigError(f"dataset_input file {p!r} " + ("is a folder" if os.path.isdir(p)
                              else "not found") + ": give text files, comma-separated")
    digests = [sha256_file(p) for p in inputs]   # read once: the named-copy check and the cache key
    if inputs and c.dataset in data.DATASETS:
        check_named_copy(c.dataset, inputs, digests, build_tokenizer(c))
    buildable = bool(inputs) or c.dataset in data.DATASETS
    if not all(os.path.exists(os.path.join(path, f)) for f in ("train.bin", "val.bin", "meta.json")):
        if not buildable:
            raise ConfigError(f"unknown dataset {c.dataset!r}: {path} holds no prepared dataset "
                              f"and the named ones are {', '.join(data.DATASETS)}; build one "
                              f"from text files with --dataset_input=FILE[,FILE...]")
        return "first use"
    try:
        meta = data.load_meta(path)
    except ValueError as e:
        if not buildable:
            raise ConfigError(f"dataset {c.dataset!r}: {e}") from None
        return "its meta.json is unreadable"
    if not inputs:
        own = named_tokenizer(c.dataset)
        have = meta.get("tokenizer") or "no recorded tokenizer"
        if own and have != own:   # a build from before check_named_copy
            return (f"it is tokenized with {have}, and {c.dataset!r} is a {own} dataset: "
                    f"rebuilding it from its own source")
        return ""
    if built_from(meta) != (digests, build_tokenizer(c)):
        return (f"it was built from other files or another tokenizer ({meta.get('tokenizer')}) "
                f"than --dataset_input/--dataset_tokenizer give now: rebuilding")
    return ""


def named_tokenizer(name):
    """The tokenizer a named dataset's prepare.py fixes (TOKENIZER), or None."""
    if name not in data.DATASETS:
        return None
    return getattr(importlib.import_module(f"data.{name}.prepare"), "TOKENIZER", None)


def check_named_copy(name, inputs, digests, tokenizer):
    """--dataset_input with a named dataset takes only a local copy of that dataset's own source
    file (offline use; its prepare.py names the file's SHA256 and TOKENIZER), never other text
    or another tokenizer under its name: later runs of the name would train on that."""
    want = getattr(importlib.import_module(f"data.{name}.prepare"), "SHA256", None)
    if want and digests == [want]:
        own = named_tokenizer(name)
        if tokenizer == own:
            return
        raise ConfigError(f"--dataset_tokenizer={tokenizer} would build the named dataset "
                          f"{name!r}, which is tokenized with {own}: drop "
                          f"--dataset_tokenizer, or give the {tokenizer} build a name of its own "
                          f"(--dataset=NAME)")
    source = f"; for {name} only a copy of its source file (sha256 {want[:12]}...) is taken" \
        if want else ""
    raise ConfigError(f"--dataset_input would build the named dataset {name!r} from "
                      f"{', '.join(inputs)}: give your text a name of its own (--dataset=mytext "
                      f"--dataset_input=FILE){source}")


def make_loader(run, split, seed):
    c = run.c
    try:
        return data.loader.BinLoader(run.data_path, split, c.block_size, c.batch_size, seed,
                                     device=c.device, rank=run.rank, world_size=run.world)
    except ValueError as e:  # too short for one window, token ids >= vocab_size
        raise ConfigError(f"dataset {run.data_path} ({split}): {e}") from None


def setup_model(run):
    """fp32 master weights in the recipe's linears (a Hugging Face model's with init_from=hf:DIR),
    sharded under fsdp, and AdamW; the same init on every rank."""
    c = run.c
    run.recipe = make_recipe_from(run.cfg)
    fixed, weights = None, None
    if c.init_from.startswith("hf:"):
        fixed, weights = import_hf(run)
    elif run.resumed:   # model args that no config key holds come from the checkpoint
        fixed = {k: v for k, v in run.resumed[0]["model_args"].items()
                 if k in MODEL_KEYS and k not in DEFAULTS}
    run.margs = model_config(run.cfg, run.meta["vocab_size"], fixed)
    random.seed(c.seed)
    np.random.seed(c.seed)
    torch.manual_seed(c.seed)
    try:
        run.raw_model = fp4.convert(GPT(run.margs), run.recipe)
    except ValueError as e:
        raise ConfigError(f"the model does not fit recipe {run.recipe.name!r}: {e}") from None
    if weights is not None:
        run.raw_model.load_state_dict(weights)
    run.raw_model.to(c.device)
    if c.fsdp:   # before the optimizer, which must hold the sharded parameters
        parallel.shard_model(run.raw_model)
    run.optimizer = run.raw_model.configure_optimizers(c.weight_decay, c.learning_rate,
                                                       (c.beta1, c.beta2), run.device_type)
    if run.ddp:   # same init everywhere; dropout and SR draw per-process streams from here on
        torch.manual_seed(c.seed + run.rank)
    if (c.batch_size * c.block_size) % 32 and run.recipe.quantized:
        run.log(f"note: {c.batch_size * c.block_size} tokens per micro-step are not a multiple of "
                f"the Wgrad block: fp4 pads them with zero rows")
    kept = run.recipe.bf16_blocks(c.n_layer)
    quantizes_none = not run.recipe.quantized or len(kept) == c.n_layer
    if run.recipe.quantized and quantizes_none:
        run.log(f"warning: recipe {run.recipe.name} keeps all {c.n_layer} blocks in bf16 (its "
                f"first/last-block rule): no layer is quantized, the run is a bf16 run")
    if c.telemetry_interval and quantizes_none:
        run.log(f"note: telemetry_interval={c.telemetry_interval} logs nothing in this run: it "
                f"measures quantized GEMM operands, and recipe {run.recipe.name} quantizes no layer")
    if not c.compile and c.compile_mode != "default":
        run.log(f"note: compile_mode={c.compile_mode!r} has no effect with compile=False (the "
                f"model runs eager)")
    moot = [f"{k}={getattr(c, k)}" for k in ("min_lr", "lr_decay_iters") if getattr(c, k) != DEFAULTS[k]]
    if c.lr_schedule == "constant" and moot:  # a note: config files set min_lr for their decay
        run.log(f"note: lr_schedule='constant' holds learning_rate after warmup, so {' and '.join(moot)} "
                f"{'has' if len(moot) == 1 else 'have'} no effect (cosine and wsd read them)")
    if 0 < c.max_iters <= c.warmup_iters and not c.eval_only:
        run.log(f"warning: warmup_iters={c.warmup_iters} >= max_iters={c.max_iters}: the learning "
                f"rate rises all run and ends at {get_lr(c.max_iters - 1, c):.3g}, short of "
                f"learning_rate={c.learning_rate:g}; lower warmup_iters")


def import_hf(run):
    """(model args, state dict) of init_from's Hugging Face directory; the config's model keys
    become the directory's (said when they differ), so the checkpoints' config describes the
    model they hold."""
    c, src = run.c, run.c.init_from[3:]
    try:
        args, weights = hf.load_hf(src, block_size=c.block_size)
    except hf.HFError as e:
        raise ConfigError(f"init_from={c.init_from!r}: {e}") from None
    if args["vocab_size"] < run.meta["vocab_size"]:
        raise ConfigError(f"init_from={c.init_from!r}: the model's vocab_size "
                          f"{args['vocab_size']} is smaller than the dataset's "
                          f"{run.meta['vocab_size']}: use a dataset of its tokenizer")
    kind, detail = hf.tokenizer_of(src)
    ours = run.meta["tokenizer"]
    if kind is None:
        run.log(f"warning: {src} holds no tokenizer files: make sure its model was trained with "
                f"this dataset's tokenizer ({ours})")
    elif kind != ours or (kind == "char" and detail != run.meta["itos"]):
        theirs = f"its own tokenizer ({', '.join(detail)})" if kind == "other" else \
            f"a {kind} tokenizer" + (" of other characters" if kind == ours else "")
        raise ConfigError(f"init_from={c.init_from!r}: the model was trained with {theirs}, "
                          f"dataset {c.dataset!r} is {ours}-tokenized: its token ids would mean "
                          f"other tokens; use a dataset of the model's tokenizer")
    taken = {k: v for k, v in args.items() if k in DEFAULTS and run.cfg[k] != v}
    run.cfg.update(taken)
    vars(run.c).update(taken)
    if taken:
        run.log(f"from {src}: " + ", ".join(f"{k}={v!r}" for k, v in taken.items()))
    return args, weights


PERSISTENT_ROW_LIMIT = 4096  # longest row reduction compiled code keeps in registers (inductor: 1024)


@functools.cache
def _rows_in_registers_class():
    """An inductor heuristics class that keeps row reductions of up to PERSISTENT_ROW_LIMIT
    elements in registers (persistent) instead of looping over the row."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint

    class RowsInRegisters(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction):
            n = features.reduction_numel
            if (config.triton.persistent_reductions and getattr(n, "is_number", False)
                    and features.get_reduction_hint() == ReductionHint.INNER
                    and int(n) <= PERSISTENT_ROW_LIMIT):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

        def uuid(self):  # inductor's cache keys: graphs compiled without this are not reused
            return f"nanofp4-rows-in-registers-{PERSISTENT_ROW_LIMIT}"
    return RowsInRegisters


def rows_in_registers():
    """The heuristics of _rows_in_registers_class (a module-level factory: inductor pickles it
    into its cache keys)."""
    return _rows_in_registers_class()()


def torch_compile(model, mode="default"):
    """torch.compile(model, mode=mode) with row reductions (a norm over the width) kept in
    registers: inductor loops over longer rows and can read back a buffer it stored in an
    earlier loop before every thread has stored it (docs/performance.md, compiled LayerNorm)."""
    from torch._inductor import config
    from torch._inductor.virtualized import V
    config.inductor_choices_class = rows_in_registers  # for new threads, and the cache keys
    V.set_choices_handler(rows_in_registers())  # this thread's, where a compile set the default
    return torch.compile(model, mode=mode)


def compile_model(run):
    """torch.compile, and one flat gradient buffer under CUDA graphs or DDP."""
    c = run.c
    run.model = torch_compile(run.raw_model, mode=c.compile_mode) if c.compile else run.raw_model
    width = run.raw_model.config.n_embd
    if c.compile and run.device_type == "cuda" and width > PERSISTENT_ROW_LIMIT:
        run.log(f"note: the model is {width} wide, above train.PERSISTENT_ROW_LIMIT "
                f"({PERSISTENT_ROW_LIMIT}): compiled norms over rows that long can read unwritten "
                f"memory (docs/performance.md); check this run against --compile=False")
    run.graphs = c.compile and c.compile_mode in GRAPH_MODES and run.device_type == "cuda"
    # Under CUDA graphs and under DDP, the gradients are views of one flat buffer that stays
    # put and accumulates in place over the micro-steps. Graphs need them outside their
    # memory pool (a .grad taken from the pool would be overwritten by the next replay); DDP
    # all-reduces that buffer in one call after the last micro-step (no DDP wrapper, whose
    # hooks would run inside replayed graphs; the price is no overlap of that call with the
    # last backward, small next to a step of several micro-steps). A parameter with no
    # gradient in a step then gets AdamW's update of a zero grad; every parameter here gets one.
    # FSDP2 reduce-scatters each block's gradients itself, into sharded grads.
    run.flat_grad = flat_grads(run.raw_model) if (run.graphs or run.ddp) and not c.fsdp else None
    if run.ddp and not c.fsdp:   # rank 0's weights everywhere, whatever each process drew or loaded
        for t in list(run.raw_model.parameters()) + list(run.raw_model.buffers()):
            torch.distributed.broadcast(t.data, 0)


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

# -----------------------------------------------------------------------------
# checkpoints: resume from one, save one


def check_compatible(ckpt, path, margs):
    """A checkpoint resumes only into the same model (regularization weights may change)."""
    theirs, ours = ckpt["model_args"], dataclasses.asdict(margs)
    free = ("dropout", "aux_loss_weight", "z_loss_weight", "router_bias_rate", "loss_chunk")
    diff = [f"{k}: {theirs.get(k)!r} in the checkpoint, {ours.get(k)!r} now"
            for k in sorted(set(theirs) | set(ours))
            if k not in free and theirs.get(k) != ours.get(k)]
    if diff:
        raise CheckpointError(f"{path} was written for a different model ({'; '.join(diff)}): "
                              f"resume with the config it was trained with, or start from scratch")


def resume(run):
    """Weights, optimizer, counters and this rank's data/RNG streams from the checkpoint."""
    c = run.c
    (ckpt, src), run.resumed = run.resumed, None
    changes = data_changes(ckpt.get("meta"), run.meta)   # (first: new data also changes the vocab)
    # by name, not path: another spelling of the folder, or a copy elsewhere, is still that data
    if c.dataset == ckpt["config"].get("dataset") and changes:
        raise CheckpointError(f"{run.data_path} is not the data {src} was trained on ({changes}): "
                              f"it was rebuilt since; prepare that data again, or give the new "
                              f"data a name of its own (--dataset=NAME) to continue on it")
    check_compatible(ckpt, src, run.margs)
    try:
        load_states(run, ckpt)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{src} does not fit this model/optimizer: {e}") from e
    # a fork's ckpt_best.pt is the best of its own evals, not its parent's
    fork = not in_folder(src, c.out_dir)
    run.iter_num = ckpt["iter_num"]
    run.best_val_loss = float("inf") if fork else ckpt["best_val_loss"]
    run.n_nonfinite = ckpt.get("n_nonfinite", 0)
    if ckpt["recipe"] != run.recipe.name:
        run.log(f"note: {src} was trained with recipe {ckpt['recipe']!r}, continuing with "
                f"{run.recipe.name!r}")
    old_bits = ckpt.get("config", {}).get("sr_bits", 8)
    if old_bits != c.sr_bits:
        run.log(f"note: {src} was trained with sr_bits={old_bits}, continuing with "
                f"sr_bits={c.sr_bits}")
    resume_streams(run, ckpt, src)
    run.healthy = (src, run.iter_num, ckpt.get("val_loss", run.best_val_loss))
    run.log(f"resumed from {src} at iter {run.iter_num} (best val loss {ckpt['best_val_loss']:.4f}"
            + ("; this fork keeps its own best)" if fork else ")"))
    if run.master and run.writes and LOG not in run.claim[1]:   # (a log set aside stays whole)
        trim_log(os.path.join(c.out_dir, LOG), run.iter_num)


def load_states(run, ckpt):
    """The checkpoint's weights and AdamW states, full tensors, into a plain or sharded model.
    A checkpoint of an fsdp run keys its optimizer state by parameter name, a plain run's by
    position: either loads into either. The hyperparameters stay this run's (the config, which
    took the checkpoint's unless given again): loading would bring back the saved ones."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
    positional = all(isinstance(p, int) for g in ckpt["optimizer"]["param_groups"]
                     for p in g["params"])
    if run.c.fsdp or not positional:
        parallel.load_full_state(run.raw_model, run.optimizer, ckpt["model"], ckpt["optimizer"])
    else:
        run.raw_model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
    for group, own in zip(run.optimizer.param_groups, settings):
        group.update(own)


def resume_streams(run, ckpt, src):
    """Ranks the checkpoint knew continue their data and RNG streams; new ranks start new ones."""
    old_world = ckpt.get("world_size", len(ckpt.get("rng", [])))
    if run.rank < old_world:
        run.train_loader.load_state_dict(ckpt["loader"][run.rank])
        set_rng_state(ckpt["rng"][run.rank])
    elif old_world:   # a new rank: rank 0's host RNGs, fresh torch and data streams (keyed by the
        set_rng_state(ckpt["rng"][0])   # iteration: a rank that existed once must not replay its data)
        fresh = np.random.SeedSequence([run.c.seed, run.rank, run.iter_num])
        torch.manual_seed(int(fresh.generate_state(1)[0]))
        run.train_loader.load_state_dict(dict(rng=np.random.default_rng(fresh).bit_generator.state,
                                              step=0))
    if old_world != run.world:
        run.log(f"note: {src} was written by {old_world} process(es), now {run.world}: ranks "
                f"below {min(old_world, run.world)} continue their data/RNG streams, the others "
                f"start new ones, so the data order differs from an uninterrupted "
                f"{old_world}-process run")


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


def unhealthy(run, val_loss):
    """Why the model now must not replace a checkpoint, or "" when it may."""
    if not math.isfinite(val_loss):
        return f"its val loss is {val_loss}"
    if run.bad_in_row:
        return f"it is inside a streak of {run.bad_in_row} non-finite step(s)"
    if not parallel.all_finite(run.raw_model):   # a collective when sharded
        return "its weights are not finite"
    return ""


def describe_healthy(run):
    """The checkpoints a user can go back to, for messages."""
    if run.healthy is None:
        return "no checkpoint was written yet"
    path, it, val = run.healthy
    text = f"the last healthy checkpoint is {path} (iter {it}, val loss {val:.4f})"
    best = os.path.join(run.c.out_dir, BEST)
    if os.path.exists(best) and not (os.path.exists(path) and os.path.samefile(best, path)):
        text += f", the best is {best} (val loss {run.best_val_loss:.4f})"
    return text


def save(run, val_loss, best):
    """Every rank's data/RNG streams gathered, rank 0 writes the checkpoint (and ckpt_best.pt
    when `best`); never from an unhealthy model. The decision is the same on every rank: the
    losses are all-reduced and the weights equal. Whether it saved."""
    why = unhealthy(run, val_loss)
    if why:
        run.log(f"warning: not saving at iter {run.iter_num}: {why}; {describe_healthy(run)}")
        return False
    states = dict(rng=rng_state(), loader=run.train_loader.state_dict())
    gathered = [None] * run.world
    if run.ddp:
        torch.distributed.all_gather_object(gathered, states)
    else:
        gathered = [states]
    if run.c.fsdp:   # collectives: every rank gathers, rank 0 receives the full tensors
        model_sd = parallel.full_state_dict(run.raw_model)
        optim_sd = parallel.full_optimizer_state_dict(run.raw_model, run.optimizer)
    else:
        model_sd, optim_sd = run.raw_model.state_dict(), run.optimizer.state_dict()
    if run.master:
        save_checkpoint(dict(
            model=model_sd, optimizer=optim_sd,
            iter_num=run.iter_num, best_val_loss=val_loss if best else run.best_val_loss,
            config=run.cfg,
            model_args=dataclasses.asdict(run.margs), recipe=run.recipe.name,
            recipe_spec=repr(run.recipe), meta=run.meta, n_nonfinite=run.n_nonfinite,
            world_size=run.world, rng=[g["rng"] for g in gathered],
            loader=[g["loader"] for g in gathered], val_loss=val_loss), run.ckpt_path, best=best)
        run.log(f"saved checkpoint {run.ckpt_path} at iter {run.iter_num}"
                + (f" (and {BEST}: best val loss)" if best else ""))
        # the weights alone, readable by any framework without running code (hf.py exports them)
        weights = os.path.join(run.c.out_dir, WEIGHTS)
        had = os.path.exists(weights)
        try:
            hf.save_weights(model_sd, weights, metadata=dict(
                model_args=dataclasses.asdict(run.margs), recipe=run.recipe.name,
                iter_num=run.iter_num, meta=run.meta))
        except Exception as e:   # safetensors' own error type wraps a full disk's OSError
            left = "still holds the previous save's weights" if had else "was not written"
            raise CheckpointError(f"could not write {weights}: {e}; {run.ckpt_path} (iter "
                                  f"{run.iter_num}) is saved, {weights} {left}: free some space or "
                                  f"use another --out_dir") from None
    run.healthy = (run.ckpt_path, run.iter_num, val_loss)
    return True

# -----------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def estimate_loss(run):
    """Mean CE loss over eval_iters fixed batches per split; leaves every RNG as it was."""
    c, out = run.c, {}
    run.model.eval()
    with torch.random.fork_rng(devices=[c.device] if run.device_type == "cuda" else []):
        for split in ("train", "val"):
            loader = make_loader(run, split, c.seed + 1)
            losses = torch.zeros(c.eval_iters, device=c.device)
            for k in range(c.eval_iters):
                x, y = loader.next_batch()
                with run.ctx:
                    _, loss = run.raw_model(x, y)
                losses[k] = loss   # in eval mode the model returns the CE alone
            m = losses.mean()
            if run.ddp:
                run.all_reduce_mean(m)
            out[split] = m.item()
    run.model.train()
    return out


def evaluate(run):
    """Log both losses; checkpoint when asked to (always, or when val improved). The losses."""
    losses = estimate_loss(run)
    run.log(f"eval iter {run.iter_num}: train loss {losses['train']:.4f}, val loss "
            f"{losses['val']:.4f}")
    run.record(dict(type="eval", iter=run.iter_num, train_loss=losses["train"],
                    val_loss=losses["val"]))
    improved = losses["val"] < run.best_val_loss   # False for NaN
    saving = (improved or run.c.always_save_checkpoint) and run.iter_num > run.start_iter \
        and not run.c.dry_run and run.c.checkpoint
    saved = saving and save(run, losses["val"], best=improved)
    if improved and (saved or not saving):   # the best is what ckpt_best.pt holds
        run.best_val_loss = losses["val"]
    return losses

# -----------------------------------------------------------------------------
# one training step


def forward_backward(run):
    """accum micro-steps; the mean loss (all-reduced under DDP), gradients accumulated, and the
    MoE's stats over the same micro-steps and ranks (run.moe_stats)."""
    c, loss_sum, moe = run.c, torch.zeros((), device=run.c.device), None
    for micro in range(run.accum):
        if micro and rearms_dy_scales(run):  # (after the first: cache_weights reset them)
            fp4.reset_dy_scales(run.raw_model)
        x, y = run.train_loader.next_batch()
        if run.rank == c.debug_fail_rank and run.iter_num == c.debug_fail_at_iter:
            raise RuntimeError(f"debug_fail_at_iter: rank {run.rank} fails at iter {run.iter_num}")
        if run.graphs:  # a new replay may reuse the previous micro-step's buffers
            torch.compiler.cudagraph_mark_step_begin()
        with run.ctx:
            _, loss = run.model(x, y)
        if 0 <= c.debug_nan_at_iter <= run.iter_num < c.debug_nan_at_iter + c.debug_nan_iters:
            loss = loss * float("nan")
        loss_sum += loss.detach()
        if logged(run.iter_num, c):   # (a few small kernels a micro-step: only when logged)
            moe = add_moe_stats(moe, run.raw_model)
        (loss / run.accum).backward()
    run.moe_stats = mean_moe_stats(run, moe)
    if run.ddp:
        run.all_reduce_mean(loss_sum)
    if run.ddp and run.flat_grad is not None:   # (FSDP2 has reduce-scattered its gradients)
        run.all_reduce_mean(run.flat_grad)
    return loss_sum.item() / run.accum


def keeps_dy_scale(run):
    """Whether the layers keep dy's FP8 scale across micro-steps (recipe_fp8_dy_scale=step; FP8
    GEMMs only: make_recipe). Not under fsdp, whose layers keep the amax scale."""
    return run.recipe.fp8_dy_scale == "step" and not run.c.fsdp


def rearms_dy_scales(run):
    """Under dy's step scale, warm-up finds it afresh in every micro-step: each skip measured came
    from a layer's dy rising past the room within a warm-up step (docs/formats.md). After warm-up,
    once a step."""
    return keeps_dy_scale(run) and run.iter_num < run.c.warmup_iters


def train_step(run, lr):
    """One iteration: forward/backward, clip, then the optimizer step, or a skipped step when
    the loss or grad norm is not finite. Returns (loss, grad norm)."""
    c = run.c
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    probing = c.telemetry_interval and run.iter_num % c.telemetry_interval == 0 and run.master
    with fp4.probe_alphas() if probing else contextlib.nullcontext() as alphas:
        loss = forward_backward(run)
    grad_norm = parallel.clip_grad_norm(
        run.raw_model, c.grad_clip if c.grad_clip > 0 else float("inf")).item()
    if math.isfinite(loss) and math.isfinite(grad_norm):
        run.optimizer.step()
        if hasattr(run.raw_model, "update_router_bias"):
            run.raw_model.update_router_bias(
                all_reduce=torch.distributed.all_reduce if run.ddp else None)
        run.bad_in_row = 0
    else:
        skip_nonfinite_step(run, loss, grad_norm)
    cache_weights(run)  # after a skipped step too: it resets the layers' dy scales (fp8_dy_scale)
    run.optimizer.zero_grad(set_to_none=run.flat_grad is None)
    if probing and alphas:
        tel = telemetry_record(run.iter_num, fp4.probe_summary(alphas))
        run.record(tel)
        run.log(f"iter {run.iter_num} alpha | " + " ".join(
            f"{k} {'-' if v is None else f'{v:.4f}'}" for k, v in tel["alpha"].items()))
    return loss, grad_norm


def cache_weights(run):
    """Quantize the weights once per optimizer step where the layers can keep them (FP8 GEMMs:
    fp4.cache_weights), as one replayed CUDA graph under CUDA graphs (fp4.WeightCache); not
    under fsdp, whose layers hold shards."""
    if not run.c.fsdp:
        if run.weight_cache is None:
            run.weight_cache = fp4.WeightCache(run.raw_model, graph=run.graphs)
        run.weight_cache.refresh()


def skip_nonfinite_step(run, loss, grad_norm):
    """Count a skipped step; stop when the policy says so."""
    c = run.c
    run.n_nonfinite += 1
    run.bad_in_row += 1
    run.record(dict(type="nonfinite", iter=run.iter_num, loss=loss, grad_norm=grad_norm))
    what = f"loss {loss}" if not math.isfinite(loss) else f"grad norm {grad_norm} (loss {loss:.4f})"
    hint = ""
    if keeps_dy_scale(run) and run.accum > 1 and not rearms_dy_scales(run):
        room, top = run.recipe.fp8_step_room, fp4.max_step_room(run.recipe.rht_size)
        hint = (f" [recipe_fp8_dy_scale=step: a micro-step's dy may have outgrown the scale kept from "
                f"the step's first, with {room} binades of room (likelier with few tokens a "
                f"micro-step); --recipe_fp8_step_room up to {top} makes that rarer, "
                f"--recipe_fp8_dy_scale=amax finds the scale in every call]")
    run.log(f"iter {run.iter_num}: non-finite {what}: step skipped ({run.bad_in_row} in a row, "
            f"{run.n_nonfinite} in all){hint}")
    if c.nonfinite_policy == "stop" or run.bad_in_row >= c.max_nonfinite:
        raise NonFiniteError(
            f"stopping at iter {run.iter_num}: {run.bad_in_row} non-finite step(s) in a row "
            f"(policy {c.nonfinite_policy!r}, max_nonfinite={c.max_nonfinite}); "
            f"{describe_healthy(run)}")

# -----------------------------------------------------------------------------
# logging


def device_peak_tflops(c):
    """One device's bf16 peak for MFU: the config's, else a known GPU's, else None (a CPU, an
    unknown GPU: no MFU rather than a made-up one)."""
    if c.peak_tflops:
        return c.peak_tflops
    if not c.device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(c.device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")


def telemetry_record(iter_num, summary):
    """One log record from fp4.probe_summary(): alpha and SQNR per GEMM operand, mean over
    layers, and alpha per layer; on the FP8 GEMM path also, per operand, the largest fraction
    over layers of blocks that left the FP8 window (inexact there)."""
    ops = [op for op in OPERANDS if op in summary]
    mean = lambda op, i: sum(v[i] for v in summary[op].values()) / len(summary[op])  # noqa: E731
    num = lambda v, d: round(v, d) if math.isfinite(v) else None  # noqa: E731 (JSON: no NaN/inf)
    layers = {}
    for op in ops:
        for tag, (alpha, *_) in summary[op].items():
            layers.setdefault(tag, {})[op] = num(alpha, 6)
    rec = dict(type="telemetry", iter=iter_num, alpha={op: num(mean(op, 0), 6) for op in ops},
               sqnr_db={op: num(mean(op, 1), 3) for op in ops}, layers=layers)
    fp8 = {op: [v[2] for v in summary[op].values() if v[2] is not None] for op in ops}
    if any(fp8.values()):
        rec["fp8_out_of_window"] = {op: max(f) for op, f in fp8.items() if f}
    return rec


def add_moe_stats(total, raw_model):
    """The MoE's stats of the micro-step just run (GPT.moe_stats, device tensors: copied, since
    a replayed CUDA graph reuses its buffers) added to total's; None for a dense model."""
    stats = raw_model.moe_stats() if hasattr(raw_model, "moe_stats") else {}
    stats = {k: v.detach().to(torch.float32, copy=True) for k, v in stats.items() if k != "expert_load"}
    if not stats:
        return None
    return stats if total is None else {k: total[k] + v for k, v in stats.items()}


def mean_moe_stats(run, total):
    """Summed micro-step stats -> the step's: losses averaged over micro-steps and ranks, expert
    counts summed, expert_load from those counts (no host sync)."""
    if total is None:
        return {}
    counts = total.pop("expert_counts")
    means = torch.stack(list(total.values())) / run.accum
    if run.ddp:   # every rank has the same keys: one model, one config
        run.all_reduce_mean(means)
        torch.distributed.all_reduce(counts)
    out = dict(zip(total, means.unbind()))
    return dict(out, expert_load=counts / counts.sum(dim=1, keepdim=True), expert_counts=counts)


def moe_record(stats):
    """The step's MoE stats (mean_moe_stats) as plain numbers for the log."""
    out = {}
    for k, v in stats.items():
        v = v.detach().float().cpu()
        out[k] = round(v.item(), 6) if v.numel() == 1 else [[round(x, 4) for x in row]
                                                           for row in v.reshape(v.shape[0], -1).tolist()]
    return out


def logged(it, c):
    """Whether iteration `it` writes a training record."""
    return it % c.log_interval == 0 or it + 1 == c.max_iters


def log_step(run, loss, grad_norm, lr, dt, step_s, elapsed):
    """The training record of the iteration just done (run.iter_num - 1), and its line. Its
    tokens/s and MFU are this step's (dt); only the ETA takes the running average step_s."""
    c = run.c
    tok_s = run.tokens_per_iter / dt
    rec = dict(type="train", iter=run.iter_num - 1, loss=loss, lr=lr, grad_norm=grad_norm,
               dt_ms=dt * 1000, tok_per_s=tok_s, elapsed_s=elapsed)
    if run.peak_tflops:   # MFU only against a known peak (none on a CPU)
        rec["mfu"] = run.flops_per_token * tok_s / (run.peak_tflops * 1e12 * run.world)
    rec.update(moe_record(run.moe_stats))
    run.record(rec)
    mfu = f"MFU {100 * rec['mfu']:.2f}% | " if "mfu" in rec else ""
    run.log(f"iter {run.iter_num - 1} | loss {loss:.4f} | lr {lr:.2e} | {dt * 1000:.0f} ms | "
            f"{tok_s:,.0f} tok/s | {mfu}ETA {fmt_time((c.max_iters - run.iter_num) * step_s)}")
    return rec


def final_sample(run):
    """A sample from the trained model, started from a newline (char) or end-of-text token."""
    meta = run.meta
    first = meta["stoi"].get("\n", 0) if meta["tokenizer"] == "char" else meta.get("eot_token", 0)
    x = torch.full((1, 1), first, dtype=torch.long, device=run.c.device)
    run.raw_model.eval()
    with run.ctx:
        out = run.raw_model.generate(x, run.c.final_sample_tokens, temperature=0.8, top_k=200,
                                     vocab=meta["vocab_size"])
    text = decoder(meta)(out[0].tolist())
    run.log("sample:\n" + text)
    if run.wandb:
        run.wandb.log({"samples": run.wandb.Table(columns=["iter", "recipe", "text"],
                                                  data=[[run.iter_num, run.recipe.name, text]])},
                      step=run.iter_num)

# -----------------------------------------------------------------------------
# the training loop; a checkpoint is always taken at an iteration boundary


def train(run):
    """Iterate to max_iters with an eval (and checkpoint) every eval_interval; the last logged
    training loss, or a dry run's one-step loss."""
    c = run.c
    t0, dt_avg, last = time.time(), None, {}
    t_start = t0
    while run.iter_num < c.max_iters:
        if run.iter_num % c.eval_interval == 0 and not c.dry_run and (
                run.iter_num > run.start_iter or c.init_from != "resume"):
            evaluate(run)
            t0 = time.time()   # step timings leave the eval out
        lr = get_lr(run.iter_num, c)
        loss, grad_norm = train_step(run, lr)
        if c.dry_run:
            run.log(f"dry run: one step done, loss {loss:.4f}; nothing written")
            return loss
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        run.iter_num += 1
        if run.iter_num - run.start_iter > 1:   # the first step includes warm-up work
            dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
        if logged(run.iter_num - 1, c):
            last = log_step(run, loss, grad_norm, lr, dt, dt_avg or dt, t1 - t_start)
    if run.iter_num > run.start_iter:
        evaluate(run)
    else:
        run.log(f"nothing to train: at iter {run.iter_num}, max_iters={c.max_iters}")
    if run.bad_in_row:
        raise NonFiniteError(f"the run ended inside a streak of {run.bad_in_row} non-finite "
                             f"step(s), so its end was not saved; {describe_healthy(run)}")
    if c.final_sample_tokens and (run.master or c.fsdp):   # FSDP2: every rank joins the forwards
        final_sample(run)
    if c.plot and run.master:
        plot_log(run)
    return last.get("loss")


def plot_log(run):
    """out_dir/log.png from log.jsonl (plot.py); a picture that fails is a warning, never a
    failed run."""
    try:
        import plot
        run.log(f"plot: {plot.plot_run(run.c.out_dir)}")
    except Exception as e:   # matplotlib missing, an unwritable file, a log with nothing to plot
        run.log(f"warning: no plot of {run.c.out_dir}: {type(e).__name__}: {e}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(help_text(__file__, DEFAULTS, NULLABLE, usage=__doc__))
        return None
    cfg, resumed = configure(argv)
    run = Run(cfg)
    run.resumed = resumed
    fp4.set_backend(run.c.backend)
    set_sr_bits(run.c.sr_bits)
    setup_processes(run)
    try:
        torch.set_flush_denormal(True)  # CPU: ops on denormal floats (tiny grads) are ~100x slower
        with rank0_first(run):
            take_out_dir(run)
            prepare_data(run)
        setup_data(run)
        setup_model(run)
        if run.c.init_from == "resume":
            resume(run)
        run.start_iter = run.iter_num
        compile_model(run)
        cache_weights(run)
        run.flops_per_token = run.raw_model.estimate_flops_per_token()
        run.peak_tflops = device_peak_tflops(run.c)
        run.log(f"model: {run.raw_model.num_params() / 1e6:.2f}M params "
                f"({run.raw_model.active_params() / 1e6:.2f}M active), recipe {run.recipe.name}, "
                f"{run.world} process(es) on {run.c.device}, {run.c.dtype}, "
                f"{run.tokens_per_iter} tokens/iter")
        clear_out_dir(run)
        open_outputs(run)
        if run.c.eval_only:
            return evaluate(run)["val"]
        return train(run)
    except KeyboardInterrupt:
        if run.master:
            how = " (continue with --init_from=resume)" if run.healthy else ""
            print(f"\ninterrupted at iter {run.iter_num}; {describe_healthy(run)}{how}",
                  file=sys.stderr, flush=True)
        raise
    finally:
        run.close()
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
    except PeerFailed as e:   # (the rank that failed printed its error)
        print(e, file=sys.stderr)
        _exit(1)
    except KeyboardInterrupt:   # (main said where the run stands)
        _exit(130)
    except Exception:   # e.g. a collective timeout: its traceback, then the same clean exit
        traceback.print_exc()
        _exit(1)
    _exit(0)
