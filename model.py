"""
model.py: a GPT (dense or mixture-of-experts) for FP4 training research, nanoGPT style.

The model holds no 4-bit code. Every linear inside `blocks` is a plain nn.Linear and the MoE
experts are fp4.GroupedLinear modules; train.py calls fp4.convert(model, recipe), which swaps the
linears for FP4Linear in place and sets the recipe of the experts. What stays in high precision
by construction: embeddings, norms, attention softmax/BMMs, the router (GPT.fp4_keep names it for
convert; its logits are computed in fp32) and lm_head (outside `blocks`).

Read top to bottom: config -> norms and RoPE -> attention -> dense MLP -> MoE -> block -> GPT.
"""
import functools
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import fp4

# -----------------------------------------------------------------------------
# Config

def _round_up(n, multiple=64):
    return (n + multiple - 1) // multiple * multiple

@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 50304   # GPT-2's 50257 padded up to a multiple of 64
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False
    mlp: str = "swiglu"       # "swiglu" | "gelu"
    norm: str = "rmsnorm"     # "rmsnorm" | "layernorm"
    pos_emb: str = "rope"     # "rope" | "learned"
    rope_theta: float = 10000.0
    mlp_hidden: int = 0       # 0 = auto: 4*n_embd (gelu), 8/3*n_embd rounded up to 64 (swiglu)
    tie_embeddings: bool = False
    # mixture of experts (n_expert = 0: dense model)
    n_expert: int = 0
    top_k: int = 2
    expert_hidden: int = 0    # 0 = auto: hidden // top_k rounded up to 64 (fine-grained experts)
    n_shared_expert: int = 0  # dense experts of expert_hidden each, seen by every token
    moe_dense_layers: int = 0  # the first k blocks keep a dense MLP
    router: str = "softmax"   # "softmax" (top-k of softmax, renormalized) | "sigmoid" (aux-free bias)
    aux_loss_weight: float = 0.01   # switch-style load balancing: E * sum_e f_e * P_e
    z_loss_weight: float = 0.001    # mean logsumexp(router logits)^2
    router_bias_rate: float = 0.001  # step of the aux-loss-free bias update (sigmoid router)
    # training's lm_head + loss this many tokens at a time, both gradients computed in the forward
    # (linear_cross_entropy); 0: whole logits, kept for backward. The same math either way
    loss_chunk: int = 4096

    def __post_init__(self):
        choices = dict(mlp=("swiglu", "gelu"), norm=("rmsnorm", "layernorm"),
                       pos_emb=("rope", "learned"), router=("softmax", "sigmoid"))
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r}; valid: {list(valid)}")
        if min(self.block_size, self.vocab_size, self.n_layer, self.n_head, self.n_embd) <= 0:
            raise ValueError("block_size, vocab_size, n_layer, n_head, n_embd must be positive")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if self.pos_emb == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"RoPE needs an even head size, got {self.n_embd // self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if min(self.mlp_hidden, self.expert_hidden, self.n_expert, self.n_shared_expert,
               self.moe_dense_layers, self.loss_chunk) < 0:
            raise ValueError("mlp_hidden, expert_hidden, n_expert, n_shared_expert, "
                             "moe_dense_layers and loss_chunk must be >= 0")
        if self.n_expert and not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_expert={self.n_expert}]")
        if self.n_expert and self.moe_dense_layers >= self.n_layer:
            raise ValueError(f"moe_dense_layers={self.moe_dense_layers} leaves no MoE block "
                             f"among n_layer={self.n_layer}; use n_expert=0 for a dense model")
        default = {f.name: f.default for f in fields(self)}
        moe_only = {k: getattr(self, k) for k in ("expert_hidden", "n_shared_expert", "moe_dense_layers",
                    "top_k", "router", "aux_loss_weight", "z_loss_weight", "router_bias_rate")
                    if getattr(self, k) != default[k]}
        if not self.n_expert and moe_only:
            raise ValueError(f"{', '.join(f'{k}={v}' for k, v in moe_only.items())} shape MoE "
                             f"blocks, and n_expert=0 makes a dense model: set n_expert, or drop them")
        if self.n_expert and self.expert_hidden and not self.moe_dense_layers \
                and self.mlp_hidden != default["mlp_hidden"]:
            raise ValueError(f"mlp_hidden={self.mlp_hidden} sizes dense MLPs and the experts' "
                             f"default width, and with expert_hidden={self.expert_hidden} and no "
                             f"dense layers (moe_dense_layers=0) nothing reads it: drop it")
        if self.router != "sigmoid" and self.router_bias_rate != default["router_bias_rate"]:
            raise ValueError(f"router_bias_rate={self.router_bias_rate} steps the sigmoid router's "
                             f"bias, and router={self.router!r} has none: set router='sigmoid', or drop it")
        # torch._grouped_mm (the experts' GEMMs) takes rows of a multiple of 16 bytes (8 bf16)
        if self.n_expert and (self.n_embd % 8 or self.expert_size % 8):
            raise ValueError(f"the experts' grouped GEMM needs n_embd={self.n_embd} and the expert "
                             f"width {self.expert_size} (expert_hidden) to be multiples of 8")

    # the auto sizes are resolved here, not stored, so dataclasses.replace(cfg, mlp=...) stays right
    @property
    def hidden(self):
        if self.mlp_hidden:
            return self.mlp_hidden
        return 4 * self.n_embd if self.mlp == "gelu" else _round_up(8 * self.n_embd // 3)

    @property
    def expert_size(self):
        return self.expert_hidden or _round_up(self.hidden // self.top_k)

# -----------------------------------------------------------------------------
# Norms and rotary position embeddings

def make_norm(config):
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd)
    return nn.LayerNorm(config.n_embd, bias=config.bias)

def rope_tables(head_dim, length, theta=10000.0):
    """cos and sin of position * frequency, [length, head_dim // 2], fp32."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()

def apply_rope(x, cos, sin):
    """Rotate the pairs (i, i + head_dim/2) of x [B, n_head, T, head_dim] by position."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

# -----------------------------------------------------------------------------
# Attention (softmax and BMMs stay in high precision; qkv and proj are quantized by convert)

class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x, rope=None):
        B, T, C = x.shape
        # split, not a view as [B, T, 3, H, D]: split's backward is one cat, written in one
        # pass; the view's (three select_backwards) read all three gradients per element
        # (docs/performance.md, where the time goes)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))

