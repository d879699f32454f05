"""GPU check of the FP4 layers under torch.compile, about 1-2 minutes on one H200:

    python tests/gpu/check_compile.py

Every compile goes through train.torch_compile, as train.py's does.

1. graph breaks (torch._dynamo.explain) of a converted dense GPT and MoE GPT (ufp4, and the MoE
   in mxfp4 on FP8 GEMMs): none may come from the FP4 layers (the MoE router's bincount in
   model.py is reported, not failed)
2. compiled (default inductor) vs eager ufp4 GPT, bf16 autocast: same loss on the same weights
   within bf16 tolerance, 5 AdamW steps of both stay close, no recompile after warm-up (also
   with probe_alphas() switched on for one step: the probe works under compile)
3. FP4Linear with the triton backend (Wgrad's x saved packed by kernels.quantize) == the torch
   backend, bit for bit (RTNE); packed == quantizing x in backward (SR); bytes saved for backward
   vs bf16 nn.Linear
4. CUDA graphs (compile mode 'reduce-overhead'): no cudagraph skip, the same loss as eager, and
   every replay draws fresh SR seeds (dW of two replays on the same batch differ, both close to
   eager's)
5. weights cached per optimizer step (fp4.WeightCache, mxfp4 on FP8 GEMMs, CUDA graphs): the
   same losses over 4 AdamW steps as quantizing the weights in every call
6. dy's FP8 scale kept per optimizer step (Recipe.fp8_dy_scale "step", CUDA graphs, two
   micro-steps a step): the backward's writes to each layer's state reach its buffer, the
   refresh resets it, and the losses follow the amax scale's
7. the compiled 2048-wide GPT (mxfp4; LayerNorm with bf16 and with FP8 GEMMs, RMSNorm) repeats
   its loss and its FP4 layers' dW (math attention) on the same batch and weights, with finite
   gradients: a looped LayerNorm read back its own output before all of it was written
   (train.torch_compile keeps such rows in registers; docs/performance.md)
8. a table: ms/step, tokens/s and peak memory of bf16 / ufp4, eager / compiled / CUDA graphs

Prints PASS / FAIL lines and ends with 'ALL PASS' (exit 0) or 'FAILED: n' (exit 1);
'skip' and exit 0 without CUDA. `--cpu` runs the same code at toy sizes on the CPU (a smoke test
of this script: the triton backend is then the torch one)."""
import copy
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.attention

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

CPU = "--cpu" in sys.argv
if not torch.cuda.is_available() and not CPU:
    print("skip: no CUDA device")
    sys.exit(0)

import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import fp4  # noqa: E402
import train  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

DEV = "cpu" if CPU else "cuda"
FAILS = []
CFG = dict(vocab_size=8192, block_size=256, n_layer=4, n_head=8, n_embd=512)
BATCH = 32
LIN = (8192, 2048, 2048)  # FP4Linear check: tokens, in, out
if CPU:
    CFG, BATCH, LIN = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64), 4, (256, 64, 64)


def autocast():
    return torch.autocast(DEV, dtype=torch.bfloat16)


def sync():
    if not CPU:
        torch.cuda.synchronize()


