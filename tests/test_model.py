"""Tests for model.py: shapes, causality, the dropless MoE against a per-token reference, the
balancing losses and bias, accounting, and the model under fp4.convert. CPU, tiny models."""
import copy
import functools
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp4  # noqa: E402
import model as model_module  # noqa: E402
from model import GPT, GPTConfig, MoE, cross_entropy, linear_cross_entropy, softmax_grad_  # noqa: E402

V, T = 128, 16

def tiny(**kw):
    base = dict(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=32)
    return GPTConfig(**{**base, **kw})

VARIANTS = {
    "dense-swiglu-rope": dict(),
    "dense-gelu-learned-layernorm-tied": dict(mlp="gelu", norm="layernorm", pos_emb="learned",
                                              tie_embeddings=True, bias=True),
    "moe-softmax": dict(n_expert=4, top_k=2),
    "moe-sigmoid-shared-dense1": dict(n_expert=4, top_k=2, router="sigmoid", n_shared_expert=1,
                                      moe_dense_layers=1),
    "moe-gelu-top1": dict(n_expert=4, top_k=1, mlp="gelu"),
}

def batch(B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)

# -----------------------------------------------------------------------------
# Shapes, loss, causality

@pytest.mark.parametrize("name", VARIANTS)
def test_forward_backward_shapes(name):
    torch.manual_seed(0)
    model = GPT(tiny(**VARIANTS[name]))
    x, y = batch()
    none, loss = model(x, y)
    assert none is None  # no logits beside the loss (their zero gradient costs memory, see GPT.forward)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(V)) < 0.5   # near uniform at init
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    last, none = model(x)
    assert none is None and last.shape == (2, 1, V)
    full, _ = model(x, full_logits=True)
    assert full.shape == (2, T, V)
    torch.testing.assert_close(last[:, 0], full[:, -1])
    assert model._ce_loss is None   # that forward had no targets
    _, loss = model(x, y)
    torch.testing.assert_close(F.cross_entropy(full.view(-1, V), y.view(-1)), model._ce_loss)

@pytest.mark.parametrize("name", ["dense-swiglu-rope", "dense-gelu-learned-layernorm-tied",
                                  "moe-softmax", "moe-sigmoid-shared-dense1"])
def test_causal(name):
    torch.manual_seed(0)
    model = GPT(tiny(**VARIANTS[name])).eval()
    for m in model.moe_layers:  # a non-trivial bias must not break causality either
        m.router_bias.normal_(0, 0.1)
    x, _ = batch()
    x2 = x.clone()
    x2[:, 9:] = (x2[:, 9:] + 1) % V
    a, _ = model(x, full_logits=True)
    b, _ = model(x2, full_logits=True)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:])

@pytest.mark.parametrize("rope", [False, True])
def test_attention_split_equals_the_interleaved_view(rope):
    """q, k, v come from qkv by split (whose backward is one cat, not three selects): the same
    output and gradients, bit for bit, as viewing qkv as [B, T, 3, H, D]."""
    torch.manual_seed(0)
    cfg = tiny()
    attn = model_module.CausalSelfAttention(cfg)
    B, T, C, H = 2, 12, cfg.n_embd, cfg.n_head
    x = torch.randn(B, T, C, requires_grad=True)
    tables = model_module.rope_tables(C // H, T) if rope else None

    def interleaved(x):
        q, k, v = attn.qkv(x).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
        if tables is not None:
            q, k = model_module.apply_rope(q, *tables), model_module.apply_rope(k, *tables)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attn.proj(y.transpose(1, 2).reshape(B, T, C))

    grads = []
    for f in (lambda x: attn(x, tables), interleaved):
        attn.zero_grad()
        x.grad = None
        y = f(x)
        y.pow(2).sum().backward()
        grads.append((y.detach(), x.grad, attn.qkv.weight.grad.clone()))
    for a, b in zip(*grads):
        assert torch.equal(a, b)

def test_ignore_index_and_too_long():
    model = GPT(tiny())
    x, y = batch()
    y[:, :8] = -1
    _, loss = model(x, y)
    logits, _ = model(x, full_logits=True)
    ref = F.cross_entropy(logits[:, 8:].reshape(-1, V), y[:, 8:].reshape(-1))
    torch.testing.assert_close(loss, ref)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, T + 1, dtype=torch.long))

