"""One-off probe: kernels._philox (64-bit products) equals tl.randint4x bit for bit under the interpreter
(TRITON_INTERPRET=1 python dev/philox_wide_probe.py); its SASS count: python dev/sass_count.py."""
import torch, triton, triton.language as tl, sys
sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__import__("os").path.abspath(__file__)), ".."))
import kernels
@triton.jit
def probe(w_ptr, v_ptr, seed, N: tl.constexpr, ROUNDS: tl.constexpr):
    off = tl.program_id(0) * N + tl.arange(0, N)
    cnt = tl.load(w_ptr + off * 0 + off)  # counters
    a = tl.randint4x(seed, cnt, ROUNDS)
    b = kernels._philox(seed, cnt, ROUNDS)
    for j in tl.static_range(4):
        pass
    tl.store(v_ptr + off * 8 + 0, a[0].to(tl.int32, bitcast=True)); tl.store(v_ptr + off * 8 + 4, b[0].to(tl.int32, bitcast=True))
    tl.store(v_ptr + off * 8 + 1, a[1].to(tl.int32, bitcast=True)); tl.store(v_ptr + off * 8 + 5, b[1].to(tl.int32, bitcast=True))
    tl.store(v_ptr + off * 8 + 2, a[2].to(tl.int32, bitcast=True)); tl.store(v_ptr + off * 8 + 6, b[2].to(tl.int32, bitcast=True))
    tl.store(v_ptr + off * 8 + 3, a[3].to(tl.int32, bitcast=True)); tl.store(v_ptr + off * 8 + 7, b[3].to(tl.int32, bitcast=True))
g = torch.Generator().manual_seed(0)
for seed in [0, 1, 1234, 2**31 - 9, int(torch.randint(0, 2**31 - 8, (1,), generator=g))]:
    for rounds in (10, 7):
        N = 64
        cnt = torch.randint(0, 2**31 - 1, (N,), dtype=torch.int32, generator=g)
        cnt[:3] = torch.tensor([0, 1, 2**31 - 1], dtype=torch.int32)
        v = torch.empty(N, 8, dtype=torch.int32)
        probe[(1,)](cnt, v, seed, N, rounds)
        assert torch.equal(v[:, :4], v[:, 4:]), (seed, rounds)
print("equal")
