"""One-off: what quantizing the MoE experts' weights in every call costs (GPT-2-small MoE, 8 experts,
d 768, expert hidden 1536), and what a cache once per optimizer step would (bf16 operands, or packed and
dequantized per call). CUDA-graph replay of each call."""
import datetime
import torch
import triton
import fp4
from bench_kernels import graphed


def graph_us(fn, reps=20):
    replay = graphed(lambda: [fn() for _ in range(reps)])
    replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (5 * reps) * 1e3


print(f"`python expert_weight_cost.py` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
      f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
print("| recipe | weight [E, out, in] | Fprop Q(W) per call us | Dgrad Q(W) per call us | both, one read us | "
      "dequantize packed Fprop + Dgrad us | per micro-step, per call / packed cache ms (12 blocks) |")
print("|---|---|---|---|---|---|---|")
seeds = torch.zeros(6, dtype=torch.int64, device="cuda")
for name in ("ufp4", "mxfp4"):
    r = fp4.make_recipe(name)
    op = fp4._operands(r, seeds)
    tot_call = tot_cache = 0.0
    for shape in ((8, 1536, 768), (8, 768, 1536)):
        w = torch.randn(shape, device="cuda") * 0.02
        q = lambda o, dim, packed=False: fp4._operand(w, o, r, dim, torch.bfloat16, "", packed=packed)  # noqa: E731
        f = graph_us(lambda: q(op.fprop_w, -1))
        d = graph_us(lambda: q(op.dgrad_w, -2))
        pf, pd = q(op.fprop_w, -1, True), q(op.dgrad_w, -2, True)
        both = graph_us(lambda: [fp4._operand_pair(w[e], op.fprop_w, op.dgrad_w, r, torch.bfloat16, "")
                                 for e in range(shape[0])])
        deq = graph_us(lambda: (fp4.dequantize(pf, torch.bfloat16), fp4.dequantize(pd, torch.bfloat16)))
        tot_call += (f + d) * 12 / 1e3
        tot_cache += deq * 12 / 1e3
        print(f"| {name} | {list(shape)} | {f:.1f} | {d:.1f} | {both:.1f} | {deq:.1f} | |")
    print(f"| {name} | both layers | | | | | {tot_call:.2f} / {tot_cache:.2f} |")