def test_eval_cross_entropy_in_chunks_equals_the_whole():
    """Eval (no autograd) computes the loss in chunks of rows, so no fp32 copy of all logits is
    alive at once; it is the same mean, ignored targets included."""
    torch.manual_seed(0)
    logits = torch.randn(2, 37, V, dtype=torch.bfloat16) * 4
    targets = torch.randint(0, V, (2, 37))
    targets[0, :5] = -1
    ref = F.cross_entropy(logits.float().view(-1, V), targets.view(-1), ignore_index=-1)
    with torch.no_grad():
        chunked = cross_entropy(logits, targets, rows=8)  # 74 tokens: 9 full chunks and a rest
    torch.testing.assert_close(chunked, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(cross_entropy(logits, targets), ref)  # with autograd: F.cross_entropy itself


def test_softmax_grad_is_cross_entropys_gradient():
    """softmax_grad_ overwrites the logits with the gradient of (sum of row losses) * scale, zero
    in ignored rows, and returns each row's loss."""
    logits = (torch.randn(9, V) * 4).requires_grad_()
    targets = torch.randint(0, V, (9,))
    targets[[2, 5]] = -1
    targets[0] = V - 1
    rows = F.cross_entropy(logits, targets, ignore_index=-1, reduction="none")
    (rows.sum() * 0.25).backward()
    z = logits.detach().clone()
    loss = softmax_grad_(z, targets, torch.tensor(0.25))
    torch.testing.assert_close(loss, rows.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z, logits.grad, rtol=1e-6, atol=1e-8)
    assert (z[[2, 5]] == 0).all() and (loss[[2, 5]] == 0).all()


@pytest.mark.parametrize("rows", [7, 16, 64, 4096])   # a rest chunk, even chunks, one chunk, bigger
def test_linear_cross_entropy_equals_autograd_over_whole_logits(rows):
    """Training's loss in chunks, both gradients computed in the forward: the loss, dx and dW of
    F.cross_entropy over the whole logits, and backward scales them by the loss's gradient."""
    x = torch.randn(3, 16, 24, requires_grad=True)
    w = (torch.randn(V, 24) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (3, 16))
    targets[1, :5] = -1
    grads = []
    for fn in (lambda: F.cross_entropy((x @ w.t()).view(-1, V), targets.view(-1), ignore_index=-1),
               lambda: linear_cross_entropy(x, w, targets, rows)):
        x.grad = w.grad = None
        loss = fn()
        (loss * 0.7).backward()
        grads.append((loss.detach(), x.grad, w.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_linear_cross_entropy_under_autocast_computes_in_its_dtype():
    """Under bf16 autocast the chunks' GEMMs run in bf16 as lm_head's would (fp4.compute_dtype):
    the loss and gradients match autograd's over whole bf16 logits to bf16 rounding, not fp32's,
    and the gradients come back in the inputs' fp32."""
    x = torch.randn(64, 32, requires_grad=True)
    w = (torch.randn(V, 32) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (64,))
    grads = []
    for fn in (lambda: F.cross_entropy((x @ w.t()).float(), targets),
               lambda: linear_cross_entropy(x, w, targets, 16)):
        x.grad = w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn()
        loss.backward()
        grads.append((loss.detach(), x.grad, w.grad))
    for a, b in zip(*grads):
        assert b.dtype == a.dtype
        torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-3)
    fp32 = linear_cross_entropy(x.detach(), w.detach(), targets, 16)
    assert (fp32 - grads[1][0]).abs() > 1e-5   # bf16 GEMMs, not fp32 ones


def test_linear_cross_entropy_casts_x_before_its_op_to_the_same_bits():
    """x is cast to the GEMMs' dtype before the op (so that, compiled, no fp32 copy of x is alive
    beside it), and dx cast back before the loss's gradient scales it: the loss and both
    gradients equal, bit for bit, the op's outputs for fp32 x (which it casts itself) scaled in
    fp32. Scaling dx in bf16 before the cast back would round it."""
    import model
    x = torch.randn(48, 32, requires_grad=True)
    w = (torch.randn(V, 32) * 0.3).requires_grad_()
    targets = torch.randint(0, V, (48,))
    with torch.no_grad():
        loss_op, dx_op, dw_op = model._linear_ce_op(x, w, targets, torch.bfloat16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, w, targets, 16)
    g = torch.tensor(0.3)
    (loss * g).backward()
    assert dx_op.dtype == x.grad.dtype == torch.float32
    assert torch.equal(loss, loss_op)
    assert torch.equal(x.grad, dx_op * g) and torch.equal(w.grad, dw_op * g)


def test_the_fp32_accumulating_addmm_is_used_only_where_it_adds(monkeypatch):
    """dW's chunks add into an fp32 sum through addmm's fp32 output only where a value check shows
    that it adds: an overload that overwrites its output (which would keep only the last chunk's
    part of dW), is missing (this CPU build) or refuses the keyword falls back to adding products."""
    import model
    probe = model._addmm_adds_into_fp32.__wrapped__   # (uncached)
    cpu = torch.device("cpu")
    assert probe(cpu, torch.bfloat16) is False   # no such CPU kernel in torch 2.13
    def adds(acc, a, b, out_dtype, out):
        out.copy_(acc + (a.float() @ b.float()))
    def overwrites(acc, a, b, out_dtype, out):
        out.copy_(a.float() @ b.float())
    def refuses(acc, a, b, **kw):
        raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")
    for fake, expected in ((adds, True), (overwrites, False), (refuses, False)):
        monkeypatch.setattr(torch, "addmm", fake)
        assert probe(cpu, torch.bfloat16) is expected, fake.__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_op_registration(dtype):
    """torch.library's own checks of the custom op (each raises on failure): its schema, its fake
    (shapes and dtypes for the compiler) against the real outputs, and AOT dispatch as
    torch.compile runs it. Its gradients are outputs; autograd's formula is _LinearCrossEntropy."""
    import model
    x = torch.randn(10, 8, dtype=dtype)
    w = torch.randn(V, 8, dtype=dtype)
    targets = torch.randint(0, V, (10,))
    targets[2] = -1
    torch.library.opcheck(model._linear_ce_op, (x, w, targets, dtype, 4))


def test_the_models_training_loss_in_chunks_equals_whole_logits():
    """GPT.forward with grad on: loss_chunk (chunks of 24 of 32 tokens) against loss_chunk=0 (the
    whole logits through autograd), tied embeddings included; eager and under torch.compile."""
    model = GPT(tiny(tie_embeddings=True, loss_chunk=24))
    x, y = batch()
    y[0, :3] = -1
    runs = []
    for chunk, compile_ in ((0, False), (24, False), (24, True)):
        model.config.loss_chunk = chunk
        model.zero_grad()
        _, loss = (torch.compile(model) if compile_ else model)(x, y)
        loss.backward()
        runs.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_eval_loss_of_the_model_in_chunks(monkeypatch):
    """GPT.forward's eval loss through the chunked path (chunks of 8 of its 64 tokens) is the
    cross-entropy of its logits."""
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    x, y = batch()
    y[0, :5] = -1
    monkeypatch.setattr(model_module, "cross_entropy", functools.partial(cross_entropy, rows=8))
    with torch.no_grad():
        _, loss = model(x, y)
        logits, _ = model(x, full_logits=True)
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-1),
                               rtol=1e-6, atol=1e-6)