def report(ok, name, detail=""):
    print(f"{'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILS.append(name)


def check(name, fn):
    t = time.time()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- report and go on
        traceback.print_exc(limit=4)
        report(False, name, f"{type(e).__name__}: {str(e)[:300]}")
    print(f"      ({time.time() - t:.1f}s)", flush=True)


def gpt(recipe, **kw):
    torch.manual_seed(0)
    m = GPT(GPTConfig(**CFG, **kw)).to(DEV)
    return fp4.convert(m, recipe) if recipe != "bf16" else m


def batch(seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    idx = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"] + 1), generator=g, device=DEV)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def loss_of(model, x, y, seed):
    torch.manual_seed(seed)  # the SR seeds
    with autocast():
        return model(x, y)[1]


def breaks():
    moe = dict(n_expert=8, top_k=2)
    fp8 = fp4.make_recipe("mxfp4", fp8_gemm=True)  # the experts on the grouped FP8 GEMM
    for name, recipe, kw in (("dense ufp4", "ufp4", {}), ("moe ufp4", "ufp4", moe),
                             ("moe mxfp4 on FP8 GEMMs", fp8, moe)):
        torch._dynamo.reset()
        m = gpt(recipe, **kw)
        x, y = batch()
        with autocast():
            ex = torch._dynamo.explain(m)(x, y)
        reasons = [str(b.reason).split("\n")[0][:160] for b in ex.break_reasons]
        ours = [r for r in reasons if "fp4" in r.lower() or "nanofp4" in r.lower()]
        report(not ours, f"explain {name} GPT: no graph break from the FP4 layers",
               f"{ex.graph_break_count} breaks in all" + (f"; other causes: {sorted(set(reasons))}"
                                                          if reasons else ""))
    torch._dynamo.reset()


def compiled_vs_eager():
    torch._dynamo.reset()
    counters.clear()
    eager = gpt("ufp4")
    comp_model = copy.deepcopy(eager)
    comp = train.torch_compile(comp_model)
    x, y = batch()
    with torch.no_grad():
        le, lc = loss_of(eager, x, y, 0).item(), loss_of(comp, x, y, 0).item()
    rel = abs(le - lc) / abs(le)
    report(rel < 1e-2, "compiled vs eager ufp4: same loss on the same weights", f"{le:.5f} vs {lc:.5f} (rel {rel:.1e})")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, comp_model)]
    losses = ([], [])
    for step in range(6):
        with torch._dynamo.config.patch(error_on_recompile=step >= 2):  # step 0 (and 1) warm up
            probe = fp4.probe_alphas() if step == 3 else None
            with probe if probe else torch.enable_grad() as p:
                for i, (m, opt) in enumerate(((eager, opts[0]), (comp, opts[1]))):
                    loss = loss_of(m, x, y, 100 + step)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    losses[i].append(loss.item())
            if probe:
                n_ops = len(fp4.probe_summary(p))
                report(n_ops == 6, "probe_alphas() under compile: all six operands recorded, no recompile",
                       f"{len(p)} (layer, operand) records")
    worst = max(abs(a - b) / abs(a) for a, b in zip(*losses))
    report(worst < 2e-2, "compiled vs eager ufp4: 6 AdamW steps within bf16 tolerance",
           "eager " + " ".join(f"{v:.4f}" for v in losses[0]) + " | compiled " +
           " ".join(f"{v:.4f}" for v in losses[1]) + f" (worst rel {worst:.1e})")
    report(True, "no recompile after warm-up (error_on_recompile from step 2)",
           f"graphs {counters['stats'].get('unique_graphs')}")
    torch._dynamo.reset()


