"""One-off probe (GPU): torch's FP8 GEMM with DeepSeek-style 1x128 block scales on both operands
(one fp32 scale per row of A and per column of B for every 128 of K; cuBLAS >= 12.9 on sm90)
against one scale per tensor and against bf16, at the GEMM shapes of a GPT-2-small layer (16k
tokens) and of the wide 24 x 2048 model (8k tokens). With such scales the quantize kernel could
choose each group's scale inside its tile, and no tensor amax pass would run first.
Prints milliseconds per call (CUDA-graph replay of 10 calls, best of 5) and, for operands made of
int4 values on power-of-two 1x32 block scales, the relative error against the float64 product."""
import torch
import torch.nn.functional as F

E4 = torch.float8_e4m3fn


def graph_ms(fn, reps=10):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(5):
        t0.record(); g.replay(); t1.record(); torch.cuda.synchronize()
        best = min(best, t0.elapsed_time(t1) / reps)
    return best


def pow2_operand(rows, k, spread=6):
    """int4 values (-7..7) on power-of-two 1x32 block scales spanning `spread` binades; returns
    the FP8 bytes under 1x128 group scales (each group's largest block scale), the group scales
    [rows, k/128], the FP8 bytes under one tensor scale and that scale, and the exact values."""
    q = torch.randint(-7, 8, (rows, k), device="cuda").float()
    e = torch.randint(-spread, 1, (rows, k // 32), device="cuda").float()
    vals = q * torch.exp2(e).repeat_interleave(32, 1)
    group = torch.exp2(e.view(rows, k // 128, 4).amax(-1))                # [rows, k/128]
    fp8_group = (vals / group.repeat_interleave(128, 1)).to(E4)
    top = torch.exp2(e.max())
    return fp8_group, group, (vals / top).to(E4), top, vals


def gemm_fns(M, K, N):
    a8g, sa, a8t, ta, a = pow2_operand(M, K)
    b8g, sb, b8t, tb, b = pow2_operand(N, K)                                # B as [N, K]
    sa_outer = sa.t().contiguous().t()                                      # [M, K/128], M fastest
    sb_kn = sb.t().contiguous()                                             # [K/128, N], N fastest
    ab, bb = a.bfloat16(), b.bfloat16()
    one = torch.ones((), device="cuda")
    fns = {
        "bf16 mm": lambda: ab @ bb.t(),
        "fp8 tensorwise": lambda: torch._scaled_mm(a8t, b8t.t(), ta * one, tb * one, out_dtype=torch.bfloat16),
        "fp8 tensorwise fast": lambda: torch._scaled_mm(a8t, b8t.t(), ta * one, tb * one, out_dtype=torch.bfloat16,
                                                        use_fast_accum=True),
        "fp8 1x128 x 1x128": lambda: torch._scaled_mm(a8g, b8g.t(), sa_outer, sb_kn, out_dtype=torch.bfloat16),
    }
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        B = F.ScalingType.BlockWise1x128
        fns["fp8 1x128 x 1x128 (F.scaled_mm)"] = lambda: F.scaled_mm(
            a8g, b8g.t(), sa_outer, B, sb.t().contiguous().t(), B, output_dtype=torch.bfloat16)
    exact = a.double() @ b.double().t()
    return fns, exact


def main():
    print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda)
    shapes = {  # (M, K, N) of A [M, K] @ B^T [K, N]
        "dense fprop qkv": (16384, 768, 2304), "dense fprop fc2": (16384, 3072, 768),
        "dense dgrad qkv": (16384, 2304, 768), "dense dgrad fc1": (16384, 3072, 768),
        "dense wgrad qkv": (2304, 16384, 768), "dense wgrad fc2": (768, 16384, 3072),
        "wide fprop fc1": (8192, 2048, 8192), "wide fprop fc2": (8192, 8192, 2048),
        "wide wgrad fc1": (8192, 8192, 2048),
    }
    rows = []
    for name, (M, K, N) in shapes.items():
        fns, exact = gemm_fns(M, K, N)
        times, errs = {}, {}
        for label, fn in fns.items():
            try:
                out = fn().double()
                errs[label] = ((out - exact).norm() / exact.norm()).item()
                times[label] = graph_ms(fn)
            except Exception as e:  # an unsupported layout or dtype: say which
                times[label], errs[label] = float("nan"), f"{type(e).__name__}: {str(e)[:80]}"
        rows.append((name, (M, K, N), times, errs))
        torch.cuda.empty_cache()
    labels = list(rows[0][2])
    print("| GEMM | M, K, N | " + " | ".join(f"{l} ms" for l in labels) + " | 1x128 vs tensorwise |")
    print("|---|---|" + "---|" * len(labels) + "---|")
    for name, mkn, t, _ in rows:
        ratio = t["fp8 tensorwise"] / t["fp8 1x128 x 1x128"]
        print(f"| {name} | {mkn} | " + " | ".join(f"{t[l]:.3f}" for l in labels) + f" | {ratio:.2f}x |")
    print("\nrelative error vs the float64 product (bf16 output):")
    for name, _, _, e in rows:
        print(name, {k: (f"{v:.1e}" if isinstance(v, float) else v) for k, v in e.items()})


if __name__ == "__main__":
    main()
