"""Hardware counters of the quantize launches one FP4 linear layer makes (Nsight Compute): for
each launch of a GPT-2-small layer's forward and backward (the four linear shapes of a 12 x 768
block, 16384 tokens, as the layer runs them), its time, instructions per element, how busy the
issue slots and the ALU and FMA pipes are, achieved occupancy, DRAM bandwidth and the top warp
stall reasons. It says what bounds a kernel that runs below copy bandwidth: issue, one pipe
(the ALU pipe runs integer, logic, min/max and select instructions at half the FMA pipe's
rate), or latency (docs/kernels.md, instruction counts).

    python dev/quant_counters.py [--recipes=mxfp4+recipe_fp8_gemm=True,ufp4] [--tokens=16384]

Runs itself again under `ncu` (on the PATH, or --ncu=PATH; one GPU). ncu replays each launch
with its caches flushed, so times are per launch alone and read x from DRAM, not from the L2
that the layer's producer left it in. Recipes as in bench.py: a name, then train.py overrides
after '+'.
"""
import argparse
import csv
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CONFIG = "configs/gpu/gpt2_small_bf16.py"
KERNELS = ("_quant_kernel", "_flat_amax_kernel", "_amax_kernel", "_dequant_kernel")
STALLS = ("not_selected", "math_pipe_throttle", "long_scoreboard", "short_scoreboard", "wait",
          "barrier", "lg_throttle", "mio_throttle", "no_instruction", "dispatch_stall")
METRICS = {
    "us": "gpu__time_duration.sum",
    "inst": "smsp__inst_executed.sum",
    "issue": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "alu": "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "fma": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "occupancy": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "dram": "dram__bytes.sum.per_second",
    "regs": "launch__registers_per_thread",
    **{s: f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS},
}
# to microseconds, and to TB/s, from the units ncu reports
TIME_UNIT = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
RATE_UNIT = {"byte/s": 1e-12, "Kbyte/s": 1e-9, "Mbyte/s": 1e-6, "Gbyte/s": 1e-3, "Tbyte/s": 1.0}


def worker(recipes, tokens, log):
    """Runs each recipe's layer calls and writes one label per Triton launch, in launch order."""
    import torch
    import kernels

    labels, where, names = [], {}, {}
    launch = kernels._launch

    def operand(t):
        """What a launch's first argument is: x, dy, the weight, or the packed x's codes or scales."""
        if t.data_ptr() in names:
            return names[t.data_ptr()]
        return {torch.float32: "W", torch.uint8: "packed x codes"}.get(t.dtype, "packed x scales")

    def labelled(kernel, grid, args, meta, meta_key=None):
        t = args[0]  # its elements: two values per byte of packed codes
        n = t.numel() * (2 if t.dtype == torch.uint8 else 1)
        labels.append(dict(where, kernel=kernel.fn.__name__, what=operand(t), elements=n))
        return launch(kernel, grid, args, meta, meta_key)

    kernels._launch = labelled  # (this process only runs the layers below: restored at the end)
    try:
        _run_layers(recipes, tokens, where, names)
    finally:
        kernels._launch = launch
    with open(log, "w") as f:
        json.dump(labels, f)


def _run_layers(recipes, tokens, where, names):
    """One forward and backward of each GPT-2-small linear shape per recipe, as the model runs it."""
    import torch
    import fp4
    import train
    from quant_breakdown import KEEPS_X, SHAPES  # the layer shapes, and which keep x

    for spec in recipes:
        recipe = train.recipe_from_spec(CONFIG, spec)
        for layer, (n_in, n_out) in SHAPES.items():
            lin = fp4.FP4Linear(n_in, n_out, bias=False, recipe=recipe, pack_x=layer not in KEEPS_X).cuda()
            where.update(recipe=spec, layer=layer, phase="weight cache")
            lin.cache_weight()  # as train.py: FP8 weights once per optimizer step, not per call
            x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)
            names.clear()
            names.update({x.data_ptr(): "x", dy.data_ptr(): "dy"})
            where.update(phase="forward")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = lin(x)
            where.update(phase="backward")
            y.backward(dy)
            torch.cuda.synchronize()