def triton_vs_torch():
    T, IN, OUT = LIN
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(T, IN, device=DEV, generator=g, dtype=torch.bfloat16)
    dy = torch.randn(T, OUT, device=DEV, generator=g, dtype=torch.bfloat16)
    w0 = torch.randn(OUT, IN, device=DEV, generator=g) * 0.02

    def run(recipe, backend, packed=True):
        fp4.set_backend(backend)
        saved = fp4._packs_wgrad_x
        if not packed:
            fp4._packs_wgrad_x = lambda r, s: False
        try:
            xi, w = x.clone().requires_grad_(), w0.clone().requires_grad_()
            torch.manual_seed(3)
            with autocast():
                out = fp4.fp4_linear(xi, w, recipe)
            out.backward(dy)
            return out.detach(), xi.grad, w.grad
        finally:
            fp4._packs_wgrad_x = saved
            fp4.set_backend("auto")

    for name in ("ufp4", "nvfp4", "mxfp4", "mxfp4+fp8"):  # +fp8: on FP8 GEMMs (opt-in)
        base, fp8 = name.removesuffix("+fp8"), name.endswith("+fp8") or None
        r = fp4.make_recipe(base, sr_dy=False, fp8_gemm=fp8)
        a, b = run(r, "triton"), run(r, "torch")
        same = [torch.equal(u, v) for u, v in zip(a, b)]
        report(all(same), f"FP4Linear {name} RTNE: triton (packed Wgrad x) == torch, y dx dW", str(same))
        r = fp4.make_recipe(base, fp8_gemm=fp8)
        a, b = run(r, "triton"), run(r, "triton", packed=False)
        same = [torch.equal(u, v) for u, v in zip(a, b)]
        report(all(same), f"FP4Linear {name} SR dy, triton: packed Wgrad x == quantizing x in backward", str(same))

    def saved_bytes(layer):
        with autocast():
            return fp4.saved_bytes(layer, x.clone().requires_grad_(), dy)
    lin = torch.nn.Linear(IN, OUT, bias=False, device=DEV)
    b16 = saved_bytes(lin)
    q = saved_bytes(fp4.FP4Linear(IN, OUT, bias=False, recipe="ufp4", device=DEV))
    report(q < 0.5 * b16, "FP4Linear ufp4 saves packed x: bytes saved for backward vs bf16 nn.Linear",
           f"{q / 2**20:.1f} MiB vs {b16 / 2**20:.1f} MiB ({q / b16:.2f}x)")


def cuda_graphs():
    torch._dynamo.reset()
    counters.clear()
    eager = gpt("ufp4")
    graphed = train.torch_compile(copy.deepcopy(eager), mode="reduce-overhead")
    x, y = batch()
    grads = []
    for step in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        loss = loss_of(graphed, x, y, 200 + step)
        loss.backward()
        grads.append(next(p for n, p in graphed.named_parameters() if "mlp" in n).grad.clone())
        lc = loss.item()
        graphed.zero_grad(set_to_none=True)
    eager_grads = []
    for seed in (0, 1):
        le = loss_of(eager, x, y, seed)
        le.backward()
        eager_grads.append(next(p for n, p in eager.named_parameters() if "mlp" in n).grad.clone())
        eager.zero_grad(set_to_none=True)
    le = le.item()
    ge = eager_grads[0]
    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    report(not any(v for k, v in skips.items() if "skip" in k), "CUDA graphs: no cudagraph skip",
           str(skips))
    rel = abs(le - lc) / abs(le)
    report(rel < 1e-2, "CUDA graphs vs eager ufp4: same loss on the same weights", f"{le:.5f} vs {lc:.5f}")
    cosine = lambda a, b: torch.nn.functional.cosine_similarity(a.flatten().float(),  # noqa: E731
                                                                b.flatten().float(), 0).item()
    cos, ref = [cosine(g, ge) for g in grads[2:]], cosine(*eager_grads)  # ref: SR noise alone
    # frozen seeds would leave two replays nearly equal (only attention's backward order differs)
    between = cosine(grads[2], grads[3])
    report(between < (1 + ref) / 2 and min(cos) > ref - 0.02,
           "CUDA graphs: each replay draws fresh SR seeds (two replays differ like two eager SR "
           "draws, and are as close to eager's dW as those are to each other)",
           f"replay vs replay {between:.4f}, to eager {[round(c, 4) for c in cos]}, eager vs eager {ref:.4f}")
    torch._dynamo.reset()


