"""Session 7's GEMM experiment (CFGS="BM,BN,BK,G,W,S ..." and PF=0/1 narrow it): kernels.fp4_matmul at 8192^3 under several tiles, warps and
PREFETCH, against the kernel of the commit before (tmp_kernels_old.py = `git show 5a9cc90:kernels.py`,
conversions in the main loop) and cuBLAS bf16, timed in one process; each variant's output is
compared bit for bit with the old kernel's. Run from the repo root.
It ran on the working tree of its time, whose kernels.py had a module switch MM_PREFETCH for the
kernel's PREFETCH (the packed tiles loaded one step earlier still); the switch went with the
results (never faster at the best tiles), so on later trees the 'prefetch True' rows repeat the
'prefetch False' kernel."""
import datetime, sys, torch, triton
sys.path[:0] = ["."]
import fp4, kernels, tmp_kernels_old as old
def ms(fn, n=10):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n
print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
S = 8192
a = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
w = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
t_cublas = ms(lambda: a @ w.t())
print(f"cuBLAS bf16 {t_cublas:.3f} ms")
import os
CFGS = [tuple(int(v) for v in c.split(",")) for c in os.environ["CFGS"].split()] if "CFGS" in os.environ else \
    [(256, 128, 64, 8, 8, 3), (256, 128, 64, 8, 16, 3), (128, 256, 64, 8, 16, 3),
     (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 4, 3), (256, 128, 128, 8, 16, 3)]
for name in ("ufp4", "nvfp4", "mxfp4"):
    fmt = fp4.get_format(name)
    qa, qw = kernels.quantize(a, fmt), kernels.quantize(w, fmt)
    ref = old.fp4_matmul(qa, qw, torch.bfloat16)
    t = ms(lambda: old.fp4_matmul(qa, qw, torch.bfloat16))
    print(f"{name}: old kernel {t:.3f} ms = {t_cublas / t:.3f}x cuBLAS", flush=True)
    for cfg in CFGS:
        for pf in ((False, True) if "PF" not in os.environ else (os.environ["PF"] == "1",)):
            kernels._MM_CFG, kernels.MM_PREFETCH = cfg, pf
            try:
                c = kernels.fp4_matmul(qa, qw, torch.bfloat16)
                t = ms(lambda: kernels.fp4_matmul(qa, qw, torch.bfloat16))
                eq = torch.equal(c.view(torch.int16), ref.view(torch.int16))
                d = (c.float() - ref.float()).abs().max().item()
                print(f"{name} {cfg} prefetch {pf}: {t:.3f} ms = {t_cublas / t:.3f}x cuBLAS; equal to old: {eq} (max diff {d:.3g})", flush=True)
            except Exception as e:
                print(f"{name} {cfg} prefetch {pf}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
    kernels._MM_CFG, kernels.MM_PREFETCH = None, True
