"""One-off: the cost, per layer call, of keeping Wgrad's x packed on the FP8 path (graph replay on
one H200): the fused quantize of x with an FP8 side and an FP8 or packed side, the packed -> FP8
conversion of backward, its scales-max launch alone, and a bf16 copy of x for scale."""
import torch, fp4, kernels
E = torch.cuda.Event
def t(f, n=100):
    f(); f(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f()
    g.replay(); torch.cuda.synchronize()
    a, b = E(enable_timing=True), E(enable_timing=True)
    a.record()
    for _ in range(n):
        g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1e3
print("T K | pair fp8+fp8 | pair fp8+packed | fp8_from_packed | scales max only | bf16 copy (us, graph replay)")
for T, K in ((8192, 768), (8192, 3072), (3072, 8192)):
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    q = fp4.quantize(x, "mxfp4", dim=0, rht=16)
    top = torch.zeros(1, device="cuda", dtype=torch.int32)
    n = q.scales.numel()
    fs = [lambda: kernels.quantize_both(x, "mxfp4", rht_col=16, fp8=(fp4.E4M3, fp4.E4M3)),
          lambda: kernels.quantize_both(x, "mxfp4", rht_col=16, packed=(False, True), fp8=(fp4.E4M3, None)),
          lambda: kernels.fp8_from_packed(q),
          lambda: kernels._launch(kernels._scales_max_kernel, (kernels._cdiv(n, 1024), 1, 1), (q.scales, n, top), dict(BLOCK=1024, num_warps=4)),
          lambda: x.clone()]
    print(T, K, " | ".join(f"{t(f):.1f}" for f in fs))