def cached_weights():
    """fp4.WeightCache as train.py uses it, under torch.compile (CUDA graphs on the GPU, where the
    refresh itself is a replayed graph): refreshed after each AdamW step, the model gives the
    same losses as quantizing its weights in every call, step after step (a replay that read a
    stale copy would not), and its eager forward takes the replayed cache as current."""
    x, y = batch()
    runs = []
    for cache in (True, False):
        torch._dynamo.reset()
        m = gpt(fp4.make_recipe("mxfp4", fp8_gemm=True))
        weights = fp4.WeightCache(m, graph=not CPU)  # as train.py: replayed as a CUDA graph
        n = weights.refresh() if cache else 0
        comp = train.torch_compile(m, mode="default" if CPU else "reduce-overhead")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses = []
        for step in range(4):
            if not CPU:
                torch.compiler.cudagraph_mark_step_begin()
            loss = loss_of(comp, x, y, 300 + step)
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cache:
                weights.refresh()
        if cache:  # the eager model takes the replayed cache as current
            with autocast():
                m(x, y)
        runs.append((n, losses))
        del m, comp, opt
    (n, cached), (_, fresh) = runs
    report(n > 0 and cached == fresh, "weights cached per optimizer step (mxfp4 on FP8 GEMMs, "
           "compiled): the same losses as quantizing them in every call, over 4 AdamW steps",
           f"{n} layers; losses {' '.join(f'{v:.6f}' for v in cached)} vs {' '.join(f'{v:.6f}' for v in fresh)}")
    torch._dynamo.reset()


def step_dy_scale():
    """Recipe fp8_dy_scale='step' compiled as train.py runs it (CUDA graphs on the GPU;
    fp4.WeightCache refreshed after each AdamW step, two micro-steps a step): the backward's
    writes to each layer's dy state reach the module's buffer (every flag clear after a step's
    backward, set again by the refresh: a replay that wrote a copy would leave them set), and the
    losses follow the amax scale's (within 1e-3: the two compiled models' first losses differed
    by 1e-5 on an H100, before any backward)."""
    runs = []
    for how in ("amax", "step"):
        torch._dynamo.reset()
        m = gpt(fp4.make_recipe("mxfp4", fp8_gemm=True, fp8_dy_scale=how))
        weights = fp4.WeightCache(m, graph=not CPU)
        weights.refresh()
        comp = train.torch_compile(m, mode="default" if CPU else "reduce-overhead")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for p in m.parameters():  # gradients accumulate in place, as in train.py's flat buffer: a
            p.grad = torch.zeros_like(p)  # replay's own output would be overwritten by the next
        states = [mod.dy_state for mod in m.modules() if getattr(mod, "dy_state", None) is not None]
        losses, cleared, reset = [], True, True
        for step in range(3):
            for micro in range(2):
                if not CPU:
                    torch.compiler.cudagraph_mark_step_begin()
                x, y = batch(micro)
                loss = loss_of(comp, x, y, 300 + 2 * step + micro)
                losses.append(loss.item())
                loss.backward()
            cleared &= all(int(s[1]) == 0 and int(s[0]) != 0 for s in states)
            opt.step()
            opt.zero_grad(set_to_none=False)
            weights.refresh()
            reset &= all(s.tolist() == [0, 1] for s in states)
        runs.append((len(states), losses, cleared, reset))
        del m, comp, opt
    (_, amax, _, _), (n, step, cleared, reset) = runs
    worst = max(abs(a - b) / abs(a) for a, b in zip(amax, step))
    report(n > 0 and cleared and reset and worst < 1e-3,
           "dy's FP8 scale kept per optimizer step (compiled): each layer's state written by the "
           "backward and reset by the refresh; the amax scale's losses",
           f"{n} states, cleared {cleared}, reset {reset}; losses {' '.join(f'{v:.6f}' for v in step)} "
           f"vs {' '.join(f'{v:.6f}' for v in amax)} (worst rel {worst:.1e})")
    torch._dynamo.reset()


