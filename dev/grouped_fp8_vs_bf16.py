"""One-off: the MoE experts' six grouped GEMMs (8 experts, 32800 routed rows, 768 <-> 1536) on
kernels.fp8_grouped_mm (the layer's tiles, fast and promoted every 128) against torch's bf16
grouped GEMM with its operands laid out as the bf16 recipe passes them (fp4._backward/_forward:
W^T and dy^T as transposed views) and as contiguous copies; then Wgrad with its partial sums
promoted less often than every K step (fast dots over P K steps, one fp32 add), two ways.
Times: CUDA-graph replay; errors: relative (Frobenius) against the fp64 product of the same FP8
operands. Usage: python dev/grouped_fp8_vs_bf16.py [uneven|even] (how the rows split over the experts)"""
import math
import sys

import torch
import triton
import triton.language as tl

import fp4
import kernels


@triton.jit
def _k_chunked(a_ptr, b_ptr, sa_ptr, sb_ptr, offs_ptr, c_ptr, M, N, T,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STEPS: tl.constexpr):
    """kernels._grouped_fp8_k_kernel, fast dots over STEPS K steps (unrolled) between fp32 adds."""
    pid, g = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BN)
    rows = (pid // num_n) * BM + tl.arange(0, BM)
    cols = (pid % num_n) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    start = tl.multiple_of(tl.load(offs_ptr + g - 1, mask=g > 0, other=0), 16)
    end = tl.multiple_of(tl.load(offs_ptr + g), 16)
    rok, cok = rows < M, cols < N
    a_p = a_ptr + rows[:, None].to(tl.int64) * T + ks[None, :]
    b_p = b_ptr + cols[:, None].to(tl.int64) * T + ks[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(start, end, BK * STEPS):
        part = tl.zeros((BM, BN), dtype=tl.float32)
        for j in tl.static_range(STEPS):
            kk = k0 + j * BK
            kok = (kk + ks) < end
            a = tl.load(a_p + kk, mask=rok[:, None] & kok[None, :], other=0.0)
            b = tl.load(b_p + kk, mask=cok[:, None] & kok[None, :], other=0.0)
            part = tl.dot(a, tl.trans(b), part)
        acc += part
    acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    off = g.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(c_ptr + off, acc, mask=rok[:, None] & cok[None, :])


@triton.jit
def _k_every(a_ptr, b_ptr, sa_ptr, sb_ptr, offs_ptr, c_ptr, M, N, T,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STEPS: tl.constexpr):
    """One loop of fast dots into `part`, added into the fp32 accumulator every STEPS K steps."""
    pid, g = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BN)
    rows = (pid // num_n) * BM + tl.arange(0, BM)
    cols = (pid % num_n) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    start = tl.multiple_of(tl.load(offs_ptr + g - 1, mask=g > 0, other=0), 16)
    end = tl.multiple_of(tl.load(offs_ptr + g), 16)
    rok, cok = rows < M, cols < N
    a_p = a_ptr + rows[:, None].to(tl.int64) * T + ks[None, :]
    b_p = b_ptr + cols[:, None].to(tl.int64) * T + ks[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    part = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(start, end, BK):
        kok = (k0 + ks) < end
        a = tl.load(a_p + k0, mask=rok[:, None] & kok[None, :], other=0.0)
        b = tl.load(b_p + k0, mask=cok[:, None] & kok[None, :], other=0.0)
        part = tl.dot(a, tl.trans(b), part)
        if ((k0 - start) // BK) % STEPS == STEPS - 1:
            acc += part
            part = tl.zeros((BM, BN), dtype=tl.float32)
    acc = (acc + part) * (tl.load(sa_ptr) * tl.load(sb_ptr))
    off = g.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(c_ptr + off, acc, mask=rok[:, None] & cok[None, :])


def graph_ms(fn, reps=10, rounds=5):
    """ms per call: CUDA-graph replay of `reps` calls, best of `rounds`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    best = math.inf
    for _ in range(rounds):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        best = min(best, t0.elapsed_time(t1) / reps)
    return best


def run_custom(kernel, steps, a, b, offs, cfg=(128, 128, 128, 4, 3)):
    (av, sa), (bv, sb) = a, b
    BM, BN, BK, nw, ns = cfg
    M, T = av.shape
    bt = bv.t()
    N, E = bt.shape[0], offs.shape[0]
    c = torch.empty(E, M, N, device=av.device, dtype=torch.float32)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN), E)
    kernel[grid](av, bt, sa, sb, offs, c, M, N, T, BM=BM, BN=BN, BK=BK, STEPS=steps,
                 num_warps=nw, num_stages=ns)
    return c


COUNTS = {"uneven": [5056, 0, 2944, 3168, 4032, 5664, 4960, 6976],  # as the tile sweep; 32800 rows
          "even": [4096, 4160, 4032, 4128, 4064, 4096, 4112, 4112]}


def rel_err(got, exact):
    return ((got.double() - exact).norm() / exact.norm()).item()


def exact_rows(a, b, offs):
    av, bv = a[0].double() * a[1].double(), b[0].double() * b[1].double()
    ends = [0] + offs.tolist()
    return torch.cat([av[s:t] @ bv[g] for g, (s, t) in enumerate(zip(ends[:-1], ends[1:]))])


def exact_k(a, b, offs):
    av, bv = a[0].double() * a[1].double(), b[0].double() * b[1].double()
    ends = [0] + offs.tolist()
    return torch.stack([av[:, s:t] @ bv[s:t] for s, t in zip(ends[:-1], ends[1:])])


def gemms(fmt, offs, T):
    """(name, FP8 a, FP8 b, bf16 a, bf16 b as the recipe passes them, exact product fn, out dtype)
    for the experts' fc1 (768 -> 1536) and fc2 (1536 -> 768)."""
    out = []
    for layer, d_in, d_out in (("fc1", 768, 1536), ("fc2", 1536, 768)):
        x = torch.randn(T, d_in, device="cuda").bfloat16()
        rows = torch.exp2(torch.empty(T, 1, device="cuda").uniform_(-8, 8))
        dy = (torch.distributions.StudentT(3.0).sample((T, d_out)).cuda() * rows).bfloat16()
        w = (torch.randn(8, d_out, d_in, device="cuda") * 0.02).bfloat16()
        e5 = dict(fp8=fp4.E5M2)
        out += [(f"{layer} fprop", fp4.to_fp8(x, fmt, dim=-1), fp4._t(fp4.to_fp8(w, fmt, dim=-1)),
                 x, fp4._t(w), exact_rows, torch.bfloat16),
                (f"{layer} dgrad", fp4.to_fp8(dy, fmt, dim=-1, **e5), fp4.to_fp8(w, fmt, dim=-2),
                 dy, w, exact_rows, torch.bfloat16),
                (f"{layer} wgrad", fp4._t(fp4.to_fp8(dy, fmt, dim=0, **e5)), fp4.to_fp8(x, fmt, dim=0),
                 fp4._t(dy), x, exact_k, torch.float32)]
    return out


def main():
    torch.manual_seed(0)
    counts = COUNTS[sys.argv[1] if len(sys.argv) > 1 else "uneven"]
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    T = sum(counts)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"counts {counts}")
    print("| GEMM | format | variant | us | vs bf16 (recipe layout) | rel. error vs fp64 |")
    print("|---|---|---|---|---|---|")
    for fmt in ("mxfp4", "mxint4"):
        for name, a, b, ab, bb, exact_fn, out in gemms(fmt, offs, T):
            exact = exact_fn(a, b, offs)
            bf = graph_ms(lambda: torch._grouped_mm(ab, bb, offs=offs)) * 1e3
            bfc = graph_ms(lambda: torch._grouped_mm(ab.contiguous(), bb.contiguous(), offs=offs)) * 1e3
            bfc -= graph_ms(lambda: (ab.contiguous(), bb.contiguous())) * 1e3  # the copies' time
            print(f"| {name} | bf16 | recipe layout {tuple(ab.stride())} x {tuple(bb.stride())} | {bf:.1f} | 1.00x | |")
            print(f"| {name} | bf16 | both contiguous (copies not counted) | {bfc:.1f} | {bf / bfc:.2f}x | |")
            variants = [("fast", lambda: kernels.fp8_grouped_mm(a, b, offs, out, fast=True)),
                        ("promoted every 128", lambda: kernels.fp8_grouped_mm(a, b, offs, out))]
            if "wgrad" in name:
                variants += [("unrolled fast dots, add every 256", lambda: run_custom(_k_chunked, 2, a, b, offs)),
                             ("one loop, add every 512", lambda: run_custom(_k_every, 4, a, b, offs))]
            for what, fn in variants:
                try:
                    err = rel_err(fn(), exact)
                    us = graph_ms(fn) * 1e3
                    print(f"| {name} | {fmt} | {what} | {us:.1f} | {bf / us:.2f}x | {err:.2e} |")
                except Exception as e:  # a variant that does not compile is a result too
                    print(f"| {name} | {fmt} | {what} | failed: {type(e).__name__}: {str(e)[:80]} | | |")


if __name__ == "__main__":
    main()
