"""What is alive on the GPU at a training run's memory peak (docs/performance.md, memory).

    python scripts/memory_breakdown.py configs/gpu/gpt2_small_bf16.py --recipes=bf16,ufp4 \
        [--compile_mode=reduce-overhead|default|eager] [--steps=4]

A recipe may carry train.py overrides after '+', as in bench.py: mxfp4+recipe_fp8_gemm=True.

Builds the config's model (random tokens, no data needed) and records the caching allocator's
events (torch.cuda.memory._record_memory_history) over the first `steps` optimizer steps of two
micro-steps each (forward+backward twice, then AdamW), compilation and CUDA-graph recording
included. Replaying the events gives the peak of allocated bytes over the whole run (what
bench.py reports, a little lower: the trace has the bytes asked for, the allocator's statistic
counts them rounded up to its 512-byte blocks) and over the last step (the steady state), the
allocation that reached each, and every block alive at that moment, grouped by where it was
allocated: the step and phase, and a line of model.py / fp4.py / kernels.py (or of inductor's
generated code, by the source nodes it names). A replay of CUDA graphs allocates nothing, so under
reduce-overhead only the whole run is shown: its peak is in the step that records the graphs."""
import argparse
import collections
import datetime
import gc
import linecache
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4  # noqa: E402
import train  # noqa: E402
from model import GPT  # noqa: E402

OURS = ("model.py", "fp4.py", "kernels.py", "train.py")


def _source_nodes(filename, line):
    """In inductor's generated code, the '# Topologically Sorted Source Nodes' comment above a line."""
    for i in range(line, max(line - 60, 0), -1):
        text = linecache.getline(filename, i).strip()
        if text.startswith("# Topologically Sorted Source Nodes:"):
            return text.split(":", 1)[1].strip()[:90]
        if text.startswith("def call(") or text.startswith("def "):
            break
    return None


def label(frames, phase):
    """Where a block was allocated, in words a reader can find."""
    for f in frames:
        if os.path.basename(f["filename"]) in OURS:
            return f"{phase} {os.path.basename(f['filename'])}:{f['line']} {f['name']}"
    for f in frames:
        if "torchinductor" in f["filename"] or "/tmp/" in f["filename"]:
            nodes = _source_nodes(f["filename"], f["line"])
            text = linecache.getline(f["filename"], f["line"]).strip()[:60]
            return f"{phase} inductor [{nodes or text}]"
    for f in frames:
        if "torch/" not in f["filename"]:
            return f"{phase} {os.path.basename(f['filename'])}:{f['line']} {f['name']}"
    return f"{phase} " + (f"{os.path.basename(frames[0]['filename'])}:{frames[0]['name']}" if frames else "?")


def replay(trace, marks, base, last_step):
    """The allocator's events replayed: {"whole run" | "last step": (peak bytes, the label of what
    reached it, {addr: (size, label)} alive then, bytes from before recording alive then)}.
    marks: (trace index, phase) as each phase starts; base: bytes allocated before recording;
    last_step: the trace index where the last step starts."""
    # the allocator's statistic drops when a block is freed (free_requested), not when a block
    # used on another stream is finally returned (free_completed); older traces lack the former
    free_action = "free_requested" if any(e["action"] == "free_requested" for e in trace) else "free_completed"
    live, before = {}, base  # addr -> (size, label); `before`: bytes from before recording still alive
    now, peaks = base, {"whole run": (base, None, {}, base), "last step": (0, None, {}, base)}
    phase_at = iter(marks[1:] + [(len(trace) + 2, None)])
    phase, (next_at, next_phase) = marks[0][1], next(phase_at)
    for i, e in enumerate(trace + [{"action": "end"}]):  # "end": a last step without events
        while i >= next_at:
            phase, (next_at, next_phase) = next_phase, next(phase_at)
        if i == last_step:  # what the last step starts with counts too
            peaks["last step"] = (now, "the start of the last step", dict(live), before)
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], label(e.get("frames", []), phase))
            now += e["size"]
            for key in ("whole run", "last step") if i >= last_step else ("whole run",):
                if now > peaks[key][0]:
                    peaks[key] = (now, live[e["addr"]][1], dict(live), before)
        elif e["action"] == free_action:
            if e["addr"] in live:
                now -= live.pop(e["addr"])[0]
            else:
                now -= e["size"]
                before -= e["size"]
    return peaks