def wide_repeats():
    width, layers = (256, 1) if CPU else (2048, 4)  # 2048: rows longer than inductor's 1024
    x, y = batch()
    for norm, fp8 in (("layernorm", False), ("layernorm", True), ("rmsnorm", False)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = GPT(GPTConfig(vocab_size=CFG["vocab_size"], block_size=CFG["block_size"], n_layer=layers,
                          n_head=width // 128, n_embd=width, norm=norm,
                          mlp="gelu", pos_emb="learned")).to(DEV)
        comp = train.torch_compile(fp4.convert(m, fp4.make_recipe("mxfp4", fp8_gemm=fp8)))
        linears = [p for n, p in m.named_parameters() if (".attn." in n or ".mlp." in n) and p.dim() == 2]
        losses, finite, grads = [], True, []
        # math attention: its backward is deterministic, so the FP4 layers' dW must repeat too
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            for _ in range(3):  # no optimizer step: the same weights, and the same SR seeds
                loss = loss_of(comp, x, y, 0)
                losses.append(loss.item())  # read before backward
                loss.backward()
                finite &= all(bool(p.grad.isfinite().all()) for p in m.parameters() if p.grad is not None)
                grads.append([p.grad.clone() for p in linears])
                m.zero_grad(set_to_none=True)
        same_dw = all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))
        report(len(set(losses)) == 1 and math.isfinite(losses[0]) and finite and same_dw,
               f"compiled {width}-wide GPT, {norm}, mxfp4 on {'FP8' if fp8 else 'bf16'} GEMMs: the same "
               f"loss and FP4 layers' dW three times on the same batch and weights, finite gradients",
               f"losses {' '.join(f'{v:.6f}' for v in losses)}; dW repeat {same_dw} ({len(linears)} layers)")
        del m, comp
    torch._dynamo.reset()


def speed_table():
    rows = []
    x, y = batch()
    for recipe in ("bf16", "ufp4"):
        for mode in ("eager", "compiled", "graphs"):
            torch._dynamo.reset()
            m = gpt(recipe)
            model = {"eager": m, "compiled": train.torch_compile(m),
                     "graphs": train.torch_compile(m, mode="reduce-overhead")}[mode]
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            for i in range(13):
                if i == (0 if mode == "graphs" else 3) and not CPU:  # graphs: count the capture's pool
                    torch.cuda.reset_peak_memory_stats()
                if i == 3:  # time steps 3-12 in every mode: not the compile or the graph capture
                    sync()
                    t = time.time()
                if mode == "graphs":
                    torch.compiler.cudagraph_mark_step_begin()
                loss = loss_of(model, x, y, i)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            sync()
            dt = (time.time() - t) / 10
            rows.append((recipe, mode, dt * 1e3, BATCH * CFG["block_size"] / dt,
                         1.0 if CPU else torch.cuda.max_memory_allocated() / 2**20))
            del m, model, opt
            if not CPU:
                torch.cuda.empty_cache()
    base = {mode: (tps, mem) for r, mode, _, tps, mem in rows if r == "bf16"}
    print(f"\n{'recipe':7s} {'mode':9s} {'ms/step':>8s} {'tokens/s':>10s} {'vs bf16':>8s} {'peak MiB':>9s} {'vs bf16':>8s}")
    for r, mode, ms, tps, mem in rows:
        print(f"{r:7s} {mode:9s} {ms:8.1f} {tps:10.0f} {tps / base[mode][0]:8.2f} {mem:9.0f} {mem / base[mode][1]:8.2f}")
    print(f"(GPT {CFG['n_layer']} x {CFG['n_embd']}, {BATCH} x {CFG['block_size']} tokens per step, AdamW, bf16 autocast)")
    torch._dynamo.reset()


def main():
    t0 = time.time()
    print(f"{'CPU smoke run' if CPU else torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
          f"{__import__('triton').__version__}", flush=True)
    check("graph breaks", breaks)
    check("compiled vs eager", compiled_vs_eager)
    check("triton vs torch backend", triton_vs_torch)
    if not CPU:
        check("CUDA graphs", cuda_graphs)
    check("cached weights", cached_weights)
    check("dy scale per step", step_dy_scale)
    check("wide model repeats", wide_repeats)
    check("speed table", speed_table)
    print(f"\n{'ALL PASS' if not FAILS else 'FAILED: ' + str(len(FAILS))} in {time.time() - t0:.0f}s")
    for f in FAILS:
        print(f"  FAIL {f}")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