# -----------------------------------------------------------------------------
# MoE: the grouped path against a per-token loop, no drops, the balancing losses

def reference_moe(moe, x):
    """For each token: sum over its top-k experts of gate * expert(x), routing computed by hand."""
    logits = x @ moe.router.weight.t()
    if moe.router_kind == "softmax":
        top, idx = logits.softmax(-1).topk(moe.top_k, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        idx = (scores + moe.router_bias).topk(moe.top_k, dim=-1).indices
        top = scores.gather(1, idx)
    gates = top / top.sum(-1, keepdim=True) if moe.top_k > 1 else top   # one expert: its probability
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            e = idx[t, j]
            h = moe.w_in.weight[e] @ x[t]
            if moe.kind == "swiglu":
                g, u = h.chunk(2)
                h = F.silu(g) * u
            else:
                h = F.gelu(h)
            out[t] += gates[t, j] * (moe.w_down.weight[e] @ h)
    if moe.shared is not None:
        out += moe.shared(x)
    return out, idx

@pytest.mark.parametrize("kw", [dict(router="softmax"), dict(router="sigmoid"),
                                dict(router="sigmoid", n_shared_expert=2, top_k=3),
                                dict(router="softmax", mlp="gelu", top_k=1)])
def test_moe_matches_per_token_reference(kw):
    torch.manual_seed(0)
    cfg = tiny(n_expert=5, **{"top_k": 2, **kw})
    moe = MoE(cfg)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.2)
    moe.router_bias.normal_(0, 0.3)   # the bias picks experts but must not change the gates
    x = torch.randn(37, cfg.n_embd)   # a token count that is not a multiple of anything
    out = moe(x)
    ref, idx = reference_moe(moe, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # dropless: each expert got the tokens the reference routes to it; counts add up to N * k
    counts = moe.stats["counts"]
    assert counts.sum().item() == 37 * cfg.top_k
    torch.testing.assert_close(counts, torch.bincount(idx.flatten(), minlength=5))
    # 3D input gives the same as flattened tokens
    torch.testing.assert_close(moe(x[:36].view(4, 9, -1)).view(36, -1), out[:36])

@pytest.mark.parametrize("recipe", ["ufp4", "mxfp4"])
def test_moe_aligned_rows_match_padding_inside_the_experts(recipe):
    """MoE lays each expert's rows out in whole blocks (GroupedLinear aligned=True): the same
    output and gradients as compact rows that the expert layers pad themselves."""
    torch.manual_seed(2)
    cfg = tiny(n_expert=5, top_k=2, n_embd=64)
    moe = MoE(cfg)
    for lin in (moe.w_in, moe.w_down):
        lin.recipe = fp4.make_recipe(recipe, sr_dy=False)  # no SR: rows may move
    x = torch.randn(37, 64, requires_grad=True)
    out = moe(x)
    assert int(moe.w_in.group_multiple(x.device)) > 1
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = [x.grad] + [p.grad for p in moe.parameters()]
    moe.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    idx, gates, _, _ = moe.route(x2)
    order = idx.flatten().argsort(stable=True)
    token = order // 2
    y = moe.experts(x2[token], torch.bincount(idx.flatten(), minlength=5))
    ref = torch.zeros(37, 64).index_add(0, token, y * gates.flatten()[order, None])
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-8)  # (fp32 GEMMs of other group sizes)
    ref.backward(dout)
    for a, b in zip(grads, [x2.grad] + [p.grad for p in moe.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_aux_and_z_loss_formulas(router):
    torch.manual_seed(1)
    cfg = tiny(n_expert=6, top_k=2, router=router)
    moe = MoE(cfg)
    nn.init.normal_(moe.router.weight, std=0.5)
    x = torch.randn(50, cfg.n_embd)
    moe(x)
    logits = x @ moe.router.weight.t()
    if router == "softmax":
        probs = logits.softmax(-1)
        idx = probs.topk(2, dim=-1).indices
    else:
        scores = torch.sigmoid(logits)
        idx = scores.topk(2, dim=-1).indices
        probs = scores / scores.sum(-1, keepdim=True)
    f = torch.tensor([(idx == e).sum().item() / (50 * 2) for e in range(6)])
    P = probs.mean(0)
    aux = 6 * sum(f[e] * P[e] for e in range(6))
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    torch.testing.assert_close(moe.stats["aux_loss"], aux, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.stats["z_loss"], z, rtol=1e-5, atol=1e-6)

def test_loss_terms_and_moe_stats():
    torch.manual_seed(0)
    cfg = tiny(n_expert=4, top_k=2, aux_loss_weight=0.1, z_loss_weight=0.01)
    model = GPT(cfg)
    x, y = batch()
    assert GPT(tiny()).moe_stats() == {}
    _, loss = model(x, y)
    s = model.moe_stats()
    assert set(s) == {"aux_loss", "z_loss", "ce_loss", "expert_load", "expert_counts"}
    assert s["expert_load"].shape == (2, 4) and s["expert_counts"].shape == (2, 4)
    torch.testing.assert_close(s["expert_load"].sum(1), torch.ones(2))
    assert (s["expert_counts"].sum(1) == 2 * T * 2).all()
    aux = torch.stack([m.stats["aux_loss"] for m in model.moe_layers]).mean()
    z = torch.stack([m.stats["z_loss"] for m in model.moe_layers]).mean()
    torch.testing.assert_close(s["aux_loss"], aux.detach())
    torch.testing.assert_close(loss, s["ce_loss"] + 0.1 * aux + 0.01 * z)
    assert not s["aux_loss"].requires_grad and not s["ce_loss"].requires_grad
    model.eval()   # eval loss is the cross-entropy alone, comparable with dense models
    _, eval_loss = model(x, y)
    torch.testing.assert_close(eval_loss, model.moe_stats()["ce_loss"])

@pytest.mark.parametrize("top_k", [1, 2])
def test_router_gets_gradient_through_gates_and_losses(top_k):
    """The LM loss alone trains the router, through the gates: with one expert too (its gate is
    its probability; renormalized, it would be a constant 1)."""
    torch.manual_seed(0)
    for router in ("softmax", "sigmoid"):
        model = GPT(tiny(n_expert=4, router=router, top_k=top_k, aux_loss_weight=0.0, z_loss_weight=0.0))
        x, y = batch()
        model(x, y)[1].backward()
        for m in model.moe_layers:
            assert m.router.weight.grad.abs().sum() > 1e-4, (router, top_k)

def test_update_router_bias_moves_load_toward_balance():
    torch.manual_seed(0)
    cfg = tiny(n_layer=1, n_expert=4, top_k=2, router="sigmoid", norm="layernorm", bias=True,
               router_bias_rate=0.01)
    model = GPT(cfg)
    moe = model.blocks[0].mlp
    with torch.no_grad():   # skew: every token's router input shares a direction expert 0 likes
        model.blocks[0].norm2.bias.fill_(1.0)
        moe.router.weight.normal_(0, 0.1)
        moe.router.weight[0] += 0.1
    calls = []

    def fake_all_reduce(t):   # two identical ranks: the sum doubles the counts, signs unchanged
        calls.append(tuple(t.shape))
        t.mul_(2)

    def imbalance(seed):      # max |load_e - 1/E| on a held-out batch, bias unchanged (eval)
        model.eval()
        model(batch(B=8, seed=seed)[0])
        model.train()
        return (model.moe_stats()["expert_load"][0] - 0.25).abs().max().item()

    before = imbalance(1000)
    assert before > 0.2       # expert 0 is in (nearly) every token's top 2
    after = []
    for step in range(40):    # fresh batches, as in training
        model(*batch(B=4, seed=step))
        model.update_router_bias(all_reduce=fake_all_reduce)
        if step >= 30:
            after.append(imbalance(1000 + step))
    assert calls[0] == (1, 4) and len(calls) == 40
    assert sum(after) / len(after) < before / 2
    assert (moe.router_bias[1:] > moe.router_bias[0]).all()
    assert moe.load.sum() == 0   # counts reset after each update
    # eval-mode forwards and softmax routers leave the bias alone
    bias = moe.router_bias.clone()
    model.eval()
    model(*batch())
    model.update_router_bias()
    assert torch.equal(moe.router_bias, bias)
    soft = GPT(tiny(n_expert=4))
    soft(*batch())
    soft.update_router_bias()
    assert all((m.router_bias == 0).all() for m in soft.moe_layers)
    assert "blocks.0.mlp.router_bias" in model.state_dict()   # resumes keep the balance
    # before any training forward (a rank that saw nothing): joins the collective, changes nothing
    fresh = GPT(cfg)
    calls.clear()
    fresh.update_router_bias(all_reduce=fake_all_reduce)
    assert calls == [(1, 4)] and (fresh.blocks[0].mlp.router_bias == 0).all()

# -----------------------------------------------------------------------------
# Config, accounting, optimizer, sampling

@pytest.mark.parametrize("kw, match", [
    (dict(n_embd=30, n_head=4), "multiple of n_head"),
    (dict(n_expert=2, top_k=3), "top_k"),
    (dict(mlp="relu"), "mlp"),
    (dict(norm="batchnorm"), "norm"),
    (dict(pos_emb="alibi"), "pos_emb"),
    (dict(router="hash"), "router"),
    (dict(n_embd=30, n_head=10), "even head size"),
    (dict(n_expert=4, moe_dense_layers=2), "moe_dense_layers"),
    (dict(n_shared_expert=1), "n_shared_expert=1 shape MoE blocks"),
    (dict(expert_hidden=64, moe_dense_layers=1), "expert_hidden=64, moe_dense_layers=1"),
    (dict(router="sigmoid", top_k=3, aux_loss_weight=0.5),   # a dense model takes none of them
     "top_k=3, router=sigmoid, aux_loss_weight=0.5 shape MoE blocks, and n_expert=0"),
    (dict(n_expert=4, router_bias_rate=0.01), "router_bias_rate=0.01 steps the sigmoid router's"),
    (dict(n_expert=4, expert_hidden=64, mlp_hidden=512), "mlp_hidden=512 .* nothing reads it"),
    (dict(n_expert=4, expert_hidden=20), "expert width 20"),
    (dict(n_expert=4, n_embd=36, n_head=2, expert_hidden=64), "n_embd=36"),
    (dict(loss_chunk=-1), "loss_chunk must be >= 0"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw)

def test_auto_sizes():
    assert GPTConfig().hidden == 1024 and GPTConfig(mlp="gelu").hidden == 1536
    assert GPTConfig(n_expert=8).expert_size == 512
    assert GPTConfig(n_expert=8, mlp_hidden=1000, top_k=3).expert_size == 384
    assert GPTConfig(n_expert=8, expert_hidden=96).expert_size == 96

def test_param_and_flop_accounting():
    dense = GPT(tiny())
    c = dense.config
    total = sum(p.numel() for p in dense.parameters())
    assert dense.num_params(non_embedding=False) == total
    assert dense.num_params() == total - V * c.n_embd
    assert dense.active_params() == dense.num_params()
    tied = GPT(tiny(pos_emb="learned", tie_embeddings=True))
    assert tied.wte.weight is tied.lm_head.weight
    assert tied.num_params() == sum(p.numel() for p in tied.parameters()) - T * c.n_embd
    moe = GPT(tiny(n_expert=4, top_k=2, n_shared_expert=1))
    experts = sum(m.w_in.weight.numel() + m.w_down.weight.numel() for m in moe.moe_layers)
    assert moe.active_params() == moe.num_params() - experts // 2
    assert moe.estimate_flops_per_token() == 6 * moe.active_params() + 12 * 2 * 32 * T
    assert moe.estimate_flops_per_token(seq_len=4) == 6 * moe.active_params() + 12 * 2 * 32 * 4

def test_init_scales():
    model = GPT(GPTConfig(n_layer=8, n_embd=256, n_head=4, vocab_size=256, n_expert=4))
    std = lambda t: t.float().std().item()
    assert abs(std(model.blocks[0].attn.qkv.weight) - 0.02) < 0.002
    assert abs(std(model.blocks[0].mlp.w_in.weight) - 0.02) < 0.002
    for w in (model.blocks[0].attn.proj.weight, model.blocks[0].mlp.w_down.weight):
        assert abs(std(w) - 0.02 / 4) < 0.0005

def test_configure_optimizers():
    model = GPT(tiny(n_expert=4, bias=True, norm="layernorm"))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert any(p is model.moe_layers[0].w_in.weight for p in decay["params"])

def test_generate_crops_context():
    torch.manual_seed(0)
    model = GPT(tiny(n_expert=4)).eval()
    x, _ = batch()
    out = model.generate(x, max_new_tokens=5, temperature=0.8, top_k=10)
    assert out.shape == (2, T + 5) and (out[:, :T] == x).all() and out.max() < V


def test_generate_near_zero_temperature_is_greedy():
    """1 / temperature would overflow the logits (softmax NaN, multinomial raising): below 1e-4
    the most likely token, as the limit."""
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    x, _ = batch()
    greedy = model.generate(x, max_new_tokens=4, temperature=1e-40)
    ids = x
    for _ in range(4):
        ids = torch.cat((ids, model(ids[:, -model.config.block_size:])[0][:, -1].argmax(-1, keepdim=True)), 1)
    assert torch.equal(greedy, ids)

# -----------------------------------------------------------------------------
# Under fp4.convert

def test_convert_ufp4_swaps_the_right_modules():
    model = fp4.convert(GPT(tiny(n_expert=4, n_shared_expert=1, moe_dense_layers=1)), "ufp4")
    dense, moe = model.blocks
    for lin in (dense.attn.qkv, dense.attn.proj, dense.mlp.fc1, dense.mlp.fc2, moe.attn.qkv,
                moe.attn.proj, moe.mlp.shared.fc1, moe.mlp.shared.fc2):
        assert isinstance(lin, fp4.FP4Linear) and lin.recipe.name == "ufp4"
        # attention's output is kept by SDPA anyway: proj keeps it rather than a packed copy
        assert lin.pack_x == (lin not in (dense.attn.proj, moe.attn.proj))
    for g in (moe.mlp.w_in, moe.mlp.w_down):
        assert isinstance(g, fp4.GroupedLinear) and g.recipe.name == "ufp4"
    assert type(moe.mlp.router) is nn.Linear
    assert type(model.lm_head) is nn.Linear and type(model.wte) is nn.Embedding

@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_converted_moe_trains(router):
    torch.manual_seed(0)
    model = fp4.convert(GPT(tiny(n_layer=1, n_expert=4, router=router, n_shared_expert=1)), "ufp4")
    x, y = batch()
    _, loss = model(x, y)
    assert torch.isfinite(loss)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    assert model.blocks[0].mlp.w_down.weight.grad.abs().sum() > 0
    model.update_router_bias()

@pytest.mark.parametrize("name", ["dense-swiglu-rope", "moe-sigmoid-shared-dense1"])
def test_bf16_convert_is_identical(name):
    torch.manual_seed(0)
    model = GPT(tiny(**VARIANTS[name]))
    conv = fp4.convert(copy.deepcopy(model), "bf16")
    assert isinstance(conv.blocks[0].attn.qkv, fp4.FP4Linear)
    x, y = batch()
    (a, _), (b, _) = model(x, full_logits=True), conv(x, full_logits=True)
    la, lb = model(x, y)[1], conv(x, y)[1]
    assert torch.equal(a, b) and torch.equal(la, lb)

def test_width_not_multiple_of_16_is_a_clear_error():
    model = GPT(tiny(n_embd=40, n_head=2))
    with pytest.raises(ValueError, match="multiple"):
        fp4.convert(model, "ufp4")
    moe = GPT(tiny(n_expert=4, expert_hidden=24))   # only the experts are off
    with pytest.raises(ValueError, match="multiple"):
        fp4.convert(moe, "ufp4")
