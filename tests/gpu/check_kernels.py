"""GPU-only check of kernels.py at real sizes: every kernel against fp4.py's torch reference run
on the same GPU, bit for bit (RTNE); SR statistics; fp4_matmul vs fake quant + mm; FP4Linear
with backend triton vs backend torch (y, dx, dW); the FP8 operands bit for bit, the FP8 GEMM
against the exact product, the layer on FP8 GEMMs, with its weight cached and with Wgrad's x
kept as FP8; the grouped FP8 GEMM against the exact product and the experts on it; the training
loss's chunks (softmax_grad_, model.linear_cross_entropy) against whole logits.

    python tests/gpu/check_kernels.py [--quick] [--only=fp8] [--part=k/n]

Exits 0 when all pass, 1 on any failure; prints 'skip' and exits 0 without CUDA."""
import argparse
import dataclasses
import math
import os
import sys
import time
import traceback
import typing

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

if {"-h", "--help"} & set(sys.argv[1:]):   # (before the skip: the options show on any machine)
    print(__doc__)
    sys.exit(0)
if not torch.cuda.is_available():
    print("skip: no CUDA device")
    sys.exit(0)

import fp4  # noqa: E402
import kernels  # noqa: E402
import model  # noqa: E402
from bitwise import assert_same as same, element_scales  # noqa: E402

DEV = "cuda"
RESULTS = []


def same_q(q, r, what):
    same(q.codes, r.codes, what + " codes")
    same(q.scales, r.scales, what + " scales")
    same(q.tensor_scale, r.tensor_scale, what + " s_enc")


def ref(fn, *a, **k):
    fp4.set_backend("torch")
    try:
        return fn(*a, **k)
    finally:
        fp4.set_backend("auto")


PART = (0, 1)  # (k, n): run only checks k, k + n, k + 2n, ... (parallel processes compile in parallel)
ONLY = ""      # run only the checks whose name contains this
_COUNTER = [0]


def check(name, fn):
    i = _COUNTER[0]
    _COUNTER[0] += 1
    if i % PART[1] != PART[0] or ONLY.lower() not in name.lower():
        return
    t = time.time()
    try:
        fn()
        RESULTS.append((name, "ok", time.time() - t, ""))
        print(f"ok    {name}  ({time.time() - t:.1f}s)", flush=True)
    except Exception as e:  # noqa: BLE001 -- report every failure, keep going
        msg = f"{type(e).__name__}: {e}"
        RESULTS.append((name, "FAIL", time.time() - t, msg))
        print(f"FAIL  {name}: {msg}", flush=True)
        traceback.print_exc(limit=3)
    finally:
        torch.cuda.empty_cache()


