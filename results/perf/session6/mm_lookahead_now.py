"""Session 6's check (mm_lookahead.txt, last part): kernels.fp4_matmul (look-ahead, 256 x 128 tiles) at
8192^3 against cuBLAS bf16, and its result against dequantize + fp32 mm. Run from the repo root."""
import datetime, sys, torch, triton
sys.path[:0] = ["."]
import fp4, kernels
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
for name in ("ufp4", "nvfp4", "mxfp4"):
    fmt = fp4.get_format(name)
    qa, qw = kernels.quantize(a, fmt), kernels.quantize(w, fmt)
    c = kernels.fp4_matmul(qa, qw, torch.float32)
    ref = kernels.dequantize(qa, torch.float32) @ kernels.dequantize(qw, torch.float32).t()
    rel = ((c - ref).abs().max() / ref.abs().max()).item()
    t = ms(lambda: kernels.fp4_matmul(qa, qw, torch.bfloat16))
    print(f"{name}: fp4_matmul {t:.3f} ms = {t_cublas / t:.3f}x cuBLAS; max |diff| / max |ref| vs dequantize + fp32 mm {rel:.2e}", flush=True)