# -----------------------------------------------------------------------------
# Dense MLP: SwiGLU (fc1 = gate and up fused) or GELU. fc2's input is the activation output,
# the outlier-heavy tensor the shrinkage diagnostics care about.

def activate(h, mlp):
    if mlp == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)

class MLP(nn.Module):
    def __init__(self, config, hidden):
        super().__init__()
        self.kind = config.mlp
        fan_out = 2 * hidden if config.mlp == "swiglu" else hidden
        self.fc1 = nn.Linear(config.n_embd, fan_out, bias=config.bias)
        self.fc2 = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.drop(self.fc2(activate(self.fc1(x), self.kind)))

# -----------------------------------------------------------------------------
# Mixture of experts, dropless: every token reaches all of its top-k experts.

class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        E, h, d = config.n_expert, config.expert_size, config.n_embd
        self.n_expert, self.top_k, self.kind = E, config.top_k, config.mlp
        self.router_kind = config.router
        self.router = nn.Linear(d, E, bias=False)  # stays bf16: GPT.fp4_keep names it
        # experts as grouped linears, weights [E, out, in]; SwiGLU gate and up fused in w_in
        self.w_in = fp4.GroupedLinear(E, d, 2 * h if config.mlp == "swiglu" else h)
        self.w_down = fp4.GroupedLinear(E, h, d)
        self.shared = MLP(config, config.n_shared_expert * h) if config.n_shared_expert else None
        self.drop = nn.Dropout(config.dropout)
        # aux-loss-free balancing (sigmoid router): a per-expert bias used only to pick the top-k.
        # Persistent: a resumed run keeps its balance.
        self.register_buffer("router_bias", torch.zeros(E))
        # tokens per expert since the last update_router_bias: this rank's own counts, which
        # update_router_bias all-reduces. A plain attribute, not a buffer: no checkpoint state.
        self.load = None
        self.stats = {}

    def route(self, x):
        """x [N, d] -> (expert ids [N, k], gates [N, k] fp32, router logits [N, E] fp32, P [N, E]:
        the per-token probabilities the balancing loss uses)."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
        if self.router_kind == "softmax":
            probs = logits.softmax(dim=-1)
            gates, idx = probs.topk(self.top_k, dim=-1)
        else:  # sigmoid scores; the bias shifts which experts win but never the gate values
            probs = torch.sigmoid(logits)
            idx = (probs + self.router_bias).topk(self.top_k, dim=-1).indices
            gates = probs.gather(1, idx)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        if self.top_k > 1:   # renormalized over the chosen; a single expert keeps its probability
            gates = gates / gates.sum(dim=-1, keepdim=True)   # (renormalized it would be a constant 1,
        return idx, gates, logits, probs                      # and the loss would not train the router)

    def experts(self, x_sorted, counts, aligned=False):
        """The expert MLPs on rows sorted by expert; counts [E] stays on the device (no host sync:
        fp4.GroupedLinear runs each GEMM as one grouped GEMM, bf16 or FP8). aligned: as
        GroupedLinear's."""
        h = activate(self.w_in(x_sorted, counts, aligned), self.kind)
        return self.w_down(h, counts, aligned)

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        N, E, k = x.shape[0], self.n_expert, self.top_k
        idx, gates, logits, probs = self.route(x)
        # sort the N*k (token, expert) pairs by expert; stable keeps tokens in order inside a group
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        # not bincount: its output size depends on the data, a graph break under torch.compile
        counts = flat.new_zeros(E).scatter_add_(0, flat, torch.ones_like(flat))
        # each expert's rows start at a multiple of m, zero rows after its real ones: the expert
        # linears then copy nothing to pad groups for their grouped GEMMs and Wgrad's blocks.
        # Row `slot` of the sorted pair, within a static row bound; the last group takes the
        # spare rows; pad rows gather token N (a zero row) and add into a dropped row N.
        m = math.lcm(self.w_in.group_multiple(x.device), self.w_down.group_multiple(x.device))
        padded, slot, rows = fp4.group_layout(counts, m, N * k)
        padded = torch.cat((padded[:-1], rows - padded[:-1].sum(0, keepdim=True)))
        token = torch.full((rows,), N, dtype=order.dtype, device=x.device).index_copy(0, slot, order // k)
        gate = gates.new_zeros(rows).index_copy(0, slot, gates.flatten()[order])
        y = self.experts(torch.cat((x, x.new_zeros(1, x.shape[1])))[token], padded, aligned=True)
        out = torch.zeros(N + 1, x.shape[1], dtype=torch.float32, device=x.device)
        out = out.index_add(0, token, y.float() * gate[:, None])[:N]
        out = out.to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(x)
        # per-forward stats, kept on the device: no sync to log them
        load = counts.float() / (N * k)                       # f_e, sums to 1
        self.stats = dict(aux_loss=E * (load * probs.mean(dim=0)).sum(),
                          z_loss=torch.logsumexp(logits, dim=-1).pow(2).mean(),
                          counts=counts.detach())
        if self.training and self.router_kind == "sigmoid":
            with torch.no_grad():
                if self.load is None or self.load.device != counts.device:
                    self.load = torch.zeros(E, device=counts.device)
                self.load += counts
        return self.drop(out).view(shape)

# -----------------------------------------------------------------------------
# Transformer block and the GPT

def cross_entropy(logits, targets, rows=2048):
    """Mean fp32 cross-entropy over the targets that are not -1. Without autograd (eval, eager)
    in chunks of `rows` tokens: F.cross_entropy would hold an fp32 copy of all logits and their
    log-softmax at once (6 GiB at 16k tokens x 50k vocab, the peak of a whole training run)."""
    logits, targets = logits.view(-1, logits.size(-1)), targets.view(-1)
    if torch.is_grad_enabled():  # training: torch.compile fuses the upcast and the softmax
        return F.cross_entropy(logits.float(), targets, ignore_index=-1)
    total = sum(F.cross_entropy(lg.float(), t, ignore_index=-1, reduction="sum")
                for lg, t in zip(logits.split(rows), targets.split(rows)))
    return total / (targets != -1).sum()

def softmax_grad_(logits, targets, scale):
    """Cross-entropy's gradient in place of its logits [R, V]: (softmax - one_hot(target)) * scale,
    zero in rows whose target is -1; -> each row's loss, fp32 [R] (0 where ignored). scale: an
    fp32 tensor [] (1 / the batch's target count). A target outside [-1, V) makes its row's loss
    and gradient NaN (raising would make each chunk wait for the device). kernels.softmax_grad_
    is its Triton version."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    valid = targets != -1
    outside = (targets < -1) | (targets >= z.shape[1])
    t = targets.clamp(0, z.shape[1] - 1).unsqueeze(1)
    loss = torch.where(valid, lse - z.gather(1, t).squeeze(1), 0.0)
    one = torch.where(valid, -1.0, 0.0).unsqueeze(1)
    grad = torch.exp(z - lse.unsqueeze(1)).scatter_add_(1, t, one)
    row_scale = torch.where(outside, torch.nan, torch.where(valid, scale, 0.0))
    logits.copy_(grad * row_scale.unsqueeze(1))
    return torch.where(outside, torch.nan, loss)

@functools.cache
def _addmm_adds_into_fp32(device, dtype):
    """Whether this torch's addmm on `device` adds a `dtype` product into its fp32 input in place,
    checked on values once (an overload that overwrote would keep only the last chunk's part).
    The check waits for the device: the first call must not be inside CUDA graph capture (under
    torch.compile's reduce-overhead it is in the eager warm-up)."""
    acc = torch.ones(2, 2, device=device)
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError):   # (a torch whose overload takes no fp32 accumulator)
        return False
    return bool((acc == 3).all())

def _addmm_fp32_(acc, a, b):
    """acc += a @ b into an fp32 acc: cuBLAS adds into it where torch has that overload (CUDA),
    else the product in a's dtype is added."""
    if acc.is_cuda and a.dtype != acc.dtype and _addmm_adds_into_fp32(acc.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)

# the loss and both of lm_head's gradients in the forward, `rows` tokens at a time in one reused
# buffer, where autograd keeps all logits for backward (1.5 GiB at GPT-2 small's 16k tokens, at
# the step's memory peak). Opaque to torch.compile: plain autograd code compiled to more memory,
# not less, likely from sums fused after the loop (docs/performance.md)
@torch.library.custom_op("nanofp4::linear_cross_entropy", mutates_args=())
def _linear_ce_op(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  dtype: torch.dtype, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, d], weight [V, d], targets [N] -> (mean loss fp32 [], dx [N, d], dweight [V, d]);
    the GEMMs in `dtype`, weight's gradient summed over chunks in fp32, returned in weight's dtype."""
    xd, wd = x.to(dtype), weight.to(dtype)
    scale = 1.0 / (targets != -1).sum().float()   # a device tensor: no wait for the host
    total, dx, dw = _ce_chunks(xd, wd, targets, scale, rows)   # (its logits freed on return)
    return total * scale, dx.to(x.dtype), dw.to(weight.dtype)

def _ce_chunks(xd, wd, targets, scale, rows):
    """_linear_ce_op's loop -> (the summed losses, dx in xd's dtype, dw in fp32)."""
    kernels = fp4.kernels_for(xd)
    grad_ = kernels.softmax_grad_ if kernels else softmax_grad_
    dx = torch.empty_like(xd)
    dw = torch.zeros(wd.shape, dtype=torch.float32, device=wd.device)
    total = torch.zeros((), dtype=torch.float32, device=xd.device)
    buffer = xd.new_empty(min(rows, xd.shape[0]), wd.shape[0])   # one chunk's logits, reused
    for i in range(0, xd.shape[0], rows):
        xc = xd[i:i + rows]
        logits = torch.mm(xc, wd.t(), out=buffer[:xc.shape[0]])
        total += grad_(logits, targets[i:i + rows], scale).sum()   # logits now hold their gradient
        torch.mm(logits, wd, out=dx[i:i + rows])
        _addmm_fp32_(dw, logits.t(), xc)
    return total, dx, dw

@_linear_ce_op.register_fake
def _(x, weight, targets, dtype, rows):
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape), weight.new_empty(weight.shape)

class _LinearCrossEntropy(torch.autograd.Function):
    """The op under autograd. x is cast to the GEMMs' dtype here, not in the op, so that compiled
    the cast joins the norm before it and no fp32 x is alive beside the op's copy; backward casts
    dx back before scaling it, as the op's own cast did."""
    @staticmethod
    def forward(ctx, x, weight, targets, dtype, rows):
        loss, dx, dw = _linear_ce_op(x.to(dtype), weight, targets, dtype, rows)
        ctx.save_for_backward(dx, dw)
        ctx.x_dtype = x.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dw = ctx.saved_tensors
        dx = dx.to(ctx.x_dtype)
        return dx * grad_loss.to(dx.dtype), dw * grad_loss.to(dw.dtype), None, None, None

def linear_cross_entropy(x, weight, targets, rows):
    """cross_entropy(x @ weight.T, targets) for training, `rows` tokens at a time (_linear_ce_op),
    its GEMMs in the dtype fp4's layers compute in (autocast's, else x's)."""
    return _LinearCrossEntropy.apply(x.reshape(-1, x.size(-1)), weight, targets.reshape(-1),
                                     fp4.compute_dtype(x), rows)

class Block(nn.Module):
    def __init__(self, config, moe):
        super().__init__()
        self.norm1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.norm2 = make_norm(config)
        self.mlp = MoE(config) if moe else MLP(config, config.hidden)

    def forward(self, x, rope=None):
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))