def parse_ncu_csv(text):
    """ncu --csv --page raw output -> one dict per profiled launch, in launch order: the kernel's
    name and each METRICS value in the units the table uses (us, TB/s, the rest as ncu gives)."""
    rows = list(csv.reader(io.StringIO(text[text.index('"ID"'):])))
    head, units, data = rows[0], rows[1], rows[2:]
    col = {name: head.index(name) for name in (*METRICS.values(), "Kernel Name")}
    out = []
    for r in data:
        d = {"kernel": r[col["Kernel Name"]]}
        for key, name in METRICS.items():
            try:
                v = float(r[col[name]].replace(",", ""))
            except ValueError:  # n/a: a metric this launch did not give
                v = float("nan")
            unit = units[col[name]]
            d[key] = v * TIME_UNIT[unit] if key == "us" else v * RATE_UNIT[unit] if key == "dram" else v
        out.append(d)
    return out


def table(labels, counters):
    """Markdown table of the launches: labels (the worker's) matched to counters (ncu's) by order."""
    if [lab["kernel"] for lab in labels] != [c["kernel"] for c in counters]:
        raise SystemExit("quant_counters: ncu profiled other launches than the worker made: "
                         f"{[c['kernel'] for c in counters]} vs {[lab['kernel'] for lab in labels]}")
    lines = ["| recipe | layer | pass | kernel: operand | elements | us | instr / element | issue % | "
             "ALU % | FMA % | occupancy % | DRAM TB/s | regs | top stalls (cycles per issue) |",
             "|" + "---|" * 14]
    for lab, c in zip(labels, counters):
        top = sorted(STALLS, key=lambda s: -c[s])[:3]
        stalls = ", ".join(f"{s} {c[s]:.2f}" for s in top)
        lines.append(f"| {lab['recipe']} | {lab['layer']} | {lab['phase']} | {lab['kernel']}: {lab['what']} | "
                     f"{lab['elements']} | {c['us']:.1f} | {c['inst'] * 32 / lab['elements']:.1f} | "
                     f"{c['issue']:.0f} | {c['alu']:.0f} | {c['fma']:.0f} | {c['occupancy']:.0f} | "
                     f"{c['dram']:.2f} | {c['regs']:.0f} | {stalls} |")
    return "\n".join(lines)


def ncu_version(ncu):
    """'2025.3.1.0' from ncu --version's 'Version 2025.3.1.0 (build ...)' line."""
    out = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout
    return next((line.split()[1] for line in out.splitlines() if line.startswith("Version")), "?")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="mxfp4+recipe_fp8_gemm=True,ufp4")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--ncu", default="ncu")
    p.add_argument("--raw", default=None, help="also write ncu's CSV here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the label log's path
    args = p.parse_args(argv)
    recipes = args.recipes.split(",")
    if args.worker:
        return worker(recipes, args.tokens, args.worker)
    if shutil.which(args.ncu) is None:
        raise SystemExit(f"quant_counters: {args.ncu!r} not found: install Nsight Compute (ncu) or "
                         "pass --ncu=PATH")
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "labels.json")
        cmd = [args.ncu, "--csv", "--page", "raw", "--clock-control", "none",
               "--kernel-name", "regex:^(" + "|".join(KERNELS) + ")$",
               "--metrics", ",".join(METRICS.values()),
               sys.executable, os.path.abspath(__file__), f"--recipes={args.recipes}",
               f"--tokens={args.tokens}", f"--worker={log}"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0 or '"ID"' not in run.stdout:
            raise SystemExit(f"quant_counters: ncu failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n"
                             f"{run.stderr[-3000:]}")
        with open(log) as f:
            labels = json.load(f)
    if args.raw:
        with open(args.raw, "w") as f:
            f.write(run.stdout)
    import torch
    import triton
    print(f"`python dev/quant_counters.py {' '.join(argv if argv is not None else sys.argv[1:])}` on "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, triton {triton.__version__}, "
          f"ncu {ncu_version(args.ncu)}; "
          f"{args.tokens} tokens")
    print(table(labels, parse_ncu_csv(run.stdout)))


if __name__ == "__main__":
    main()