def randn(*shape, seed=0, dtype=torch.bfloat16, specials=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(*shape, generator=g, device=DEV)
    x = x * torch.exp2(torch.randint(-10, 10, shape[:-1] + (1,), generator=g, device=DEV).float())
    if specials:  # zero rows/blocks, negative zeros, tiny negatives under a big amax
        x[0] = 0.0
        x[1, :64] = -0.0
        x[2, 1:64] = -1e-9
        x[2, 0] = 1.0
        x[3, :64] *= 1e-20
        # blocks whose e8m0 scale is the smallest, 2^-127: a subnormal where stored as bf16
        x[4, :64] = torch.randn(64, generator=g, device=DEV) * 2.0 ** -126
    return x.to(dtype)


def fmt_of(name, block_2d=False):
    f = fp4.FORMATS[name]
    return dataclasses.replace(f, block_2d=True) if block_2d else f


def check_quant(x, fmt, dim, rht, packed=True, fake=True, dtype=torch.bfloat16):
    what = f"{fmt.name}{'/2d' if fmt.block_2d else ''} dim={dim} rht={rht}"
    if packed:
        q = kernels.quantize(x, fmt, dim=dim, rht=rht)
        r = ref(fp4.quantize, x, fmt, dim=dim, rht=rht)
        same_q(q, r, what)
        same(kernels.dequantize(q, dtype), ref(fp4.dequantize, r, dtype).contiguous(), what + " dequantize")
        del q, r
    if fake:
        same(kernels.fake_quant(x, fmt, dim=dim, rht=rht, dtype=dtype),
             ref(fp4.fake_quant, x, fmt, dim=dim, rht=rht, dtype=dtype).contiguous(), what + " fake_quant")


def ieee_reference_scales():
    """fp4.block_scales computes amax / qmax with a Python-float divisor; on CUDA PyTorch turns
    that into a multiply by the fp32 reciprocal (BinaryDivTrueKernel's CPU-scalar path), which
    is not the IEEE quotient that the CPU (and the spec, and kernels.py) computes, so block scales
    can differ by an ulp. If this fp4.py does that, check against the IEEE formula on the GPU
    (the result the CPU reference gives; a CPU comparison below confirms it)."""
    probe = torch.rand(1 << 16, device=DEV) * 100
    g = fp4.GRIDS["int4"]
    if torch.equal(fp4.block_scales(probe, g, "fp32").cpu(), fp4.block_scales(probe.cpu(), g, "fp32")):
        print("fp4.block_scales: same on CPU and CUDA (IEEE division); reference used as is")
        return
    orig = fp4.block_scales

    def block_scales(amax, grid, scale_kind, s_enc=None):
        if scale_kind == "fp32":
            return amax / torch.full_like(amax, grid.qmax)
        if scale_kind == "e4m3":
            return fp4.round_e4m3(amax / torch.full_like(amax, grid.qmax) * s_enc)
        return orig(amax, grid, scale_kind, s_enc)
    fp4.block_scales = block_scales
    print("NOTE fp4.block_scales: amax / qmax differs between CUDA and CPU (CUDA multiplies by the "
          "reciprocal of a Python-scalar divisor); the GPU reference below divides by a tensor "
          "(IEEE, = the CPU reference). Suggested fix in fp4.py: amax / torch.full_like(amax, qmax).")


class Sizes(typing.NamedTuple):
    """The shapes of the checks: real training sizes, or smaller ones (--quick)."""
    big: tuple        # a square operand
    tall: tuple       # tokens x features
    gemm: tuple       # M, N, K of the packed GEMM
    wide_rows: int    # rows of the 3072-wide row-tile check
    linear: tuple     # T, in, out of the layer checks
    fc2_tokens: int   # tokens of the fc2-shaped FP8 GEMM
    cached: tuple     # T, in, out of the cached-weight check


FULL = Sizes((8192, 8192), (16384, 4096), (8192, 8192, 8192), 16384, (16384, 4096, 4096), 16384,
             (8192, 2048, 8192))
QUICK = Sizes((4096, 4096), (4096, 2048), (4096, 4096, 4096), 4096, (4096, 2048, 2048), 4096,
              (4096, 2048, 6144))


def vs_cpu():  # the kernels against the reference computed on the CPU
    x = randn(2048, 4096, seed=13, specials=True)
    for name, dim, rht in (("ufp4", 1, 16), ("nvfp4", 1, None), ("e2m1", 0, 16), ("nvint4", 0, None),
                           ("mxint4", 1, None), ("mxfp4", 1, 16)):
        fmt = fmt_of(name)
        q = kernels.quantize(x, fmt, dim=dim, rht=rht)
        r = fp4.quantize(x.cpu(), fmt, dim=dim, rht=rht)
        same(q.codes.cpu(), r.codes, f"{name} vs CPU codes")
        same(q.scales.cpu(), r.scales, f"{name} vs CPU scales")
        same(kernels.fake_quant(x, fmt, dim=dim, rht=rht).cpu(),
             fp4.fake_quant(x.cpu(), fmt, dim=dim, rht=rht).contiguous(), f"{name} vs CPU fake_quant")


def nonfinite():
    y = randn(2048, 1024, seed=3)
    y[5, 7] = float("nan")
    y[9, 100] = float("inf")
    y[700, 3] = -float("inf")
    for name in ("ufp4", "nvfp4", "mxfp4"):
        check_quant(y, fmt_of(name), 1, None)
        check_quant(y, fmt_of(name), 0, 16)


def tiny_tensors():
    """NVFP4's tensor scale for tiny tensors: past 2^64 (amax ~1e-18), where the kernels divide
    by a power of two of it, and capped at fp32's largest value (amax below ~8e-36, fp32
    subnormals included), where the zeros must stay zero; the GPU's own subnormal handling."""
    for scale in (1e-18, 1e-37, 1e-42):
        x = randn(4096, 2048, seed=36, dtype=torch.float32) * (scale / 1024)
        x[0, :5] = 0
        for dtype in (torch.float32, torch.bfloat16):
            for dim, rht in ((1, None), (1, 16), (0, 16)):
                check_quant(x.to(dtype), fmt_of("nvfp4"), dim, rht)
        out = kernels.fake_quant(x, "nvfp4", dtype=torch.float32)
        assert out.isfinite().all() and out[0, :5].eq(0).all(), f"amax {scale:g}: NaN, Inf or lost zeros"


def large_rht():
    y = randn(4096, 4096, seed=4)
    for n in (32, 64, 128):
        check_quant(y, fmt_of("ufp4"), 1, n, packed=False)
        check_quant(y, fmt_of("nvfp4"), 0, n, packed=False)


def weights_2d():
    w = randn(4096, 4096, seed=5, dtype=torch.float32)
    f2 = fmt_of("nvfp4", True)
    for dim in (1, 0):
        check_quant(w, f2, dim, None, dtype=torch.bfloat16)
    row, col = kernels.quantize_both(w, f2, dtype=torch.bfloat16)
    same(row, col, "2D tiles: Q(W) row-wise == column-wise")


def experts_2d():
    w = randn(8, 1024, 2048, seed=14, dtype=torch.float32)
    for dim in (2, 1):
        check_quant(w, fmt_of("nvfp4", True), dim, None)


def both_orientations(sz):
    x = randn(*sz.tall, seed=6)
    row, col = kernels.quantize_both(x, "nvfp4", rht_col=None, dtype=torch.bfloat16)
    same(row, ref(fp4.fake_quant, x, "nvfp4", dim=1, dtype=torch.bfloat16), "both: row")
    same(col, ref(fp4.fake_quant, x, "nvfp4", dim=0, dtype=torch.bfloat16).contiguous(), "both: col")
    qr, qc = kernels.quantize_both(x, "ufp4", rht=16, rht_col=16, packed=True)
    same_q(qr, ref(fp4.quantize, x, "ufp4", dim=1, rht=16), "both packed: row")
    same_q(qc, ref(fp4.quantize, x, "ufp4", dim=0, rht=16), "both packed: col")


def both_layer(sz):  # what FP4Linear asks for: x fake row + packed col, dy SR both ways
    x = randn(*sz.tall, seed=15)
    seeds = torch.arange(6, device=DEV) + 41
    for name, rr, rc in (("ufp4", 16, 16), ("nvfp4", None, 16), ("e2m1", None, 16)):
        row, col = kernels.quantize_both(x, name, rht=rr, rht_col=rc, packed=(False, True),
                                         dtype=torch.bfloat16)
        same(row, ref(fp4.fake_quant, x, name, dim=1, rht=rr, dtype=torch.bfloat16), f"{name} x row")
        same_q(col, ref(fp4.quantize, x, name, dim=0, rht=rc), f"{name} x col packed")
        row, col = kernels.quantize_both(x, name, rounding="sr", rht=rr, rht_col=rc, seed=seeds[2],
                                         seed_col=seeds[4], dtype=torch.bfloat16)
        same(row, kernels.fake_quant(x, name, 1, "sr", rr, 43, torch.bfloat16), f"{name} dy row SR")
        same(col, kernels.fake_quant(x, name, 0, "sr", rc, 45, torch.bfloat16), f"{name} dy col SR")


def sr_unbiased():
    n = 4096
    g = torch.Generator(device=DEV).manual_seed(7)
    base = torch.randn(1, 1024, generator=g, device=DEV)
    for name, dim, rht in (("ufp4", 1, 16), ("nvfp4", 0, 16), ("mxfp4", 1, None)):
        fmt = fmt_of(name)
        x = base.expand(n, 1024).contiguous()
        if dim == 0:
            x = x.t().contiguous()
        y = kernels.fake_quant(x, fmt, dim=dim, rounding="sr", rht=rht, seed=11, dtype=torch.float32)
        if dim == 0:
            y = y.t()
        r = fp4.rht_transform(base, rht) if rht else base
        q = ref(fp4.quantize, r, fmt)
        scale = element_scales(q)[0]
        lv = fp4.GRIDS[fmt.grid].levels
        step = scale * max(b - a for a, b in zip(lv, lv[1:]))
        qmax = fp4.GRIDS[fmt.grid].qmax
        target = torch.maximum(torch.minimum(r[0].double(), qmax * scale), -qmax * scale)
        err = (y.double().mean(0) - target).abs()
        bound = 5 * step / 2 / math.sqrt(n) + 1e-7 * r.abs().max()
        assert (err <= bound).all(), f"SR {name}: max err/bound {(err / bound).max().item():.2f}"
        y2 = kernels.fake_quant(x, fmt, dim=dim, rounding="sr", rht=rht, seed=11, dtype=torch.float32)
        same(y2.t() if dim == 0 else y2, y, f"SR {name}: same seed, same bits")


def packed_gemm(sz):
    M, N, K = sz.gemm
    a = randn(M, K, seed=8)
    w = randn(N, K, seed=9)
    for name, rht in (("ufp4", 16), ("nvfp4", None), ("mxfp4", None), ("nvint4", 16)):
        fa, fw = fmt_of(name), fmt_of(name, block_2d=name.startswith("nv"))
        qa, qw = kernels.quantize(a, fa, rht=rht), kernels.quantize(w, fw, rht=rht)
        out = kernels.fp4_matmul(qa, qw, dtype=torch.float32)
        # the same bf16 operands (value x block scale), fp32 accumulation by cuBLAS
        opa = ref(fp4.dequantize, dataclasses.replace(qa, tensor_scale=None), torch.bfloat16)
        opw = ref(fp4.dequantize, dataclasses.replace(qw, tensor_scale=None), torch.bfloat16)
        r = opa.float() @ opw.float().t()   # fp32 GEMM (TF32 off by default)
        for q in (qa, qw):
            if q.tensor_scale is not None:
                r = r / q.tensor_scale
        rel = ((out - r).norm() / r.norm()).item()
        assert rel < 1e-5, f"{name}: fp4_matmul vs same-operand mm rel {rel:.2e}"
        fq = torch.mm(kernels.fake_quant(a, fa, rht=rht), kernels.fake_quant(w, fw, rht=rht).t())
        rel2 = ((out - fq.float()).norm() / fq.float().norm()).item()
        assert rel2 < 1e-2, f"{name}: fp4_matmul vs fake quant + mm rel {rel2:.2e}"
        print(f"      gemm {name}: rel vs same-operand mm {rel:.1e}, vs fake quant + mm {rel2:.1e}")


def fp32_activations():  # what FP4Linear feeds: fp32 x (master copy) -> bf16 fake quant
    x = randn(16384, 4096, seed=15, dtype=torch.float32) * 0.01
    for name in ("nvfp4", "ufp4", "mxfp4"):
        check_quant(x, fmt_of(name), 1, None)
        check_quant(x, fmt_of(name), 0, 16, packed=False)


def wide_rows(sz):  # the default row tiles at 3072 wide: 4 x 1024 (mode 2 for MXFP4's packed and SR)
    x = randn(sz.wide_rows, 3072, seed=16)
    for name in ("ufp4", "nvfp4", "mxfp4"):
        check_quant(x, fmt_of(name), 1, 16)
        sr = [kernels.fake_quant(x, name, 1, "sr", 16, 5, torch.bfloat16, _cfg=c) for c in (None, (32, 128, 4, 1))]
        same(sr[0], sr[1], f"{name} SR row: default tile == plain loads (same random bits)")


def linear_backends(sz, recipe_name, sr, fp8=False):
    T, IN, OUT = sz.linear
    recipe = fp4.make_recipe(recipe_name, sr_dy=sr, fp8_gemm=fp8 or None)
    torch.manual_seed(0)
    lin = fp4.FP4Linear(IN, OUT, bias=False, recipe=recipe, device=DEV)
    x = randn(T, IN, seed=10, dtype=torch.float32) * 0.01
    dy = randn(T, OUT, seed=12, dtype=torch.bfloat16)
    outs = {}
    for backend in ("torch", "triton"):
        fp4.set_backend(backend)
        xi = x.clone().requires_grad_(True)
        lin.weight.grad = None
        torch.manual_seed(1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = lin(xi)
        y.backward(dy.to(y.dtype))
        outs[backend] = (y.detach(), xi.grad, lin.weight.grad.clone())
    fp4.set_backend("auto")
    for i, nm in enumerate(("y", "dx", "dW")):
        a, b = outs["triton"][i], outs["torch"][i]
        if sr and nm != "y":  # different random bits: same distribution
            rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert rel < 0.2, f"{recipe_name} SR {nm}: rel diff {rel:.3f}"
        else:
            same(a, b, f"{recipe_name} {nm}")


def fp8_same(x, name, what, **kw):
    """kernels.to_fp8 of x == fp4.to_fp8 bit for bit (values, layout, scale): -> (values, scale)."""
    v, s = kernels.to_fp8(x, name, **kw)
    rv, rs = ref(fp4.to_fp8, x, name, **kw)
    assert v.stride() == rv.stride(), f"{what}: strides {v.stride()} vs {rv.stride()}"
    same(v.contiguous().view(torch.uint8), rv.contiguous().view(torch.uint8), what)
    same(s, rs, what + " scale")
    return v, s


def tensor_amax():
    """The amax passes behind the tensor scales: max |x| exactly, every time. NVFP4's
    (_tensor_amax) for row and column loads, 32- and 16-blocks, with and without RHT (row loads
    of whole 32-groups per thread once gave a wrong maximum now and then: docs/kernels.md, the
    amax pass); an FP8 side's plain amax (_flat_amax)."""
    for shape in ((4096, 3072), (4096, 2048), (768, 3072), (4096, 1024), (8192, 2048)):
        x = randn(*shape, seed=24)
        for _ in range(3):
            got = kernels._flat_amax(x).view(torch.float32).item()
            assert got == x.float().abs().max().item(), f"{shape} flat amax {got}"
        for col, rht in ((False, None), (False, 16), (True, 16)):
            want = (fp4.rht_transform(x.float(), rht, 0 if col else -1) if rht else x.float()).abs().max().item()
            for name in ("mxint4", "nvfp4"):
                for _ in range(3):
                    got = kernels._tensor_amax(x.view(1, *shape), fp4.get_format(name), rht, col)
                    got = got.view(torch.float32).item()
                    assert got == want, f"{shape} {name} rht={rht} col={col}: amax {got} vs {want}"


def fp8_operands(sz):
    x = randn(*sz.tall, seed=20)
    for name in ("mxfp4", "mxint4", "int4/16/e8m0"):
        for f8 in (fp4.E4M3, fp4.E5M2):
            for dim, rht in ((-1, None), (0, None), (-1, 16), (0, 32)):
                fp8_same(x, name, f"{name} {f8} dim={dim} rht={rht}", dim=dim, rht=rht, fp8=f8)
    for shape, dt in (((4096, 3072), torch.bfloat16), ((768, 3072), torch.bfloat16),
                      ((8192, 8192), torch.bfloat16), ((6144, 2048), torch.float32),
                      ((2048, 8192), torch.float32)):  # the fc2 check's and the wide model's
        xs = randn(*shape, seed=24, dtype=dt)
        for dim in (-1, 0):
            fp8_same(xs, "mxfp4", f"{shape} {dt} dim={dim}", dim=dim)
    # blocks down to fp32's subnormals, 200 binades below the top: the kernel folds the inverse
    # tensor scale into the block scales, whose products go subnormal there (FP8: +-0 either way)
    g = torch.Generator(device=DEV).manual_seed(25)
    xw = torch.randn(4096, 1024, generator=g, device=DEV)
    xw = xw * torch.exp2(torch.randint(-150, 60, (4096, 1), generator=g, device=DEV).float())
    for name in ("mxfp4", "mxint4"):
        for f8 in (fp4.E4M3, fp4.E5M2):
            for dim in (-1, 0):
                fp8_same(xw, name, f"{name} {f8} dim={dim}, 200 binades", dim=dim, fp8=f8)
    # a given scale (Fprop's x under fp8_x_scale 'unit'): no amax pass; blocks above its window NaN
    for name in ("mxfp4", "mxint4", "int4/16/e8m0"):
        for f8, scale in ((fp4.E5M2, 1.0), (fp4.E4M3, 2.0 ** -3)):
            for dim, rht in ((-1, None), (0, 16)):
                fp8_same(x, name, f"{name} {f8} at scale {scale} dim={dim}", dim=dim, rht=rht, fp8=f8,
                         scale=scale)
                v, s = kernels.to_fp8(xw, name, dim=dim, fp8=f8, scale=scale)
                rv, rs = ref(fp4.to_fp8, xw, name, dim=dim, fp8=f8, scale=scale)
                nan = rv.float().isnan()
                assert nan.any() and torch.equal(v.float().isnan(), nan), f"{name} {f8} NaN blocks"
                same(v.view(torch.uint8)[~nan], rv.view(torch.uint8)[~nan], f"{name} {f8} 200 binades")
    (a, sa), (b, sb) = kernels.quantize_both(x, "mxint4", rht_col=16, rounding="sr", seed=3,
                                             seed_col=3, fp8=(fp4.E5M2, fp4.E5M2))
    fa = kernels.fake_quant(x, "mxint4", dim=1, rounding="sr", seed=3, dtype=torch.float32)
    fb = kernels.fake_quant(x, "mxint4", dim=0, rht=16, rounding="sr", seed=3, dtype=torch.float32)
    same(a.float() * sa, fa, "pair row (SR) vs fake_quant")
    same(b.float() * sb, fb, "pair col (SR, RHT) vs fake_quant")


def fp8_from_packed(sz):
    """Wgrad's packed x turned into its FP8 operand (the dequantize kernel stores FP8 directly)
    == the reference bit for bit, values and scale; the rows spread over 2^-12..2^12 put blocks
    out of e4m3's window (counted by the layer, here the same bits all the same)."""
    x = randn(*sz.tall, seed=25)
    spread = (x.float() * torch.exp2(torch.randint(-12, 12, (x.shape[0], 1), device=DEV).float())).bfloat16()
    for name in ("mxfp4", "mxint4"):
        for t, tn in ((x, "gaussian"), (spread, "rows over 24 binades")):
            for f8 in (fp4.E4M3, fp4.E5M2):
                for dim, rht in ((0, None), (0, 16), (-1, None)):
                    what = f"{name} {tn} {f8} dim={dim} rht={rht}"
                    q = kernels.quantize(t, name, dim=dim, rht=rht)
                    v, s = fp4.fp8_from_packed(q, f8)
                    rv, rs = ref(fp4.fp8_from_packed, q, f8)
                    assert v.stride() == rv.stride(), f"{what}: strides {v.stride()} vs {rv.stride()}"
                    same(v.view(torch.uint8), rv.view(torch.uint8), what)
                    same(s, rs, what + " scale")


def fp8_gemm_exact(sz):
    T = sz.fc2_tokens
    x, w = randn(T, 3072, seed=21), randn(768, 3072, seed=22)
    (xv, xs), (wv, ws) = fp8_same(x, "mxint4", "fc2-shaped x"), fp8_same(w, "mxint4", "fc2-shaped W")
    exact = (xv.float().double() * xs.double()) @ (wv.float().double() * ws.double()).t()
    for fast in (False, True):
        got = torch._scaled_mm(xv, wv.t(), xs, ws, out_dtype=torch.float32, use_fast_accum=fast)
        rel = ((got.double() - exact).norm() / exact.norm()).item()
        print(f"      fc2-shaped FP8 GEMM, fast accumulation {fast}: relative error {rel:.2e}")
        assert rel < (1e-6 if not fast else 1e-4), f"fast={fast}: relative error {rel:.2e}"


def fp8_layer(sz, recipe_name, fast="none"):
    """y, dx, dW on FP8 GEMMs (fast: the GEMMs in fast accumulation) == on bf16 GEMMs, to bf16
    rounding."""
    T, IN, OUT = sz.linear
    outs = []
    for on in (True, False):
        recipe = fp4.make_recipe(recipe_name, sr_dy=False, fp8_gemm=on, fp8_fast_accum=fast if on else None)
        assert fp4._uses_fp8(recipe, None, torch.device(DEV)) == on
        torch.manual_seed(0)
        lin = fp4.FP4Linear(IN, OUT, bias=False, recipe=recipe, device=DEV)
        xi = (randn(T, IN, seed=10, dtype=torch.float32) * 0.01).requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = lin(xi)
        y.backward(randn(T, OUT, seed=12).to(y.dtype))
        outs.append((y.detach().float(), xi.grad.float(), lin.weight.grad.float()))
    for nm, a, b in zip(("y", "dx", "dW"), *outs):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 5e-3, f"{recipe_name} {nm}: FP8 vs bf16 GEMMs relative difference {rel:.2e}"


def fp8_cached_weight(sz, recipe_name):
    """fp4.cache_weights (both of W's FP8 operands from one read of the fp32 weight, kept; or
    kept packed, fp8_weight_cache="packed", and made FP8 in each call) == W quantized in each
    call: y, dx, dW bit for bit, SR on dy, two calls."""
    T, IN, OUT = sz.cached
    outs = []
    for cache in (None, "fp8", "packed"):
        torch.manual_seed(0)
        recipe = fp4.make_recipe(recipe_name, fp8_gemm=True, fp8_weight_cache=cache)
        lin = fp4.FP4Linear(IN, OUT, bias=False, recipe=recipe, device=DEV)
        assert fp4.cache_weights(lin) == 1 if cache else lin.weight_fprop is None
        for call in range(2):
            xi = (randn(T, IN, seed=10 + call, dtype=torch.float32) * 0.01).requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = lin(xi)
            y.backward(randn(T, OUT, seed=12 + call).to(y.dtype))
            outs.append((y.detach(), xi.grad, lin.weight.grad.clone()))
    for form, cached in (("fp8", outs[2:4]), ("packed", outs[4:])):
        for i, (a, b) in enumerate(zip(outs[:2], cached)):
            for nm, u, v in zip(("y", "dx", "dW"), a, b):
                same(u, v, f"{recipe_name} {form} cache, call {i} {nm}")


def _fp8_layer_forms(sz, recipe_name, field, forms, x, saved=None):
    """An FP4Linear on FP8 GEMMs under each value in `forms` of recipe field `field`, SR on dy
    seeded alike: y, dx and dW the same bit for bit. saved(form, dtypes): a check of the dtypes
    forward saved."""
    T, IN, OUT = sz.cached
    outs = []
    for form in forms:
        torch.manual_seed(0)
        recipe = fp4.make_recipe(recipe_name, fp8_gemm=True, **{field: form})
        lin = fp4.FP4Linear(IN, OUT, bias=False, recipe=recipe, device=DEV)
        xi = x.clone().requires_grad_(True)
        dtypes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: dtypes.append(t.dtype) or t, lambda t: t):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = lin(xi)
        if saved:
            saved(form, dtypes)
        y.backward(randn(T, OUT, seed=12).to(y.dtype))
        outs.append((y.detach(), xi.grad, lin.weight.grad))
    for nm, u, v in zip(("y", "dx", "dW"), *outs):
        same(u, v, f"{recipe_name} {field} {nm}")


def fp8_wgrad_x_kept(sz, recipe_name):
    """Wgrad's x kept as FP8 from forward (fp8_wgrad_x='fp8') == kept packed and made FP8 in
    backward, on data inside both forms' FP8 windows; forward saves e4m3 values only in the FP8
    form (the field reaches the layer)."""
    def saved(keep, dtypes):
        assert (fp4.E4M3 in dtypes) == (keep == "fp8"), f"{keep}: forward saved {dtypes}"
    T, IN, _ = sz.cached
    x = randn(T, IN, seed=10, dtype=torch.float32) * 0.01
    _fp8_layer_forms(sz, recipe_name, "fp8_wgrad_x", ("packed", "fp8"), x, saved)


def fp8_unit_x(sz, recipe_name):
    """Fprop's x in e5m2 at scale 1 (fp8_x_scale='unit') == e4m3 scaled by its amax, on plain
    Gaussian x, inside both windows (randn's rows from 2^-10 are not: there the forms differ)."""
    T, IN, _ = sz.cached
    x = torch.randn(T, IN, generator=torch.Generator(device=DEV).manual_seed(10), device=DEV)
    _fp8_layer_forms(sz, recipe_name, "fp8_x_scale", ("amax", "unit"), x)


def fp8_dy_step(sz, recipe_name):
    """dy's FP8 scale kept for the optimizer step (fp8_dy_scale='step') == found in every call,
    over two micro-steps after cache_weights (the second's dy doubled: inside the kept room), SR on
    dy seeded alike: dx and dW bit for bit; the state keeps the first dy's amax, its flag clear."""
    T, IN, OUT = sz.cached
    x = randn(T, IN, seed=10, dtype=torch.float32)
    outs = []
    for how in ("amax", "step"):
        torch.manual_seed(0)
        recipe = fp4.make_recipe(recipe_name, fp8_gemm=True, fp8_dy_scale=how)
        lin = fp4.FP4Linear(IN, OUT, bias=False, recipe=recipe, device=DEV)
        fp4.cache_weights(lin)
        grads = []
        for k in range(2):
            xi = x.clone().requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = lin(xi)
            y.backward(randn(T, OUT, seed=12) * (k + 1))
            grads += [xi.grad, lin.weight.grad.clone()]
            lin.weight.grad = None
        if how == "step":
            kept = fp4.step_state_amax(lin.dy_state)
            assert lin.dy_state[1] == 0 and kept == randn(T, OUT, seed=12).abs().max().float(), \
                lin.dy_state.tolist()
        outs.append(grads)
    for k, (u, v) in enumerate(zip(*outs)):
        same(u, v, f"{recipe_name} fp8_dy_scale micro-step {k // 2} {('dx', 'dW')[k % 2]}")


EXPERT_COUNTS = [1024, 0, 512, 2048, 32, 1216, 704, 736]  # multiples of 32, an empty group


def _group_products(a, b, offs, rows_form):
    """The exact per-group products of FP8 operands (values, scale), in fp64."""
    ends = offs.tolist()
    spans = list(zip([0] + ends[:-1], ends))
    av, bv = (v.double() * s.double() for v, s in (a, b))
    if rows_form:
        return torch.cat([av[s:t] @ bv[g] for g, (s, t) in enumerate(spans)])
    return torch.stack([av[:, s:t] @ bv[s:t] for s, t in spans])


def fp8_grouped_gemm():
    """kernels.fp8_grouped_mm at the MoE experts' shapes (8 experts, 768 -> 1536) on mxint4 and
    mxfp4 operands made by to_fp8, against the exact product of its operands: row groups (Fprop's
    x @ W^T) into bf16, groups along the tokens (Wgrad's dy^T x, e5m2 x e4m3) into fp32, in fast
    and in promoted accumulation."""
    offs = torch.tensor(EXPERT_COUNTS, device=DEV).cumsum(0).to(torch.int32)
    T = sum(EXPERT_COUNTS)
    x, dy = randn(T, 768, seed=31), randn(T, 1536, seed=32)
    w = randn(8, 1536, 768, seed=33) * 0.02
    for name in ("mxint4", "mxfp4"):
        xr, xc = fp4.to_fp8(x, name, dim=-1), fp4.to_fp8(x, name, dim=0)
        dyc = fp4.to_fp8(dy, name, dim=0, fp8=fp4.E5M2)
        wq = fp4.to_fp8(w, name, dim=-1)
        for what, a, b, out, rows in (("Fprop", xr, fp4._t(wq), torch.bfloat16, True),
                                      ("Wgrad", fp4._t(dyc), xc, torch.float32, False)):
            exact = _group_products(a, b, offs, rows)
            errs = []
            for fast in (False, True):
                got = fp4.fp8_grouped_mm(a, b, offs, out, fast=fast)
                errs.append(((got.double() - exact).norm() / exact.norm()).item())
                print(f"      {name} grouped {what}, fast accumulation {fast}: relative error {errs[-1]:.2e}")
            if out == torch.bfloat16:  # the output's rounding either way
                assert max(errs) < 4e-3, f"{name} {what}: relative errors {errs}"
            else:  # fp32 out (measured: promoted 6e-7 to 3e-6, fast 4e-6 to 1.4e-5)
                assert errs[0] < min(errs[1], 2e-5) and errs[1] < 1e-4, f"{name} {what}: relative errors {errs}"


def fp8_grouped_layer(recipe_name):
    """GroupedLinear (8 experts, 768 -> 1536, rows aligned as model.MoE lays them out) on FP8
    GEMMs == on bf16 GEMMs, to bf16 rounding: y, dx, dW, under bf16 autocast as in training."""
    counts = torch.tensor(EXPERT_COUNTS, device=DEV)
    outs = []
    for on in (True, False):
        recipe = fp4.make_recipe(recipe_name, sr_dy=False, fp8_gemm=on)
        assert fp4._uses_fp8(recipe, counts, torch.device(DEV)) == on
        torch.manual_seed(0)
        g = fp4.GroupedLinear(8, 768, 1536, recipe=recipe).to(DEV)
        xi = (randn(sum(EXPERT_COUNTS), 768, seed=34, dtype=torch.float32)).requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = g(xi, counts, aligned=True)
        y.backward(randn(*y.shape, seed=35).to(y.dtype))
        outs.append((y.detach().float(), xi.grad.float(), g.weight.grad.float()))
    for nm, a, b in zip(("y", "dx", "dW"), *outs):
        rel = ((a - b).norm() / b.norm()).item()
        print(f"      {recipe_name} experts {nm}: FP8 vs bf16 GEMMs relative difference {rel:.2e}")
        assert rel < 5e-3, f"{recipe_name} experts {nm}: FP8 vs bf16 GEMMs relative difference {rel:.2e}"


def per_format(sz):
    """Each format, row and column, fake quant with RHT16 and packed + dequantize."""
    xb = randn(*sz.big, seed=1, specials=True)
    xt = randn(*sz.tall, seed=2, specials=True)
    for name in fp4.FORMATS:
        fmt = fmt_of(name)
        check(f"{name}: row fake RHT16 {sz.big}", lambda: check_quant(xb, fmt, 1, 16, packed=False))
        check(f"{name}: col fake RHT16 {sz.tall}", lambda: check_quant(xt, fmt, 0, 16, packed=False))
        check(f"{name}: row packed+dequant {sz.tall}", lambda: check_quant(xt, fmt, 1, None, fake=False))
        check(f"{name}: col packed+dequant {sz.big}", lambda: check_quant(xb, fmt, 0, None, fake=False))


def grouped_aligned(name):
    """GroupedLinear on rows laid out in whole group_multiple groups (aligned=True, as model.MoE
    lays them out) == the same layer padding compact rows itself: y and dx bit for bit, dW to
    the bf16 rounding of the grouped GEMM's output. Under bf16 autocast, as in training."""
    r = fp4.make_recipe(name, sr_dy=False)  # no SR: rows move between the two layouts
    g = fp4.GroupedLinear(8, 768, 1536, recipe=r).to(DEV)
    m = g.group_multiple(torch.device(DEV))
    counts = [1000, 0, 517, 2048, 33, 1200, 700, 694]
    x = randn(sum(counts), 768, seed=9, dtype=torch.float32).requires_grad_()
    dy = randn(sum(counts), 1536, seed=10)
    padded = [-(-c // m) * m for c in counts]
    padded[-1] += 2 * m  # the last group takes the spare rows, as in model.MoE
    rows = torch.cat([torch.arange(s, s + c) for s, c in
                      zip(torch.tensor([0] + padded[:-1]).cumsum(0).tolist(), counts)]).to(DEV)
    xa = torch.zeros(sum(padded), 768, device=DEV).index_copy(0, rows, x.detach()).requires_grad_()
    dya = torch.zeros(sum(padded), 1536, device=DEV, dtype=dy.dtype).index_copy(0, rows, dy)
    outs = []
    for inp, cnt, grad, aligned in ((x, counts, dy, False), (xa, padded, dya, True)):
        g.weight.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = g(inp, torch.tensor(cnt, device=DEV), aligned=aligned)
        y.backward(grad)
        outs.append((y, inp.grad, g.weight.grad))
    (y, dx, dw), (ya, dxa, dwa) = outs
    same(ya[rows], y, f"{name} aligned y")
    same(dxa[rows], dx, f"{name} aligned dx")
    err = ((dwa - dw).norm() / dw.norm()).item()
    assert err < 4e-3, f"{name} aligned dW: relative difference {err:.1e}"
    print(f"      {name} aligned dW: relative difference {err:.1e}")


def loss_chunks():
    """GPT-2 small's lm_head at 16k tokens: the softmax gradient kernel against the reference on
    the same logits, then the chunked loss and gradients against autograd's over whole logits."""
    n, d, v = 16384, 768, 50304
    g = torch.Generator(device=DEV).manual_seed(0)
    t = torch.randint(0, v, (n,), generator=g, device=DEV)
    t[::97] = -1
    z = (torch.randn(4096, v, generator=g, device=DEV) * 4).bfloat16()
    a, b = z.clone(), z.clone()
    scale = torch.tensor(1 / 4000, device=DEV)
    la, lb = model.softmax_grad_(a, t[:4096], scale), kernels.softmax_grad_(b, t[:4096], scale)
    assert (la - lb).abs().max().item() < 1e-4, f"row losses differ by {(la - lb).abs().max().item():.1e}"
    ulp = torch.ldexp(torch.ones_like(a.float()), torch.frexp(a.float())[1] - 8).clamp(min=2.0 ** -133)
    off = ((a.float() - b.float()).abs() / ulp).max().item()
    assert off <= 1.0, f"gradients differ by {off:.2f} bf16 ulps"
    acc, m = torch.ones(64, 64, device=DEV), torch.randn(64, 64, device=DEV).bfloat16()
    try:
        torch.addmm(acc, m, m, out_dtype=torch.float32, out=acc)
        print(f"      cuBLAS adds into the fp32 dW: yes (error {(acc - 1 - m.float() @ m.float()).abs().max().item():.1e})")
    except (RuntimeError, TypeError) as e:
        print(f"      cuBLAS adds into the fp32 dW: no ({str(e)[:80]})")
    x = (torch.randn(n, d, generator=g, device=DEV)).requires_grad_()
    w = (torch.randn(v, d, generator=g, device=DEV) * 0.02).requires_grad_()
    grads = []
    for rows in (0, 4096, 2048):
        x.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.linear_cross_entropy(x, w, t, rows) if rows else \
                model.cross_entropy(torch.nn.functional.linear(x, w), t)
        (loss * 0.5).backward()
        grads.append((loss.item(), x.grad, w.grad))
    for rows, (loss, dx, dw) in zip((4096, 2048), grads[1:]):
        ex = ((dx - grads[0][1]).norm() / grads[0][1].norm()).item()
        ew = ((dw - grads[0][2]).norm() / grads[0][2].norm()).item()
        print(f"      chunks of {rows}: loss {loss:.6f} vs {grads[0][0]:.6f}, dx {ex:.1e}, dW {ew:.1e}")
        assert abs(loss - grads[0][0]) < 1e-4 and ex < 1e-2 and ew < 1e-2, "chunked loss differs"


def run_all(sz):
    """Every check in a fixed order (--part counts on it)."""
    check("kernels vs the CPU reference (2048x4096)", vs_cpu)
    ieee_reference_scales()
    per_format(sz)
    check("NaN/Inf blocks (ufp4, nvfp4, mxfp4)", nonfinite)
    check("tiny tensors: NVFP4's tensor scale past 2^64 and capped (amax 1e-18, 1e-37, 1e-42)", tiny_tensors)
    check("RHT 32/64/128 (ufp4 row, nvfp4 col)", large_rht)
    check("nvfp4 2D 16x16 weight tiles", weights_2d)
    check("nvfp4 2D tiles on stacked experts [8, 1024, 2048]", experts_2d)
    check("quantize_both (fake nvfp4, packed ufp4+RHT)", lambda: both_orientations(sz))
    check("quantize_both as the layer calls it (per-side packed, SR, fused NVFP4 amax)",
          lambda: both_layer(sz))
    check("SR unbiased (ufp4 row, nvfp4 col, mxfp4)", sr_unbiased)
    check("fp4_matmul vs mm of the same operands / fake quant + mm", lambda: packed_gemm(sz))
    check("fp32 inputs (16384x4096), row and column", fp32_activations)
    check("row tiles of 4 x 1024: RTNE vs reference, SR vs plain loads", lambda: wide_rows(sz))
    for rn in ("ufp4", "nvfp4", "mxfp4", "e2m1"):
        check(f"FP4Linear {rn} triton == torch (y, dx, dW), no SR", lambda: linear_backends(sz, rn, False))
    check("FP4Linear nvfp4 with SR dy: close", lambda: linear_backends(sz, "nvfp4", True))
    check("tensor amax (NVFP4: after the RHT; FP8: flat, plain) == max |x| (3 times each)", tensor_amax)
    check("to_fp8 == reference (mxfp4, mxint4, int4/16/e8m0; e4m3, e5m2; both dims, RHT; 200 binades; "
          "given scales)",
          lambda: fp8_operands(sz))
    check("FP8 GEMM vs the exact product of its operands (fc2 shape)", lambda: fp8_gemm_exact(sz))
    check("fp8_from_packed == reference (mxfp4, mxint4; e4m3, e5m2; both dims, RHT)",
          lambda: fp8_from_packed(sz))
    check("FP4Linear mxint4 on FP8 GEMMs triton == torch (y, dx, dW; Wgrad x packed), no SR",
          lambda: linear_backends(sz, "mxint4", False, fp8=True))
    for rn in ("mxfp4", "mxint4"):
        check(f"FP4Linear {rn} on FP8 GEMMs == on bf16 GEMMs (to bf16 rounding), no SR",
              lambda: fp8_layer(sz, rn))
    check("FP4Linear mxint4 on FP8 GEMMs, all in fast accumulation == on bf16 GEMMs (to bf16 rounding)",
          lambda: fp8_layer(sz, "mxint4", "all"))
    for rn in ("mxfp4", "mxint4"):
        check(f"FP4Linear {rn} on FP8 GEMMs: cached weight, FP8 and packed == quantized per call (bit for bit)",
              lambda: fp8_cached_weight(sz, rn))
    check("FP4Linear mxint4 on FP8 GEMMs: Wgrad's x kept as FP8 == kept packed (bit for bit, SR)",
          lambda: fp8_wgrad_x_kept(sz, "mxint4"))
    for rn in ("mxfp4", "mxint4"):
        check(f"FP4Linear {rn} on FP8 GEMMs: Fprop's x at unit scale == scaled by its amax (bit for bit, SR)",
              lambda: fp8_unit_x(sz, rn))
        check(f"FP4Linear {rn} on FP8 GEMMs: dy's scale kept for the step == found per call (bit for bit, SR)",
              lambda: fp8_dy_step(sz, rn))
    for rn in ("ufp4", "mxfp4"):
        check(f"GroupedLinear {rn}: aligned groups == padding inside (y, dx bit for bit; dW)",
              lambda: grouped_aligned(rn))
    check("grouped FP8 GEMM vs the exact product of its operands (experts' shapes)", fp8_grouped_gemm)
    for rn in ("mxfp4", "mxint4"):
        check(f"GroupedLinear {rn} on FP8 GEMMs == on bf16 GEMMs (to bf16 rounding), no SR",
              lambda: fp8_grouped_layer(rn))
    check("the loss in chunks: softmax_grad_ == reference (1 bf16 ulp), vs whole logits", loss_chunks)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--part", default="0/1", help="k/n: this process runs every n-th check from k")
    ap.add_argument("--only", default="", help="run only the checks whose name contains this (any case)")
    args = ap.parse_args()
    global PART, ONLY
    ONLY = args.only
    PART = tuple(int(v) for v in args.part.split("/"))
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
          f"{__import__('triton').__version__}  AVAILABLE={kernels.AVAILABLE}", flush=True)
    run_all(QUICK if args.quick else FULL)
    n_fail = sum(r[1] != "ok" for r in RESULTS)
    print(f"\n[part {args.part}] {len(RESULTS) - n_fail}/{len(RESULTS)} checks passed in {time.time() - t0:.0f}s")
    for name, st, dt, msg in RESULTS:
        if st != "ok":
            print(f"  FAIL {name}: {msg[:300]}")
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
