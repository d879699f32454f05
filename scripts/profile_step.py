"""Where the time of one training step goes (docs/performance.md): GEMMs vs FP4 quantization vs the rest.

    python scripts/profile_step.py configs/gpu/gpt2_small_bf16.py --recipes=bf16,ufp4 [--compile]

A recipe may carry train.py overrides after '+', as in bench.py: mxfp4+recipe_fp8_gemm=True.

Builds the config's model (random tokens, no data needed), runs warm-up steps, then profiles 3
forward+backward+AdamW steps with torch.profiler and sums the CUDA kernel time per category:
GEMM (cuBLAS/CUTLASS/grouped mm, the packed FP4 GEMM, the grouped FP8 GEMM), attention
(cuDNN/flash SDPA), quantize (kernels.py's Triton quantizers, amax passes, dequantize), and other
(norms, optimizer, inductor's fused kernels...). Prints a table per recipe and the top kernels."""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4  # noqa: E402
import train  # noqa: E402
from model import GPT  # noqa: E402

GEMM = ("gemm", "cutlass", "nvjet", "xmma", "grouped_mm", "cublas", "_fp4_mm_kernel", "_grouped_fp8_")
ATTENTION = ("sdpa", "flash", "fmha", "attention")
QUANT = ("_quant_kernel", "_amax_kernel", "_dequant_kernel")


def category(name):
    n = name.lower()
    if any(k in name for k in QUANT):
        return "quantize"
    if any(k in n for k in ATTENTION):
        return "attention"
    if any(k in n for k in GEMM):
        return "gemm"
    return "other"


def profile(cfg, recipe, compile_, steps=3, warmup=4, host=False, mode="default"):
    torch.manual_seed(0)
    model = fp4.convert(GPT(train.model_config(cfg, 50304)), recipe).cuda()
    fp4.cache_weights(model)  # as train.py: the weights' FP8 operands once per optimizer step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    run = train.torch_compile(model, mode=mode) if compile_ else model
    B, T = cfg["batch_size"], cfg["block_size"]
    x = torch.randint(0, 50257, (B, T), device="cuda")

    def step():
        if compile_ and mode in train.GRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = run(x, x)
        loss.backward()
        opt.step()
        fp4.cache_weights(model)
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.time() - t0) / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per = {"gemm": 0.0, "attention": 0.0, "quantize": 0.0, "other": 0.0}
    kernels = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t <= 0 or e.key.startswith("ProfilerStep"):
            continue
        per[category(e.key)] += t / steps / 1000
        kernels[e.key] = kernels.get(e.key, 0) + t / steps / 1000
    if host:  # where the host time goes: Python functions (cProfile), by own time
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        pr.disable()
        print(f"\n{recipe}: host time per step, top Python functions (cProfile, {steps} steps)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])
    return wall * 1000, per, top


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--recipes", default="bf16,ufp4")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile_mode", default="default", choices=train.CHOICES["compile_mode"])
    p.add_argument("--host", action="store_true", help="also print a cProfile of the host side")
    p.add_argument("--batch_size", type=int, default=0, help="micro-batch (default: the config's)")
    p.add_argument("--json", default="", help="also write every kernel's ms per step, per recipe, here")
    args = p.parse_args(argv)
    cfg, recipes = train.gpu_script_setup(args.config, args.recipes, "profile_step.py")
    if args.batch_size:
        cfg["batch_size"] = args.batch_size
    rows, every = [], {}
    for r in args.recipes.split(","):
        wall, per, top = profile(cfg, recipes[r], args.compile, host=args.host, mode=args.compile_mode)
        rows.append((r, wall, per))
        every[r] = {"wall_ms": wall, "categories": per, "kernels": dict(top)}
        print(f"\n{r}: top kernels, then the next 'other' ones (ms per step)")
        for name, t in top[:12] + [kv for kv in top[12:] if category(kv[0]) == "other"][:8]:
            print(f"  {t:8.2f}  [{category(name):8s}] {name[:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "recipes": every}, f, indent=1)
    tokens = cfg["batch_size"] * cfg["block_size"]
    print(f"\n`python {' '.join(sys.argv)}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
          f"UTC: {tokens} tokens per step, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    print("| recipe | wall ms/step | GEMM ms | attention ms | quantize ms | other ms | kernel sum ms |")
    print("|---|---|---|---|---|---|---|")
    for r, wall, per in rows:
        print(f"| {r} | {wall:.1f} | {per['gemm']:.1f} | {per['attention']:.1f} | {per['quantize']:.1f} | "
              f"{per['other']:.1f} | {sum(per.values()):.1f} |")


if __name__ == "__main__":
    main()