class GPT(nn.Module):
    # what fp4.convert leaves alone: the MoE router stays bf16 with all it holds; attention's
    # output projection keeps its input for Wgrad (SDPA saves it anyway) instead of packed codes
    fp4_keep = ("router",)
    fp4_keep_x = ("attn.proj",)

    def __init__(self, config):
        super().__init__()
        self.config = config
        c = config
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd) if c.pos_emb == "learned" else None
        self.drop = nn.Dropout(c.dropout)
        # the attribute name `blocks` is what fp4.convert looks for
        self.blocks = nn.ModuleList(Block(c, moe=c.n_expert > 0 and i >= c.moe_dense_layers)
                                    for i in range(c.n_layer))
        self.norm_f = make_norm(c)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)  # high precision, outside blocks
        if c.tie_embeddings:
            self.wte.weight = self.lm_head.weight
        if c.pos_emb == "rope":
            cos, sin = rope_tables(c.n_embd // c.n_head, c.block_size, c.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self._ce_loss = None
        self.apply(self._init_weights)
        # scaled init of the projections that write into the residual stream (GPT-2)
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "fc2.weight", "w_down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding, fp4.GroupedLinear)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def moe_layers(self):
        return [b.mlp for b in self.blocks if isinstance(b.mlp, MoE)]

    def forward(self, idx, targets=None, full_logits=False):
        """-> (logits, loss). Without targets: logits of the last position only [B, 1, V] (all
        positions with full_logits=True) and loss None. With targets: None (full_logits or not)
        and the cross-entropy (targets -1 are ignored), plus, in training mode only, the weighted
        MoE aux and z losses (averaged over MoE layers): eval losses stay comparable with dense
        models. No logits with the loss: under torch.compile a returned logits tensor gets a zero
        gradient of its own size in backward (1.5 GiB at GPT-2 small's 16k tokens), alive at the
        step's memory peak."""
        B, T = idx.shape
        self._ce_loss = None   # moe_stats() reports the loss of this forward only
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)
        rope = (self.rope_cos[:T], self.rope_sin[:T]) if self.config.pos_emb == "rope" else None
        for block in self.blocks:
            x = block(x, rope)
        x = self.norm_f(x)
        if targets is None:
            return self.lm_head(x if full_logits else x[:, [-1], :]), None
        if torch.is_grad_enabled() and self.config.loss_chunk:
            loss = linear_cross_entropy(x, self.lm_head.weight, targets, self.config.loss_chunk)
        else:
            loss = cross_entropy(self.lm_head(x), targets)
        self._ce_loss = loss.detach()
        moes = self.moe_layers
        if moes and self.training:
            aux = torch.stack([m.stats["aux_loss"] for m in moes]).mean()
            z = torch.stack([m.stats["z_loss"] for m in moes]).mean()
            loss = loss + self.config.aux_loss_weight * aux + self.config.z_loss_weight * z
        return None, loss

    def moe_stats(self):
        """Stats of the last forward as device tensors (no sync): aux_loss and z_loss (means over
        MoE layers, unweighted), ce_loss (if that forward had targets), expert_load
        [n_moe_layers, E] (fractions of the token-expert pairs, rows sum to 1) and expert_counts
        [n_moe_layers, E] (tokens per expert; rows sum to tokens * top_k). {} for a dense model."""
        moes = [m for m in self.moe_layers if m.stats]
        if not moes:
            return {}
        counts = torch.stack([m.stats["counts"] for m in moes])
        out = dict(aux_loss=torch.stack([m.stats["aux_loss"].detach() for m in moes]).mean(),
                   z_loss=torch.stack([m.stats["z_loss"].detach() for m in moes]).mean(),
                   expert_load=counts.float() / counts.sum(dim=1, keepdim=True),
                   expert_counts=counts)
        if self._ce_loss is not None:
            out["ce_loss"] = self._ce_loss
        return out

    @torch.no_grad()
    def update_router_bias(self, all_reduce=None):
        """Aux-loss-free balancing step for sigmoid routers (DeepSeek-V3): bias_e += rate *
        sign(mean load - load_e) over the tokens seen since the last call, then reset the counts.
        Call after every optimizer step. all_reduce: an in-place sum over ranks (e.g.
        torch.distributed.all_reduce) so every rank applies the same update; one call for all layers."""
        # the layer set depends on the config only, so every rank joins the same collective
        moes = [m for m in self.moe_layers if m.router_kind == "sigmoid"]
        if not moes:
            return
        for m in moes:
            if m.load is None or m.load.device != m.router_bias.device:
                m.load = torch.zeros_like(m.router_bias, dtype=torch.float32)
        load = torch.stack([m.load for m in moes])
        if all_reduce is not None:
            reduced = all_reduce(load)
            load = reduced if isinstance(reduced, torch.Tensor) else load
        step = self.config.router_bias_rate * torch.sign(load.mean(dim=1, keepdim=True) - load)
        for m, s in zip(moes, step):
            m.router_bias += s.to(m.router_bias.dtype)
            m.load.zero_()

    # -- accounting --------------------------------------------------------------------------

    def num_params(self, non_embedding=True):
        """All parameters, or (non_embedding) those that do matmuls: without the position and,
        unless tied to lm_head, the token embedding."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.wpe is not None:
                n -= self.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.wte.weight.numel()
        return n

    def active_params(self):
        """Non-embedding parameters one token uses: top_k of the n_expert routed experts."""
        n = self.num_params(non_embedding=True)
        for m in self.moe_layers:
            experts = m.w_in.weight.numel() + m.w_down.weight.numel()
            n -= experts * (m.n_expert - m.top_k) // m.n_expert
        return n

    def estimate_flops_per_token(self, seq_len=None):
        """Training FLOPs per token, PaLM-style as in nanoGPT: 6 * active params + 12 * L * d * T
        (attention scores and values; T = block_size unless given; causal masking not discounted)."""
        c = self.config
        return 6 * self.active_params() + 12 * c.n_layer * c.n_embd * (seq_len or c.block_size)

    # -- training and sampling ---------------------------------------------------------------

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW; decay matrices, embeddings and expert weights (dim >= 2), not norms or biases."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
                  dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
        extra = dict(fused=True) if device_type == "cuda" else {}
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, vocab=None):
        """Sample max_new_tokens after idx [B, T] (long); the context is cropped to block_size.
        vocab: the tokenizer's vocabulary size, where vocab_size is padded above it; the padding
        ids, which no tokenizer can decode, are never sampled."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.config.block_size:]
            logits, _ = self(ctx)
            logits = logits[:, -1, :vocab].float()
            if temperature < 1e-4:   # the limit, where 1 / temperature could overflow the logits
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_id), dim=1)
        return idx
