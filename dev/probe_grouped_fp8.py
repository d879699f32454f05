"""One-off probe (GPU): torch._scaled_grouped_mm for the MoE experts' three GEMMs on Hopper.

    python dev/probe_grouped_fp8.py [--tokens=32768] [--experts=8] [--d=768] [--h=1536]

For each GEMM of one expert linear (Fprop x @ W^T, Dgrad dy @ W, Wgrad dy^T x per expert):
whether torch's FP8 grouped GEMM takes it (e4m3 only, one fp32 scale per row / column), its
time against torch._grouped_mm in bf16 (CUDA-graph replays), and its error against the fp32
product of the same fake-quantized mxfp4 operands, with the per-row power-of-two scales that
keep them exact (and the fraction of blocks that fall out of e4m3's window under them).
Prints a table last."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4  # noqa: E402

E4M3 = torch.float8_e4m3fn


def graph_ms(fn, reps=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps


def row_fp8(fake, dim):
    """fake-quantized values (e8m0 blocks along dim) -> (e4m3 values, fp32 scale per slice
    across dim): the scale is 2^(e - 6) for the slice's largest power of two e, so the slice's
    top block lands at e4m3's top; also the fraction of values not exact in e4m3."""
    amax = fake.abs().amax(dim=dim, keepdim=True).float()
    e = torch.floor(torch.log2(amax.clamp(min=2.0**-126)))
    scale = torch.exp2(e - 6)
    v = (fake.float() / scale).to(E4M3)
    inexact = (v.float() * scale != fake.float()).float().mean().item()
    return v, scale.squeeze(dim), inexact


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)   # 16k tokens x top-2
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--h", type=int, default=1536)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    E, N, d, h = a.experts, a.tokens, a.d, a.h
    # group sizes: uneven, multiples of 16 (the 2D x 2D form's requirement), one empty group
    w = torch.rand(E) + 0.5
    w[1] = 0
    counts = (w / w.sum() * N / 16).floor().long() * 16
    counts[0] += N - counts.sum()
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    print("torch", torch.__version__, torch.cuda.get_device_name(), "counts", counts.tolist())
    x = torch.randn(N, d, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(N, h, device=dev, dtype=torch.bfloat16) * 1e-3
    W = torch.randn(E, h, d, device=dev, dtype=torch.bfloat16) * 0.02
    fq = lambda t, dim: fp4.fake_quant(t, "mxfp4", dim=dim, dtype=torch.float32)  # noqa: E731
    rows = []

    def case(name, bf16_fn, fp8_fn, ref):
        try:
            out = fp8_fn()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            t8 = graph_ms(fp8_fn)
            note = ""
        except Exception as e:  # noqa: BLE001 (a probe: report what torch refuses)
            err, t8, note = float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:90]}"
        tb = graph_ms(bf16_fn)
        rows.append((name, tb, t8, tb / t8 if t8 == t8 else float("nan"), err, note))

    # Fprop: y [N, h] = x [N, d] @ W^T per group; A row-major, B [E, d, h] column-major
    xf, Wf = fq(x, -1), fq(W, -1)
    xv, xs, x_in = row_fp8(xf, -1)
    wv, ws, w_in = row_fp8(Wf, -1)                     # [E, h, d], scale [E, h]
    ref = torch.cat([xf[s:t] @ Wf[e].T for e, (s, t) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
    case("fprop x @ W^T", lambda: torch._grouped_mm(x, W.transpose(-1, -2), offs=offs),
         lambda: torch._scaled_grouped_mm(xv, wv.transpose(-1, -2), xs, ws, offs=offs,
                                          out_dtype=torch.bfloat16), ref)
    # Dgrad: dx [N, d] = dy [N, h] @ W per group; B [E, h, d] column-major: W^T stored contiguous
    dyf, Wdf = fq(dy, -1), fq(W, -2)
    dv, ds, dy_in = row_fp8(dyf, -1)
    wdv, wds, wd_in = row_fp8(Wdf.transpose(-1, -2).contiguous(), -1)   # [E, d, h], scale [E, d]
    ref = torch.cat([dyf[s:t] @ Wdf[e] for e, (s, t) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
    case("dgrad dy @ W", lambda: torch._grouped_mm(dy, W, offs=offs),
         lambda: torch._scaled_grouped_mm(dv, wdv.transpose(-1, -2), ds, wds, offs=offs,
                                          out_dtype=torch.bfloat16), ref)
    # Wgrad: dW [E, h, d] = dy^T x per group (reduction over the group's tokens); one scale per
    # row per group: here per row over all tokens (exactness per group is the stricter case)
    dyt, xt = fq(dy.T.contiguous(), -1), fq(x.T.contiguous(), -1)       # blocks along tokens
    gv, gs, g_in = row_fp8(dyt, -1)                                     # [h, N], scale [h]
    xv2, xs2, x2_in = row_fp8(xt, -1)                                   # [d, N], scale [d]
    bounds = list(zip([0] + offs.tolist()[:-1], offs.tolist()))
    ref = torch.stack([dyt[:, s:t] @ xt[:, s:t].T for s, t in bounds])
    case("wgrad dy^T x", lambda: torch._grouped_mm(dy.T, x, offs=offs),
         lambda: torch._scaled_grouped_mm(gv, xv2.T, gs.repeat(E), xs2.repeat(E), offs=offs,
                                          out_dtype=torch.bfloat16), ref)
    # e5m2 (the dense FP8 path's dy): refused?
    try:
        torch._scaled_grouped_mm(dv.float().to(torch.float8_e5m2), wdv.transpose(-1, -2), ds, wds,
                                 offs=offs, out_dtype=torch.bfloat16)
        e5 = "accepted"
    except Exception as e:  # noqa: BLE001
        e5 = f"refused ({type(e).__name__}: {str(e)[:80]})"
    print(f"\nvalues not exact in e4m3 under per-row scales: x {x_in:.2e}, W {w_in:.2e}, dy {dy_in:.2e}, "
          f"W(dgrad) {wd_in:.2e}, dy^T {g_in:.2e}, x^T {x2_in:.2e}; e5m2 x e4m3: {e5}")
    print("\n| GEMM | bf16 grouped ms | FP8 grouped ms | speedup | rel. error vs fp32 | note |")
    print("|---|---|---|---|---|---|")
    for name, tb, t8, sp, err, note in rows:
        print(f"| {name} | {tb:.3f} | {t8:.3f} | {sp:.2f}x | {err:.2e} | {note} |")


if __name__ == "__main__":
    main()
