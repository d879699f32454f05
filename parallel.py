"""
parallel.py: FSDP2 (fully sharded data parallel) for models too big for the flat-buffer path.

train.py's default multi-process path keeps a full copy of the weights, gradients and AdamW
states on every process (16 bytes per parameter) and all-reduces one flat gradient buffer. FSDP2
shards all of that over the processes instead: each transformer block is a unit whose weights are
all-gathered just before its forward and backward and freed after, and whose gradients are
reduce-scattered (averaged over ranks) as its backward ends. The FP4 layers need nothing special:
FSDP2 hands them the unsharded weight as a plain tensor, so the quantized GEMMs see exactly what
they see without it. tests/test_parallel.py (ufp4, two CPU processes): gradients, AdamW steps
and resumed steps bit-equal to one process accumulating the same micro-batches with the same
stochastic-rounding seeds; the gradient norm, summed over shards in another order, equal to a
relative 1e-6 (so a clip that is active moves the weights by about an ulp).

    model = fp4.convert(GPT(config), recipe).to(device)   # same init on every rank
    shard_model(model)                                    # before the optimizer is built
    optimizer = model.configure_optimizers(...)
    ... loss.backward(); clip_grad_norm(model, 1.0); optimizer.step()
    state = full_state_dict(model)                        # every rank calls; rank 0 gets it all
    optim = full_optimizer_state_dict(model, optimizer)
    load_full_state(model, optimizer, state, optim)       # resume (any world size, or none)

Checkpoints hold full (gathered) tensors: a plain model loads them with load_state_dict, and
a sharded run resumes from a plain run's checkpoint and back. The optimizer state gathered here
is keyed by parameter name (torch.distributed.checkpoint's format); load_full_state also takes
the positional one of optimizer.state_dict(). Tensor parallelism is not supported (the FP4 ops
have no sharding rule).
"""
import torch
import torch.distributed as dist

def _device_type(model):
    return next(model.parameters()).device.type

def make_mesh(device_type, world_size=None):
    """A 1-D device mesh over all processes (the process group must be initialized)."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, (world_size or dist.get_world_size(),))

def shard_model(model, mesh=None, reshard_after_forward=True, mp_policy=None):
    """fully_shard each of model.blocks, then the root (embeddings, final norm, lm_head; a tied
    lm_head stays one parameter). In place; returns the model. Call after moving the model to
    its device and before building the optimizer, whose parameters must be the sharded ones.
    mp_policy: an FSDP MixedPrecisionPolicy, None = fp32 everywhere (train.py's autocast then
    casts as without FSDP). reshard_after_forward=False keeps each block's weights gathered
    between forward and backward: one all-gather less per block, more memory."""
    from torch.distributed.fsdp import fully_shard
    if not hasattr(model, "blocks"):
        raise ValueError("shard_model needs a model with a `blocks` list (model.GPT)")
    kw = dict(mesh=mesh or make_mesh(_device_type(model)),
              reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model

def is_sharded(model):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)

def clip_grad_norm(model, max_norm):
    """torch's clip_grad_norm_ (the norm over all shards), returned as a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

def all_finite(model):
    """True when every weight is finite on every rank. A collective when the model is sharded,
    so that all ranks agree (one rank skipping a checkpoint that the others write would leave
    them waiting in its gathers)."""
    local = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                for p in model.parameters())
    if not is_sharded(model):
        return local
    flag = torch.tensor([float(local)], device=next(model.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())

def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **kw)

def full_state_dict(model):
    """The model's full state dict, gathered to rank 0 on the CPU (other ranks get {}): the keys
    and shapes of the plain model's state_dict(). A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(model, options=_options(cpu_offload=True))

def full_optimizer_state_dict(model, optimizer):
    """The optimizer's full state, keyed by parameter name, on rank 0's CPU (others get {}).
    A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))

def _name_keyed(model, optimizer, optim_state):
    """optimizer.state_dict()'s positional keys (0, 1, ... over the param groups in order) ->
    parameter names; a name-keyed state is returned as is."""
    if not any(isinstance(p, int) for g in optim_state["param_groups"] for p in g["params"]):
        return optim_state
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    if len(order) != sum(len(g["params"]) for g in optim_state["param_groups"]):
        raise ValueError("the optimizer state has another number of parameters than the model")
    return dict(state={order[i]: s for i, s in optim_state["state"].items()},
                param_groups=[dict(g, params=[order[i] for i in g["params"]])
                              for g in optim_state["param_groups"]])

def load_full_state(model, optimizer, model_state, optim_state=None):
    """Load full (unsharded) states, as full_state_dict / full_optimizer_state_dict or a plain
    run's state_dict() wrote them, into a sharded or plain model and its optimizer. Every rank
    passes the full dicts. A collective when the model is sharded."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, \
        set_optimizer_state_dict
    set_model_state_dict(model, model_state, options=_options())
    if optim_state is not None:
        set_optimizer_state_dict(model, optimizer, _name_keyed(model, optimizer, optim_state),
                                 options=_options())