def breakdown(cfg, recipe, mode, steps=4, top=25, keep_x=GPT.fp4_keep_x, label=None):
    """Records `steps` optimizer steps from the first (compilation and CUDA-graph recording
    included, as bench.py's peak is over the whole run) and prints the live set at the peak of the
    whole run and at the peak of the last step (the steady state). mode: None (eager) or a
    torch.compile mode."""
    torch.compiler.reset()  # as bench.py: no CUDA-graph memory left by the recipe before
    gc.collect()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = fp4.convert(GPT(train.model_config(cfg, 50304)), recipe, keep_x=keep_x).cuda()
    fp4.cache_weights(model)  # as train.py: the weights' FP8 operands live through each step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    run = train.torch_compile(model, mode=mode) if mode else model
    graphs = mode in train.GRAPH_MODES
    B, T = cfg["batch_size"], cfg["block_size"]
    x = torch.randint(0, 50257, (B, T), device="cuda")
    dev = torch.cuda.current_device()
    if graphs:  # as train.py: gradients outside the graphs' pool, accumulated in place
        train.flat_grads(model)
    marks = []  # (trace length, phase) as each phase starts

    def mark(phase):
        marks.append((len(torch.cuda.memory._snapshot()["device_traces"][dev]), phase))

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    max_entries = 2_000_000
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    for s in range(1, steps + 1):  # two micro-steps per step, as train.py with gradient
        for micro in (1, 2):        # accumulation: the second runs with the first's gradients alive
            mark(f"step{s} fwd{micro}")
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = run(x, x)
            mark(f"step{s} bwd{micro}")
            loss.backward()
        mark(f"step{s} adamw")
        opt.step()
        fp4.cache_weights(model)
        opt.zero_grad(set_to_none=not graphs)
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][dev]
    torch.cuda.memory._record_memory_history(enabled=None)
    if len(trace) >= max_entries:  # a ring buffer: the oldest events, and the marks, would be off
        raise SystemExit(f"the allocator's trace filled its {max_entries} entries: use fewer --steps")
    peak_stat = torch.cuda.max_memory_allocated()
    last_step = [n for n, m in marks if m == f"step{steps} fwd1"][0]

    peaks = replay(trace, marks, base, last_step)
    gib = 2**30
    print(f"\n## {label or recipe} ({mode or 'eager'}, keep_x={keep_x}): allocator's max_memory_allocated {peak_stat / gib:.2f} GiB")
    if graphs:  # replays allocate nothing: the last step would show the weights and AdamW alone
        del peaks["last step"]
    for key, (peak, at, peak_live, peak_before) in peaks.items():
        groups = collections.Counter()
        for size, lab in peak_live.values():
            groups[lab] += size
        print(f"\n{key}: peak {peak / gib:.2f} GiB (replayed from the trace), reached by: {at}")
        print("| MiB | where it was allocated (step, phase, line) |\n|---|---|")
        print(f"| {peak_before / 2**20:.0f} | before recording (weights, and the zeroed .grad under CUDA graphs) |")
        for lab, size in groups.most_common(top):
            print(f"| {size / 2**20:.0f} | {lab} |")
        rest = sum(groups.values()) - sum(s for _, s in groups.most_common(top))
        print(f"| {rest / 2**20:.0f} | {max(len(groups) - top, 0)} other places |")
    del model, opt, run
    torch.cuda.empty_cache()
    return peaks["whole run"][0], peaks["last step"][0] if "last step" in peaks else None, peak_stat


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--recipes", default="bf16,ufp4")
    p.add_argument("--compile_mode", default="reduce-overhead",
                   choices=["eager"] + list(train.CHOICES["compile_mode"]))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--keep_x", default=",".join(GPT.fp4_keep_x), help="fp4.convert's keep_x, comma-separated ('' for none)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    cfg, recipes = train.gpu_script_setup(args.config, args.recipes, "memory_breakdown.py")
    print(f"`python {' '.join(sys.argv)}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
          f"UTC: {cfg['batch_size'] * cfg['block_size']} tokens per micro-step, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    mode = None if args.compile_mode == "eager" else args.compile_mode
    keep_x = tuple(n for n in args.keep_x.split(",") if n)
    rows = [(r, *breakdown(cfg, recipes[r], mode, args.steps, args.top, keep_x, r))
            for r in args.recipes.split(",")]
    print("\n| recipe | max_memory_allocated GiB | vs first | replayed peak GiB, whole run / last step | "
          "last step vs first |\n|---|---|---|---|---|")
    for r, peak, last, stat in rows:
        if last is None:   # CUDA graphs
            print(f"| {r} | {stat / 2**30:.2f} | {stat / rows[0][3]:.3f} | {peak / 2**30:.2f} / - | - |")
        else:
            print(f"| {r} | {stat / 2**30:.2f} | {stat / rows[0][3]:.3f} | {peak / 2**30:.2f} / "
                  f"{last / 2**30:.2f} | {last / rows[0][2]:.3f} |")


if __name__ == "__main__":
    main()
