"""One-off: the grouped FP8 GEMM (kernels.fp8_grouped_mm) against torch._grouped_mm in bf16 at the
MoE experts' shapes (8 experts, 16k tokens top-2, d 768, hidden 1536): a tile sweep, fast and
promoted accumulation, relative error against the fp64 product of the same FP8 operands.
    python dev/sweep_grouped_fp8.py"""
import sys, os
import torch, triton
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
dev = "cuda"
torch.manual_seed(0)
counts = torch.tensor([5056, 0, 2944, 3152, 4032, 5664, 4944, 6976])
counts = (counts + 31) // 32 * 32
offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
N, E = int(counts.sum()), 8


def graphed(f):
    st = torch.cuda.Stream(); st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3):
            f()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f()
    return g.replay


def bench(f):
    return triton.testing.do_bench(graphed(f), warmup=25, rep=200)


def fp8(shape, dt):  # int-grid values times powers of two: exact in e4m3 and e5m2
    v = torch.randint(-7, 8, shape, device=dev).float() * 2.0 ** torch.randint(-3, 4, shape, device=dev).float()
    return v.to(dt)


def ref_rows(a, b):
    ends = offs.tolist(); starts = [0] + ends[:-1]
    return torch.cat([a[s:t].double() @ b[g].double() for g, (s, t) in enumerate(zip(starts, ends))])


def ref_k(a, b):
    ends = offs.tolist(); starts = [0] + ends[:-1]
    return torch.stack([a[:, s:t].double() @ b[s:t].double() for s, t in zip(starts, ends)])


one = torch.ones((), device=dev)
cases = []
for nm, K, M, da in (("fc1 fprop", 768, 1536, E4), ("fc2 fprop", 1536, 768, E4),
                     ("fc2 dgrad", 768, 1536, E5), ("fc1 dgrad", 1536, 768, E5)):
    a = fp8((N, K), da); b = fp8((E, M, K), E4).transpose(1, 2)
    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16).contiguous()  # bf16 grouped: b [E, K, M]
    cases.append((nm, "rows", a, b, ab, bb, 2.0 * N * K * M))
for nm, M, Nn in (("fc1 wgrad", 1536, 768), ("fc2 wgrad", 768, 1536)):
    a = fp8((M, N), E5); b = fp8((Nn, N), E4).t()
    cases.append((nm, "k", a, b, a.to(torch.bfloat16), b.to(torch.bfloat16), 2.0 * N * M * Nn))

cfgs = [(128, 128, 128, 8, 3), (128, 128, 128, 4, 3), (128, 256, 128, 8, 3), (128, 128, 64, 8, 4),
        (256, 128, 64, 8, 3)]
promotes = [32, 128]
print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} N {N} counts {counts.tolist()}")
rows = []
for nm, mode, a, b, ab, bb, flop in cases:
    out = torch.float32 if mode == "k" else torch.bfloat16
    bf = lambda: torch._grouped_mm(ab, bb, offs=offs)
    t_bf = bench(bf)
    ref = (ref_rows if mode == "rows" else ref_k)(a, b)
    for cfg in cfgs:
        for variant in promotes + ["fast"]:
            fast = variant == "fast"
            if not fast and variant > cfg[2]:
                continue  # (Triton: at most BK products between promotions)
            c6 = cfg + (0 if fast else variant,)
            try:
                f = lambda: kernels.fp8_grouped_mm((a, one), (b, one), offs, out, fast=fast, _cfg=c6)
                c = f(); torch.cuda.synchronize()
                err = ((c.double() - ref).norm() / ref.norm()).item()
                t = bench(f)
            except Exception as e:  # noqa: BLE001
                print(nm, cfg, variant, "FAILED", repr(e)[:300]); continue
            rows.append((nm, cfg, variant, t, t_bf / t, flop / t / 1e9, err))
            print(f"{nm:10s} {str(cfg):24s} {variant!s:5s} {t*1e3:8.1f} us  x bf16 {t_bf/t:5.2f}  {flop/t/1e9:6.0f} TFLOP/s  err {err:.2e}", flush=True)
    print(f"{nm:10s} bf16 grouped {t_bf*1e3:8.1f} us {flop/t_bf/1e9:6.0f} TFLOP/s", flush=True)

print("\n| GEMM | accumulation | best cfg | us | x bf16 | rel. error vs fp64 |")
print("|---|---|---|---|---|---|")
for nm in dict.fromkeys(r[0] for r in rows):
    for v in promotes + ["fast"]:
        sel = [r for r in rows if r[0] == nm and r[2] == v]
        if sel:
            r = min(sel, key=lambda r: r[3])
            print(f"| {nm} | {'fast' if v == 'fast' else f'promote every {v}'} | {r[1]} | {r[3]*1e3:.1f} | {r[4]:.2f} | {r[6]:.1e} |")
