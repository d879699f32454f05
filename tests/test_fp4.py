"""Tests for fp4.py, the reference. Independent oracles: ml_dtypes casts and the spec's formulas
written out in numpy."""
import contextlib
from dataclasses import FrozenInstanceError, replace
import math
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fp4  # noqa: E402
from bitwise import assert_grid_neighbours, element_scales  # noqa: E402

E2M1 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu


def as_np(t):
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()  # (bf16 block scales: exact)


def cast(a, dtype):
    return np.asarray(a, np.float32).astype(dtype).astype(np.float32)


def same_bits(a, b):
    """Equal including NaN positions and the sign of zero."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------- grids and rounding

TIES_E2M1 = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
EXPECT_E2M1 = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_e2m1_ties_and_saturation_as_spec():
    grid = fp4.GRIDS["e2m1"]
    t = torch.tensor(TIES_E2M1 + [6.0, 6.5, 7.0, 1e30, float("inf")])
    got = fp4.round_to_grid(t, grid).tolist()
    assert got == EXPECT_E2M1 + [6.0] * 5


def test_e2m1_rounding_matches_ml_dtypes():
    g = torch.Generator().manual_seed(1)
    mids = np.array(fp4.GRIDS["e2m1"].levels)
    mids = (mids[1:] + mids[:-1]) / 2
    t = torch.cat([torch.randn(100_000, generator=g) * 3,
                   torch.rand(100_000, generator=g) * 8 - 4,
                   torch.tensor(np.concatenate([mids, -mids, mids + 1e-6, mids - 1e-6]), dtype=torch.float32)])
    got = fp4.round_to_grid(t, fp4.GRIDS["e2m1"]).copysign(t)
    assert same_bits(as_np(got), cast(as_np(t), E2M1))


def test_int4_and_e1m2_rounding():
    g = torch.Generator().manual_seed(2)
    t = torch.cat([torch.rand(100_000, generator=g) * 18 - 9, torch.arange(-8, 8.5, 0.5)])
    int4 = fp4.round_to_grid(t, fp4.GRIDS["int4"]).copysign(t)
    ref = np.clip(np.round(as_np(t)), -7, 7)  # numpy rounds half to even
    assert np.array_equal(as_np(int4), ref)
    assert fp4.round_to_grid(torch.tensor([0.5, 1.5, 2.5, -0.5]), fp4.GRIDS["int4"]).tolist() == [0, 2, 2, 0]
    assert -8 not in as_np(int4)
    e1m2 = fp4.round_to_grid(t / 4, fp4.GRIDS["e1m2"]).copysign(t)
    assert np.array_equal(as_np(e1m2), ref / 4)


def test_e4m3_scale_cast_matches_ml_dtypes():
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.rand(50_000, generator=g) * 448, torch.exp(torch.randn(50_000, generator=g) * 4).clamp(max=448),
                   torch.tensor([2.0 ** -10, 2.0 ** -9, 3 * 2.0 ** -10, 448.0, 464.0, 0.0])])
    got = fp4.round_e4m3(x)
    assert same_bits(as_np(got)[:-2], cast(as_np(x)[:-2], E4M3))
    assert got[-2].item() == 448.0          # saturates instead of NaN
    assert fp4.round_e4m3(torch.tensor([1e6])).item() == 448.0


def test_e8m0_scale_is_floor_power_of_two_and_representable():
    amax = torch.exp(torch.randn(10_000) * 10).float()
    for grid, emax in (("e2m1", 2), ("int4", 2), ("e1m2", 0)):
        s = fp4.block_scales(amax, fp4.GRIDS[grid], "e8m0")
        want = np.exp2(np.floor(np.log2(as_np(amax).astype(np.float64))) - emax).astype(np.float32)
        assert np.array_equal(as_np(s), want)
        assert same_bits(as_np(s), cast(as_np(s), E8M0))
    assert fp4.block_scales(torch.zeros(1), fp4.GRIDS["e2m1"], "e8m0").item() == 0.0


def test_scale_dtypes_hold_every_scale_exactly():
    """QTensors store e4m3 and e8m0 block scales in bf16: every e4m3 value, every power of two
    2^-127..2^127 (2^-127 a bf16 subnormal), 0 and +NaN keep their bits; quantize uses the dtype,
    and a block whose e8m0 scale is 2^-127 dequantizes as fake_quant does."""
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    pow2 = torch.ldexp(torch.ones(255), torch.arange(-127, 128))
    for kind, vals in (("e4m3", e4m3), ("e8m0", pow2)):
        vals = torch.cat([vals, torch.tensor([0.0, float("nan")])])
        stored = fp4.stored_scales(vals, fp4.get_format(f"int4/32/{kind}"))
        assert stored.dtype == fp4.SCALE_DTYPES[kind] and same_bits(as_np(stored.float()), as_np(vals)), kind
    x = torch.randn(4, 64)
    x[1, :32] *= 2.0 ** -126  # amax about 2^-125: the smallest e8m0 scale, 2^-127
    x[2, 32:] = 0.0
    x[3, :32] = float("nan")
    for name in fp4.FORMATS:
        q = fp4.quantize(x, name)
        assert q.scales.dtype == fp4.SCALE_DTYPES[fp4.FORMATS[name].scale]
        got, want = fp4.dequantize(q, torch.float32), fp4.fake_quant(x, name, dtype=torch.float32)
        assert same_bits(as_np(got), as_np(want)), name
    assert fp4.quantize(x, "mxint4").scales[1, 0].item() == 2.0 ** -127


# ---------------------------------------------------------------- formats follow the spec's formulas

def blocks_np(x, b):
    return x.reshape(*x.shape[:-1], x.shape[-1] // b, b)


def test_ufp4_formula():
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    xb = blocks_np(x, 16)
    scale = np.abs(xb).max(-1, keepdims=True) / np.float32(7)
    ref = (np.clip(np.round(xb / scale), -7, 7) * scale).reshape(x.shape)
    assert same_bits(as_np(fp4.fake_quant(torch.from_numpy(x), "ufp4")), ref)


def test_e2m1_formula():
    x = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32) * 10
    xb = blocks_np(x, 16)
    scale = np.abs(xb).max(-1, keepdims=True) / np.float32(6)
    ref = (cast(xb / scale, E2M1) * scale).reshape(x.shape)
    assert same_bits(as_np(fp4.fake_quant(torch.from_numpy(x), "e2m1")), ref)


@pytest.mark.parametrize("name,grid_dtype,qmax", [("nvfp4", E2M1, 6.0), ("nvint4", None, 7.0)])
def test_nvfp4_formula(name, grid_dtype, qmax):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((16, 128)) * np.exp(rng.standard_normal((16, 1)) * 3)).astype(np.float32)
    s_enc = np.float32(qmax * 448) / np.abs(x).max()
    xb = blocks_np(x, 16)
    stored = cast(np.minimum(np.abs(xb).max(-1, keepdims=True) / np.float32(qmax) * s_enc, 448), E4M3)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(stored > 0, xb * s_enc / stored, 0).astype(np.float32)  # underflowed scale: 0
    elem = cast(t, grid_dtype) if grid_dtype else np.clip(np.round(t), -7, 7)
    ref = (elem * stored / s_enc).reshape(x.shape)
    q = fp4.quantize(torch.from_numpy(x), name)
    assert np.float32(q.tensor_scale.item()) == s_enc
    assert same_bits(as_np(q.scales), stored[..., 0])
    assert same_bits(as_np(fp4.dequantize(q)), ref)


def test_mxfp4_formula():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((16, 128)) * np.exp(rng.standard_normal((16, 4)).repeat(32, 1) * 3)).astype(np.float32)
    xb = blocks_np(x, 32)
    X = np.exp2(np.floor(np.log2(np.abs(xb).max(-1, keepdims=True))) - 2).astype(np.float32)
    ref = (cast(xb / X, E2M1) * X).reshape(x.shape)
    q = fp4.quantize(torch.from_numpy(x), "mxfp4")
    assert q.tensor_scale is None and q.scales.shape == (16, 4)
    assert same_bits(as_np(fp4.dequantize(q)), ref)


def test_all_combinations_constructible():
    for grid in fp4.GRIDS:
        for block in (16, 32):
            for scale in fp4.SCALE_KINDS:
                fmt = fp4.get_format(f"{grid}/{block}/{scale}")
                x = torch.randn(4, 64)
                y = fp4.fake_quant(x, fmt)
                assert y.shape == x.shape and torch.isfinite(y).all()
                assert fp4.attenuation(x, y) > 0.8


def test_quantize_along_dim0_equals_transpose():
    x = torch.randn(64, 48)
    for name in fp4.FORMATS:
        a = fp4.fake_quant(x, name, dim=0)
        b = fp4.fake_quant(x.t().contiguous(), name, dim=-1).t()
        assert torch.equal(a, b)


def test_dtype_and_leading_shape_kept():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    q = fp4.quantize(x, "ufp4")
    assert q.codes.shape == (2, 3, 32) and q.scales.shape == (2, 3, 4)
    y = fp4.dequantize(q)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert fp4.dequantize(q, torch.float32).dtype == torch.float32


# ---------------------------------------------------------------- packing, edge cases, errors

def test_pack_unpack_all_codes():
    codes = torch.arange(16, dtype=torch.uint8).repeat(4)[torch.randperm(64)].reshape(4, 16)
    packed = fp4.pack_codes(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 8)
    assert torch.equal(fp4.unpack_codes(packed), codes)
    assert fp4.pack_codes(torch.tensor([[3, 10]], dtype=torch.uint8)).item() == 3 | (10 << 4)  # low nibble first


def test_codes_are_sign_magnitude_grid_indices():
    x = torch.tensor([[0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]])
    q = fp4.quantize(x, "e2m1")
    assert q.scales.item() == 1.0
    codes = fp4.unpack_codes(q.codes)[0].tolist()
    assert codes == list(range(16))
    # e2m1 codes are the OCP bit patterns
    assert same_bits(as_np(fp4.dequantize(q)), cast(as_np(x), E2M1))


def test_zero_blocks_give_zeros_with_zero_scale():
    x = torch.randn(4, 64)
    x[1, 32:] = 0   # the second block of a 32-block, the third and fourth of a 16-block
    for name, fmt in fp4.FORMATS.items():
        q = fp4.quantize(x, name)
        y = fp4.dequantize(q)
        assert torch.isfinite(y).all()
        assert (y[1, 32:] == 0).all()
        zero_blocks = q.scales[1, 32 // fmt.block:]
        assert (zero_blocks == 0).all() and (q.scales[0] > 0).all(), name
        z = fp4.quantize(torch.zeros(2, 64), name)
        assert (fp4.dequantize(z) == 0).all() and (z.scales == 0).all(), name
        assert z.tensor_scale is None or z.tensor_scale == 1, name   # not 448 / 0


@pytest.mark.parametrize("name", list(fp4.FORMATS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_never_becomes_finite(name, bad):
    x = torch.randn(4, 64)
    x[2, 5] = bad
    y = fp4.fake_quant(x, name)
    assert not torch.isfinite(y[2, 5])
    if fp4.FORMATS[name].scale != "e4m3":        # other blocks untouched
        assert torch.isfinite(y[0]).all()


def grid_limit(x, name, dim=-1):
    """Largest magnitude each element can dequantize to: qmax * block scale (/ tensor scale)."""
    q = fp4.quantize(x, name, dim=dim)
    return (element_scales(q) * fp4.GRIDS[q.fmt.grid].qmax).movedim(-1, q.dim)


def test_saturation_never_exceeds_grid():
    x = torch.randn(8, 64) * 1e30
    x[0, :32] *= 1e-6     # tiny blocks next to huge ones (coarse e4m3 scales)
    for name in fp4.FORMATS:
        y = fp4.fake_quant(x, name).double()
        assert torch.isfinite(y).all()
        assert (y.abs() <= grid_limit(x, name) * (1 + 1e-6)).all()
        if fp4.FORMATS[name].scale == "fp32":  # amax maps onto qmax: nothing exceeds the block amax
            amax = x.abs().reshape(8, -1, 16).amax(-1, keepdim=True).double()
            assert (y.abs().reshape(8, -1, 16) <= amax * (1 + 1e-6)).all()


def test_quantize_both_takes_one_value_or_a_pair_per_side():
    x = torch.randn(64, 64)
    one = fp4.quantize_both(x, "mxfp4", fp8=fp4.E4M3)
    pair = fp4.quantize_both(x, "mxfp4", fp8=(fp4.E4M3, fp4.E4M3))
    assert all(torch.equal(a[0].float(), b[0].float()) and torch.equal(a[1], b[1])
               for a, b in zip(one, pair))
    for kw in (dict(packed=(True,)), dict(fp8=(fp4.E4M3,)), dict(fp8="e4m3")):
        with pytest.raises(ValueError, match="one value for both sides or a \\(row, col\\) pair"):
            fp4.quantize_both(x, "mxfp4", **kw)


def test_quantize_both_is_the_two_one_sided_calls():
    x = torch.randn(32, 48)
    row, col = fp4.quantize_both(x, "ufp4", "nvfp4", "sr", "rtne", rht=16, rht_col=None, seed=5,
                                 packed=(False, True))
    assert torch.equal(row, fp4.fake_quant(x, "ufp4", 1, "sr", 16, seed=5))
    want = fp4.quantize(x, "nvfp4", 0)
    assert torch.equal(col.codes, want.codes) and torch.equal(col.scales, want.scales)
    assert col.dim == 0 and col.tensor_scale == want.tensor_scale
    with pytest.raises(ValueError, match="2D tensor"):
        fp4.quantize_both(x[None], "ufp4")
    with pytest.raises(ValueError, match="dim 0 .* length 24, not a multiple of the block"):
        fp4.quantize_both(x[:24], "ufp4")


def test_length_not_multiple_of_block_is_a_clear_error():
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        fp4.quantize(torch.randn(4, 40), "ufp4")
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        fp4.quantize(torch.randn(40, 64), "mxfp4", dim=0)
    with pytest.raises(ValueError, match="RHT size"):
        fp4.quantize(torch.randn(4, 32), "ufp4", rht=64)


def test_a_dim_outside_the_tensor_is_a_clear_error():
    x = torch.randn(4, 32)
    for fn, dim in ((fp4.quantize, 2), (fp4.fake_quant, -3), (fp4.to_fp8, 2)):
        with pytest.raises(IndexError, match="out of range"):
            fn(x, "mxfp4", dim=dim)
    with pytest.raises(IndexError, match="out of range"):
        fp4.quantize(torch.tensor(1.0), "ufp4")


def test_quantizers_take_floating_tensors_and_say_what_else_is_wrong():
    x = torch.randn(4, 32)
    for fn in (fp4.quantize, fp4.fake_quant, fp4.to_fp8):
        with pytest.raises(TypeError, match=r"floating-point tensor, got torch.int32: pass x.float\(\)"):
            fn(torch.arange(128, dtype=torch.int32).reshape(4, 32), "mxfp4")
        for rht in (True, 16.0, 24):
            with pytest.raises(ValueError, match="rht must be None or a Python int RHT size"):
                fn(x, "mxfp4", rht=rht)
    with pytest.raises(ValueError, match="rht_col must be None"):
        fp4.quantize_both(torch.randn(32, 32), "ufp4", rht=16, rht_col=24)
    for n in (True, 16.0, 24):
        with pytest.raises(ValueError, match="RHT size must be one of"):
            fp4.rht_transform(x, n)
    for dtype in (torch.int32, torch.float8_e4m3fn, "bf16"):
        with pytest.raises(TypeError, match="dtype must be None or torch.float32"):
            fp4.fake_quant(x, "ufp4", dtype=dtype)
        with pytest.raises(TypeError, match="dtype must be None or torch.float32"):
            fp4.quantize_both(torch.randn(32, 32), "ufp4", dtype=dtype)


def test_quantizers_are_not_differentiable():
    """The reference returns tensors outside autograd, as the kernels do (the layer's op is
    straight-through); the kernels' side: test_kernels.py."""
    x = torch.randn(4, 32, requires_grad=True)
    assert not fp4.fake_quant(x, "ufp4", rht=16).requires_grad
    q = fp4.quantize(x, "nvfp4")
    assert not q.scales.requires_grad and not q.tensor_scale.requires_grad


def test_empty_tensors_quantize_in_every_scale_kind():
    for name in ("ufp4", "nvfp4", "mxfp4"):
        q = fp4.quantize(torch.empty(0, 32), name)
        assert q.codes.shape == (0, 16) and fp4.dequantize(q).shape == (0, 32)
        assert q.tensor_scale is None or q.tensor_scale.item() == 1.0  # as for an all-zero tensor
        assert fp4.fake_quant(torch.empty(0, 32), name).shape == (0, 32)


def test_dequantize_checks_the_qtensor_it_is_given():
    x = torch.randn(4, 64)
    q = fp4.quantize(x, "mxfp4")
    assert torch.equal(fp4.dequantize(q), fp4.fake_quant(x, "mxfp4"))
    for bad in (replace(q, scales=q.scales[:, :1]), replace(q, shape=(4, 32)),
                replace(q, codes=q.codes.float()), replace(q, fmt=fp4.get_format("ufp4"))):
        for fn in (fp4.dequantize, fp4.fp8_from_packed):
            with pytest.raises(ValueError, match="QTensor of shape"):
                fn(bad)
    with pytest.raises(TypeError, match="expected an fp4.QTensor"):
        fp4.dequantize(torch.zeros(4, 32))


def test_fp4_linear_checks_shapes_and_counts():
    W, W3 = torch.randn(32, 64), torch.randn(2, 32, 64)
    with pytest.raises(ValueError, match=r"x \[T, in\] and weight \[out, in\]; got x \(64,\).*reshape x to 2D"):
        fp4.fp4_linear(torch.randn(64), W, "ufp4")
    with pytest.raises(ValueError, match=r"got x \(4, 48\) and weight \(32, 64\)"):
        fp4.fp4_linear(torch.randn(4, 48), W, "ufp4")
    with pytest.raises(ValueError, match=r"weight \[out, in\]; got x \(4, 64\) and weight \(2, 32, 64\)"):
        fp4.fp4_linear(torch.randn(4, 64), W3, "nvfp4")
    x = torch.randn(4, 64)
    for counts, err, match in (([1, 1], ValueError, "sum to the rows of x"), ([-1, 5], ValueError, "non-negative"),
                               ([4], ValueError, "one row count per group"), ([2.0, 2.0], TypeError, "integers")):
        with pytest.raises(err, match=match):
            fp4.fp4_linear(x, W3, "nvfp4", counts=counts)
    with pytest.raises(ValueError, match="one row count per group"):
        fp4.fp4_linear(x, W, "nvfp4", counts=[4])
    assert fp4.fp4_linear(x, W3, "nvfp4", counts=[3, 1]).shape == (4, 32)


def test_grouped_linear_checks_its_counts():
    g = fp4.GroupedLinear(4, 32, 64, recipe="ufp4")
    x = torch.randn(40, 32)
    with pytest.raises(ValueError, match="sum to the rows of x"):
        g(x, [10, 10, 0, 0])
    with pytest.raises(ValueError, match="sum to the rows of x"):
        g(x, [50, -10, 0, 0])
    with pytest.raises(ValueError, match="one row count per group"):
        g(x, [20, 20])
    assert g(x, [10, 10, 20, 0]).shape == (40, 64)
    # counts from the host are checked before they move to x's device (on CUDA, unchecked
    # counts ended in a device-side assert that broke the process): x on the meta device
    xm, wm = torch.empty(40, 32, device="meta"), torch.empty(4, 64, 32, device="meta")
    for counts in ([10, 10, 0, 0], torch.tensor([50, -10, 0, 0])):
        with pytest.raises(ValueError, match="sum to the rows of x"):
            fp4._group_counts(xm, wm, counts, fp4.make_recipe("ufp4"))
    assert fp4._group_counts(xm, wm, [10, 10, 20, 0], fp4.make_recipe("ufp4")).device.type == "meta"


def test_bad_names_list_valid_ones():
    with pytest.raises(ValueError, match="ufp4"):
        fp4.get_format("fp5")
    with pytest.raises(ValueError, match="bf16"):
        fp4.make_recipe("int3")
    with pytest.raises(ValueError, match="e4m3"):
        fp4.get_format("int4/16/e5m2")
    with pytest.raises(ValueError, match="fprop"):
        fp4.make_recipe("ufp4", rht="fprop,forward")
    with pytest.raises(ValueError, match="rtne"):
        fp4.quantize(torch.randn(1, 16), "ufp4", rounding="nearest")


def test_2d_weight_blocks_same_for_w_and_wt():
    w = torch.randn(64, 96)
    fmt = fp4.replace(fp4.FORMATS["nvfp4"], block_2d=True)
    q = fp4.quantize(w, fmt)
    assert q.scales.shape == (4, 6)
    assert torch.equal(fp4.fake_quant(w, fmt, dim=-1), fp4.fake_quant(w, fmt, dim=0))
    with pytest.raises(ValueError, match="2D blocks"):
        fp4.quantize(torch.randn(40, 64), fmt)


# ---------------------------------------------------------------- RHT

@pytest.mark.parametrize("n", fp4.RHT_SIZES)
def test_rht_is_orthogonal_and_preserves_products(n):
    Q = fp4.rht_matrix(n).double()
    assert torch.allclose(Q @ Q.t(), torch.eye(n, dtype=torch.float64), atol=1e-6)
    torch.manual_seed(n)
    A, B = torch.randn(8, 4 * n), torch.randn(5, 4 * n)
    AQ, BQ = fp4.rht_transform(A, n), fp4.rht_transform(B, n)
    torch.testing.assert_close(AQ @ BQ.t(), A @ B.t(), rtol=1e-5, atol=1e-4)
    # the butterfly is the matrix (up to fp32 rounding: log2(n) adds against an n-term dot)
    torch.testing.assert_close(AQ, (A.view(8, 4, n) @ fp4.rht_matrix(n)).view(8, 4 * n), rtol=1e-5, atol=1e-5)
    # along dim 0 too (Wgrad)
    torch.testing.assert_close(fp4.rht_transform(A.t(), n, dim=0), AQ.t())


def test_rht_signs_fixed_and_random():
    s = fp4.rht_signs(16)
    assert torch.equal(s, fp4.rht_signs(16)) and set(s.tolist()) == {-1.0, 1.0}
    assert 0 < (s > 0).sum() < 16


def test_rht_quantized_gemm_approximates_product():
    A, B = torch.randn(64, 256), torch.randn(32, 256)
    ref = A @ B.t()
    y = fp4.fake_quant(A, "ufp4", rht=16) @ fp4.fake_quant(B, "ufp4", rht=16).t()
    assert (y - ref).norm() / ref.norm() < 0.2


# ---------------------------------------------------------------- stochastic rounding

def test_sr_is_unbiased():
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(11)).repeat(4000, 1)  # 4000 draws of one row
    x[:, :16] = torch.tensor([0.1, 0.3, 0.6, 1.1, 1.9, 2.2, 2.7, 3.3, 3.8, 4.4, 5.5, 5.9, 6.0, -2.2, -4.4, -0.1])
    for name in ("ufp4", "e2m1", "mxfp4", "nvfp4"):
        y = fp4.fake_quant(x, name, rounding="sr", seed=123).double()
        mean, se = y.mean(0), y.std(0) / 4000 ** 0.5
        err = (mean - x[0].double()).abs()
        inside = x[0].abs() < grid_limit(x[:1], name)[0]  # SR is unbiased inside the grid's range
        assert inside.sum() > 40
        assert (err[inside] <= 5 * se[inside] + 1e-6).all(), (name, err.max())
        e = fp4.fake_quant(x[:1], name).double()
        assert (e - x[0]).abs().max() > 0  # RTNE differs from the mean somewhere: the test can fail


def test_sr_reproducible_from_seed_and_rtne_deterministic():
    x = torch.randn(32, 64)
    a = fp4.fake_quant(x, "ufp4", rounding="sr", seed=7)
    assert torch.equal(a, fp4.fake_quant(x, "ufp4", rounding="sr", seed=7))
    assert not torch.equal(a, fp4.fake_quant(x, "ufp4", rounding="sr", seed=8))
    state = torch.get_rng_state()
    r = fp4.fake_quant(x, "e2m1")
    assert torch.equal(state, torch.get_rng_state())  # RTNE draws nothing
    assert torch.equal(r, fp4.fake_quant(x, "e2m1"))


def test_sr_values_are_neighbours():
    x = torch.randn(64, 64)
    rt = fp4.fake_quant(x, "e2m1")
    sr = fp4.fake_quant(x, "e2m1", rounding="sr", seed=1)
    # SR lands on one of the two grid levels around x, and so does RTNE
    assert_grid_neighbours(sr, x, "e2m1", "sr")
    assert_grid_neighbours(rt, x, "e2m1", "rtne")
    assert not torch.equal(sr, rt)


# ---------------------------------------------------------------- recipes

def test_presets_match_spec_table():
    R = fp4.RECIPES
    assert not R["bf16"].quantized
    u = R["ufp4"]
    assert all(getattr(u, g).fmt == "ufp4" and getattr(u, g).rht for g in fp4.GEMMS)
    for name in ("e2m1", "nvfp4", "mxfp4"):
        r = R[name]
        assert [getattr(r, g).rht for g in fp4.GEMMS] == [False, False, True]
    for r in (R["ufp4"], R["e2m1"], R["nvfp4"], R["mxfp4"]):
        assert r.dgrad.sr_a and r.wgrad.sr_a and not r.fprop.sr_a  # SR on dy only
        assert not (r.fprop.sr_b or r.dgrad.sr_b or r.wgrad.sr_b)
    assert R["nvfp4"].weight_2d and not R["ufp4"].weight_2d
    assert R["nvfp4"].bf16_blocks(12) == {10, 11}  # ~15 % of blocks kept in bf16
    with pytest.raises(FrozenInstanceError):
        R["ufp4"].rht_size = 32


def test_make_recipe_ablations():
    r = fp4.make_recipe("ufp4", rht="wgrad")
    assert [getattr(r, g).rht for g in fp4.GEMMS] == [False, False, True] and r.name == "ufp4*"
    r = fp4.make_recipe("e2m1", rht="all", sr_dy=False, rht_size=32)
    assert all(getattr(r, g).rht for g in fp4.GEMMS) and not r.dgrad.sr_a and r.rht_size == 32
    r = fp4.make_recipe("ufp4", fmt="int4/16/e4m3", bf16_first=1, bf16_last=1)
    assert r.fprop.fmt == "int4/16/e4m3" and r.bf16_blocks(6) == {0, 5}
    assert fp4.make_recipe("ufp4") is fp4.RECIPES["ufp4"]
    with pytest.raises(ValueError, match="rht_size"):
        fp4.make_recipe("ufp4", rht_size=24)
    assert fp4.make_recipe("mxfp4", rht="wgrad/fprop") == fp4.make_recipe("mxfp4", rht="fprop,wgrad")
    # a Format object is that format, not the preset of its name
    for f, want in ((fp4.Format("ufp4", "e2m1", 32, "e8m0"), "e2m1/32/e8m0"),
                    (fp4.Format("mine", "int4", 32, "e8m0"), "int4/32/e8m0"),
                    (fp4.FORMATS["nvfp4"], "nvfp4")):
        r = fp4.make_recipe("ufp4", fmt=f)
        assert r.fprop.fmt == want and fp4.get_format(r.wgrad.fmt).block == f.block
    with pytest.raises(ValueError, match="weight_2d=True"):
        fp4.make_recipe("ufp4", fmt=fp4.Format("nvfp4", "e2m1", 16, "e4m3", block_2d=True))


def test_recipe_fields_take_their_own_types():
    """A string or a number where a switch belongs is an error, not a switch turned on."""
    for kw in (dict(sr_dy="no"), dict(weight_2d="no"), dict(fp8_gemm="yes"), dict(bf16_first="2"),
               dict(bf16_last=True)):
        with pytest.raises(TypeError, match="(sr_dy|weight_2d|fp8_gemm|bf16_first|bf16_last) must be (bool|int), got"):
            fp4.make_recipe("nvfp4", **kw)
    with pytest.raises(ValueError, match=">= 0"):
        fp4.make_recipe("ufp4", bf16_first=-1)
    with pytest.raises(ValueError, match="bf16_last_fraction"):
        fp4.Recipe("x", bf16_last_fraction=2.0)
    with pytest.raises(ValueError, match="unknown format 'foo'"):
        fp4.Recipe("x", fprop=fp4.Gemm("foo"))
    assert fp4.make_recipe("mxfp4", rht=["fprop", "wgrad"]) == fp4.make_recipe("mxfp4", rht="fprop,wgrad")
    with pytest.raises(TypeError, match="list of GEMMs"):
        fp4.make_recipe("mxfp4", rht=True)


@pytest.mark.parametrize("field, bad, match", [("fp8_wgrad_x", "e4m3", "'packed'"), ("rht_size", 24, "rht_size"),
                                               ("fp8_x_scale", "e5m2", "'amax'"),
                                               ("fp8_weight_cache", "e4m3", "'packed'"),
                                               ("fp8_dy_scale", "once", "'step'"),
                                               ("fp8_fast_accum", ("forward",), "names GEMMs")])
def test_recipe_checks_its_fields_when_built_directly(field, bad, match):
    with pytest.raises(ValueError, match=match):
        fp4.Recipe("custom", **{field: bad})


def test_fp8_fast_accum_reaches_the_gemms_it_names(monkeypatch):
    """recipe fp8_fast_accum: a list of GEMMs ('fprop/dgrad', comma or slash; Fprop and Dgrad by
    default), each FP8 GEMM passing use_fast_accum for exactly those; an error without fp8_gemm
    or for an unknown GEMM."""
    assert fp4.make_recipe("mxfp4", fp8_gemm=True, fp8_fast_accum="dgrad,fprop").fp8_fast_accum == ("fprop", "dgrad")
    assert fp4.make_recipe("mxfp4", fp8_gemm=True, fp8_fast_accum="all").fp8_fast_accum == fp4.GEMMS
    with pytest.raises(ValueError, match="add fp8_gemm=True"):
        fp4.make_recipe("mxfp4", fp8_fast_accum="fprop")
    with pytest.raises(ValueError, match="unknown GEMM"):
        fp4.make_recipe("mxfp4", fp8_gemm=True, fp8_fast_accum="forward")
    calls, scaled_mm = [], torch._scaled_mm
    def spy(*args, use_fast_accum=False, **kw):
        calls.append(use_fast_accum)
        return scaled_mm(*args, use_fast_accum=use_fast_accum, **kw)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    for fast, want in ((None, [True, True, False]), ("none", [False] * 3), ("wgrad", [False, False, True])):
        calls.clear()
        x, w = torch.randn(64, 96, requires_grad=True), torch.randn(128, 96, requires_grad=True)
        fp4.fp4_linear(x, w, fp4.make_recipe("mxint4", fp8_gemm=True, fp8_fast_accum=fast)).sum().backward()
        assert calls == want, fast  # Fprop, Dgrad, Wgrad, in the order they run


def _count_fp8_from_packed(monkeypatch):
    """A list that gets an entry per fp4.fp8_from_packed call (the packed x made FP8 in backward)."""
    calls, from_packed = [], fp4.fp8_from_packed
    monkeypatch.setattr(fp4, "fp8_from_packed", lambda *a, **k: calls.append(1) or from_packed(*a, **k))
    return calls


def _wgrad_x_forms(x, w, monkeypatch):
    """mxint4 on FP8 GEMMs (RHT on Wgrad, SR on dy) with Wgrad's x kept packed and as FP8, SR seeded
    alike: per form, (y, dx, dW), Wgrad x's out-of-window fraction and the fp8_from_packed calls."""
    calls, out = _count_fp8_from_packed(monkeypatch), {}
    for keep in ("packed", "fp8"):
        calls.clear()
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.manual_seed(3)
        with fp4.probe_alphas() as p:
            y = fp4.fp4_linear(xg, wg, fp4.make_recipe("mxint4", fp8_gemm=True, fp8_wgrad_x=keep), tag="l")
            y.square().sum().backward()
        out[keep] = (y.detach(), xg.grad, wg.grad), fp4.probe_summary(p)["wgrad_x"]["l"][2], len(calls)
    return out


@pytest.mark.parametrize("room", [fp4.FP8_STEP_ROOM, 0, fp4.max_step_room()])
def test_step_state_keeps_the_first_amax_with_room_above(room):
    """to_fp8 with a step scale (StepScale): the first call after a reset takes x's amax (kept as
    its state's bits, the flag cleared) and scales by fp8_scale's 2^room above it; later calls
    reuse it whatever their x, the same values as fake_quant while their blocks fit below that
    room, NaN blocks (never clipped) past it. A malformed state, a bare one, a room out of range
    and an e4m3 operand are errors."""
    x = torch.randn(64, 96)
    state = fp4.new_step_state("cpu")
    step = fp4.StepScale(state, room)
    v, scale = fp4.to_fp8(x, "mxfp4", fp8=fp4.E5M2, scale=step)
    amax = x.abs().amax()
    assert state[1] == 0 and fp4.step_state_amax(state) == amax
    assert scale == fp4.fp8_scale(amax, "mxfp4", fp4.E5M2) * 2 ** room
    assert torch.equal(v.float() * scale, fp4.fake_quant(x, "mxfp4", dtype=torch.float32))
    for mult, fits in ((2 ** room, True), (0.01, True), (2.0 ** (room + 2), False)):
        v2, s2 = fp4.to_fp8(x * mult, "mxfp4", fp8=fp4.E5M2, scale=step)
        assert s2 == scale and fp4.step_state_amax(state) == amax
        fake = fp4.fake_quant(x * mult, "mxfp4", dtype=torch.float32)
        if fits:
            assert torch.equal(v2.float() * s2, fake)
        else:  # the blocks past the room are NaN, the others exact
            got = v2.float() * s2
            assert got.isnan().any() and torch.equal(got[~got.isnan()], fake[~got.isnan()])
    fp4.reset_step_state(state)
    assert state.tolist() == [0, 1]
    assert fp4.to_fp8(x * 64, "mxfp4", fp8=fp4.E5M2, scale=step)[1] == scale * 64
    with pytest.raises(ValueError, match="int32 tensor of shape"):
        fp4.to_fp8(x, "mxfp4", fp8=fp4.E5M2, scale=fp4.StepScale(torch.zeros(2)))
    with pytest.raises(ValueError, match="as StepScale"):
        fp4.to_fp8(x, "mxfp4", fp8=fp4.E5M2, scale=state)
    for bad in (-1, fp4.max_step_room() + 1, 6.0, True):
        with pytest.raises(ValueError, match=f"fp8_step_room must be an int from 0 to {fp4.max_step_room()} "):
            fp4.to_fp8(x, "mxfp4", fp8=fp4.E5M2, scale=fp4.StepScale(state, bad))
    with pytest.raises(ValueError, match="from 0 to 10 .* with RHT 16"):  # the RHT's bound takes 2
        fp4.quantize_both(x, "mxfp4", rht_col=16, fp8=fp4.E5M2, fp8_scale=fp4.StepScale(state, 11))
    with pytest.raises(ValueError, match="for e5m2 operands"):
        fp4.to_fp8(x, "mxfp4", fp8=fp4.E4M3, scale=step)


def test_fp8_step_room_is_a_recipe_field():
    """Recipe.fp8_step_room reaches dy's kept scale: dy 2^7 times the step's first micro-step's
    passes room 6 (NaN in dx: a skipped step) and fits room 8 (the amax scale's gradients bit
    for bit). It is checked, and given without fp8_dy_scale='step' it is an error."""
    grads = {}
    for how, room in (("amax", None), ("step", 6), ("step", 8)):
        torch.manual_seed(0)
        r = fp4.make_recipe("mxfp4", fp8_gemm=True, sr_dy=False, fp8_dy_scale=how, fp8_step_room=room)
        layer = fp4.FP4Linear(64, 32, bias=False, recipe=r)
        fp4.cache_weights(layer)
        g = torch.Generator().manual_seed(1)
        x, dy = torch.randn(64, 64, generator=g, requires_grad=True), torch.randn(64, 32, generator=g)
        for mult in (1.0, 2.0 ** 7):
            x.grad = layer.weight.grad = None
            layer(x).backward(dy * mult)
        grads[how, room] = (x.grad, layer.weight.grad)
    assert grads["step", 6][0].isnan().any()  # dx (Wgrad's dy, after its RHT, fits 2 binades more)
    assert all(torch.equal(a, b) for a, b in zip(grads["step", 8], grads["amax", None]))
    assert fp4.make_recipe("mxfp4", fp8_gemm=True, fp8_dy_scale="step").fp8_step_room == fp4.FP8_STEP_ROOM
    with pytest.raises(ValueError, match="add fp8_dy_scale='step'"):
        fp4.make_recipe("mxfp4", fp8_gemm=True, fp8_step_room=8)
    with pytest.raises(ValueError, match="fp8_step_room must be an int from 0 to 10"):  # RHT 16's
        fp4.make_recipe("mxfp4", fp8_gemm=True, fp8_dy_scale="step", fp8_step_room=11)


@pytest.mark.parametrize("grouped", [False, True])
def test_fp8_dy_scale_step_keeps_dy_scale_for_the_optimizer_step(grouped):
    """Recipe fp8_dy_scale='step': a layer's dy scale is found in the first backward after
    cache_weights and kept until the next one. While dy's blocks fit its room, dx and dW equal
    the amax scale's bit for bit (SR on dy seeded alike); dy past the room gives NaN (a skipped
    step), and after cache_weights the scale follows dy again. A layer that cache_weights never
    reached has no state and scales dy by its amax. Only with fp8_gemm."""
    counts = torch.tensor([24, 0, 40]) if grouped else None
    out = {}
    for how in ("amax", "step"):
        torch.manual_seed(0)
        r = fp4.make_recipe("mxfp4", fp8_gemm=True, fp8_dy_scale=how)
        layer = fp4.GroupedLinear(3, 64, 32, recipe=r) if grouped else fp4.FP4Linear(64, 32, bias=False, recipe=r)
        assert layer.dy_state is None
        fp4.cache_weights(layer)
        assert (layer.dy_state is not None) == (how == "step")
        grads = []
        for k, mult in enumerate((1.0, 2.0, 2.0 ** (fp4.FP8_STEP_ROOM + 3), "reset")):
            if mult == "reset":
                fp4.cache_weights(layer)
                mult = 2.0 ** (fp4.FP8_STEP_ROOM + 3)
            g = torch.Generator().manual_seed(k)
            x = torch.randn(64, 64, generator=g, requires_grad=True)
            dy = torch.randn(64, 32, generator=g) * mult
            torch.manual_seed(10 + k)
            (layer(x, counts) if grouped else layer(x)).backward(dy)
            grads.append((x.grad, layer.weight.grad))
            layer.weight.grad = None
        out[how] = grads
    for k, ((dx, dw), (sdx, sdw)) in enumerate(zip(out["amax"], out["step"])):
        if k == 2:  # past the room kept from the first micro-step
            assert sdx.isnan().any() and sdw.isnan().any() and dx.isfinite().all()
        else:
            assert torch.equal(dx, sdx) and torch.equal(dw, sdw), k
    with pytest.raises(ValueError, match="add fp8_gemm=True"):
        fp4.make_recipe("mxfp4", fp8_dy_scale="step")


def test_fp8_wgrad_x_kept_as_fp8_gives_the_same_layer(monkeypatch):
    """recipe fp8_wgrad_x='fp8': forward keeps Wgrad's x as e4m3 (values, scale) instead of packed,
    so backward never converts it (fp8_from_packed), with the same y, dx and dW bit for bit, SR
    on dy included, while no block leaves either form's FP8 window; an error without fp8_gemm or
    for another value."""
    with pytest.raises(ValueError, match="add fp8_gemm=True"):
        fp4.make_recipe("mxfp4", fp8_wgrad_x="fp8")
    with pytest.raises(ValueError, match="add fp8_gemm=True"):
        fp4.make_recipe("mxfp4", fp8_x_scale="unit")
    with pytest.raises(ValueError, match="'packed'"):
        fp4.make_recipe("mxfp4", fp8_gemm=True, fp8_wgrad_x="e4m3")
    x, w = torch.randn(64, 96), torch.randn(128, 96) * 0.02
    x[:, 7] *= 2.0 ** -9  # blocks far below the top, still inside both windows
    out = _wgrad_x_forms(x, w, monkeypatch)
    assert [out[k][1:] for k in ("packed", "fp8")] == [(0.0, 1), (0.0, 0)]
    assert all(torch.equal(a, b) for a, b in zip(out["packed"][0], out["fp8"][0]))


def test_fp8_wgrad_x_kept_as_fp8_has_a_narrower_window_under_rht(monkeypatch):
    """Under RHT the kept-FP8 x takes its tensor scale from x's amax with the RHT's growth bound
    (to_fp8), the packed x from its largest block after the RHT: the FP8 form's window ends a few
    binades higher. A feature 2^-14 below the rest is inside the packed form's window and outside
    the FP8 form's: only dW differs, and telemetry counts that feature's two token blocks."""
    x, w = torch.randn(64, 96), torch.randn(128, 96) * 0.02
    x[:, 7] *= 2.0 ** -14
    out = _wgrad_x_forms(x, w, monkeypatch)
    assert out["packed"][1] == 0.0 and out["fp8"][1] == 2 / (96 * 2)
    same = [torch.equal(a, b) for a, b in zip(out["packed"][0], out["fp8"][0])]
    assert same == [True, True, False]


def test_check_dims():
    fp4.check_dims(fp4.RECIPES["ufp4"], 64, 128)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp4.check_dims(fp4.RECIPES["ufp4"], 72)
    with pytest.raises(ValueError, match="multiples of 32"):
        fp4.check_dims(fp4.RECIPES["mxfp4"], 48)
    fp4.check_dims(fp4.RECIPES["bf16"], 7)


# ---------------------------------------------------------------- the quantized linear layer

def test_bf16_recipe_equals_nn_linear():
    torch.manual_seed(0)
    ref = nn.Linear(48, 24)
    lin = fp4.FP4Linear(48, 24, recipe="bf16")
    lin.load_state_dict(ref.state_dict())
    x1 = torch.randn(3, 5, 48, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = ref(x1), lin(x2)
    assert torch.equal(y1, y2)
    g = torch.randn_like(y1)
    y1.backward(g), y2.backward(g)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(ref.weight.grad, lin.weight.grad) and torch.equal(ref.bias.grad, lin.bias.grad)


def manual_three_gemms(x, w, dy, r, seed):
    """The spec table written out with fake_quant calls (the operands, dims, RHT and SR of each GEMM)."""
    def q(t, gemm, dim, sr, s, weight=False):
        fmt = fp4.get_format(gemm.fmt)
        if weight and r.weight_2d:
            fmt = fp4.replace(fmt, block_2d=True)
        return fp4.fake_quant(t, fmt, dim=dim, rounding="sr" if sr else "rtne",
                              rht=r.rht_size if gemm.rht else None, seed=s, dtype=torch.float32)
    f, d, g = r.fprop, r.dgrad, r.wgrad
    y = q(x, f, -1, f.sr_a, seed) @ q(w, f, -1, f.sr_b, seed + 1, True).t()
    dx = q(dy, d, -1, d.sr_a, seed + 2) @ q(w, d, 0, d.sr_b, seed + 3, True)
    dw = q(dy, g, 0, g.sr_a, seed + 4).t() @ q(x, g, 0, g.sr_b, seed + 5)
    return y, dx, dw


def seeded_fp4_linear(x, w, r, rng_seed=0, counts=None):
    """fp4.fp4_linear after torch.manual_seed(rng_seed), and the SR seed it draws inside (on the
    CPU the six operand seeds are this one + 0..5, what manual_three_gemms assumes)."""
    torch.manual_seed(rng_seed)
    seed = int(fp4._sr_seeds(r, x.device)[0])
    torch.manual_seed(rng_seed)
    return fp4.fp4_linear(x, w, r, counts=counts), seed


def recipe_of(name):
    """A preset by name; 'NAME+fp8' is the preset on FP8 GEMMs (opt-in)."""
    return fp4.make_recipe(name.removesuffix("+fp8"), fp8_gemm=True if name.endswith("+fp8") else None)


@pytest.mark.parametrize("name", ["ufp4", "e2m1", "nvfp4", "mxfp4", "mxfp4+fp8"])
def test_fp4_linear_is_the_three_quantized_gemms(name, monkeypatch):
    calls, real = [], fp4._fp8_mm
    monkeypatch.setattr(fp4, "_fp8_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(1)
    r = recipe_of(name)
    x = torch.randn(64, 96, requires_grad=True)
    w = torch.randn(32, 96, requires_grad=True)
    dy = torch.randn(64, 32)
    y, seed = seeded_fp4_linear(x, w, r, 1000)
    assert seed != 0  # SR on dy: a seed was drawn
    y.backward(dy)
    ry, rdx, rdw = manual_three_gemms(x.detach(), w.detach(), dy, r, seed)
    assert torch.equal(y, ry) and torch.equal(x.grad, rdx) and torch.equal(w.grad, rdw)
    assert len(calls) == (3 if name.endswith("+fp8") else 0)   # the path the name says ran
    # and it is a good approximation of the exact layer
    exact = x.detach() @ w.detach().t()
    assert (y - exact).norm() / exact.norm() < 0.2
    assert (w.grad - dy.t() @ x.detach()).norm() / (dy.t() @ x.detach()).norm() < 0.3


def test_autocast_casts_the_input_like_linear():
    # under autocast F.linear multiplies bf16 inputs; so does the FP4 layer: an fp32 input (a
    # LayerNorm's output) is cast before the op, and its gradient comes back in fp32
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 64, generator=g, requires_grad=True)
    w = torch.randn(48, 64, generator=g, requires_grad=True)
    dy = torch.randn(32, 48, generator=g)
    out = []
    for inp in (x, x.detach().bfloat16().requires_grad_()):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fp4.fp4_linear(inp, w, "ufp4")
        y.backward(dy)
        out.append((y, inp.grad))
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1].float())


def test_fp4_linear_module_shapes_bias_and_token_padding():
    torch.manual_seed(2)
    lin = fp4.FP4Linear(64, 32, recipe="ufp4")
    x = torch.randn(3, 7, 64, requires_grad=True)  # 21 tokens: Wgrad pads to 32 with zeros
    y = lin(x)
    assert y.shape == (3, 7, 32)
    y.sum().backward()
    assert x.grad.shape == x.shape and lin.weight.grad.shape == (32, 64) and lin.bias.grad.shape == (32,)
    assert torch.allclose(lin.bias.grad, torch.full((32,), 21.0))
    with pytest.raises(ValueError, match="multiple"):
        fp4.FP4Linear(72, 32, recipe="ufp4")


def test_zero_padding_tokens_does_not_change_wgrad():
    r = fp4.make_recipe("ufp4", sr_dy=False)
    torch.manual_seed(3)
    x, w, dy = torch.randn(21, 64), torch.randn(32, 64), torch.randn(21, 32)
    xp, dyp = F.pad(x, (0, 0, 0, 11)), F.pad(dy, (0, 0, 0, 11))
    _, _, dw_ref = manual_three_gemms(xp, w, dyp, r, 0)
    w1 = w.clone().requires_grad_()
    fp4.fp4_linear(x, w1, r).backward(dy)  # no SR: seed 0
    assert torch.equal(w1.grad, dw_ref)


def test_grouped_linear_equals_per_expert_linear():
    torch.manual_seed(4)
    r = fp4.make_recipe("ufp4", sr_dy=False)  # deterministic, so seeds don't matter
    g = fp4.GroupedLinear(3, 64, 32, recipe=r)
    counts = [20, 0, 37]
    x = torch.randn(57, 64, requires_grad=True)
    y = g(x, counts)
    dy = torch.randn_like(y)
    y.backward(dy)
    start = 0
    for e, c in enumerate(counts):
        xe = x.detach()[start:start + c].clone().requires_grad_()
        we = g.weight.detach()[e].clone().requires_grad_()
        if c:
            ye = fp4.fp4_linear(xe, we, r)
            ye.backward(dy[start:start + c])
            assert torch.equal(ye, y[start:start + c])
            assert torch.equal(xe.grad, x.grad[start:start + c])
            assert torch.equal(we.grad, g.weight.grad[e])
        else:
            assert (g.weight.grad[e] == 0).all()
        start += c
    # bf16 recipe: plain per-expert matmuls
    g.recipe = fp4.RECIPES["bf16"]
    y = g(x, counts)
    assert torch.allclose(y[:20], x[:20] @ g.weight[0].t()) and torch.allclose(y[20:], x[20:] @ g.weight[2].t())


@pytest.mark.parametrize("name", ["ufp4", "mxfp4", "bf16"])
def test_grouped_linear_aligned_groups_equal_padding_inside(name, monkeypatch):
    """Rows laid out in whole group_multiple groups (zero rows after each group's real ones, the
    last group taking the spare rows) give the same y, dx and dW as the layer padding compact
    rows itself, and the layer then copies nothing to pad."""
    torch.manual_seed(6)
    r = fp4.make_recipe(name, sr_dy=False) if name != "bf16" else name  # no SR: rows may move
    g = fp4.GroupedLinear(3, 64, 32, recipe=r)
    m = g.group_multiple(torch.device("cpu"))
    assert m == (1 if name == "bf16" else 32 if name == "mxfp4" else 16)
    counts = [20, 0, 37]
    x = torch.randn(57, 64, requires_grad=True)
    dy = torch.randn(57, 32)
    y = g(x, counts)
    y.backward(dy)
    dw, g.weight.grad = g.weight.grad, None
    padded = [-(-c // m) * m for c in counts]
    padded[-1] += m  # spare rows in the last group
    rows = torch.cat([torch.arange(s, s + c) for s, c in zip([0, padded[0], padded[0] + padded[1]], counts)])
    xa = torch.zeros(sum(padded), 64).index_copy(0, rows, x.detach()).requires_grad_()
    dya = torch.zeros(sum(padded), 32).index_copy(0, rows, dy)
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda *a: pytest.fail("aligned rows were padded"))
    ya = g(xa, padded, aligned=True)
    ya.backward(dya)
    assert torch.equal(ya[rows], y) and torch.equal(xa.grad[rows], x.grad)
    torch.testing.assert_close(g.weight.grad, dw, rtol=1e-6, atol=1e-6)  # (more zero rows: other sums)
    if m > 1:
        with pytest.raises(ValueError, match=f"multiples of {m}"):
            g(xa, [padded[0] + 1, padded[1], padded[2] - 1], aligned=True)


def test_2d_tiles_on_expert_weights_match_per_matrix():
    w = torch.randn(3, 32, 48)
    fmt = fp4.replace(fp4.FORMATS["nvfp4"], block_2d=True)
    fmt_t = fp4.replace(fp4.FORMATS["ufp4"], block_2d=True)
    for f in (fmt, fmt_t):
        for dim in (1, 2):
            got = fp4.fake_quant(w, f, dim=dim)
            if f.scale == "fp32":  # the tensor scale of e4m3 spans all experts, so only fp32 is per-matrix
                for e in range(3):
                    assert torch.equal(got[e], fp4.fake_quant(w[e], f, dim=dim - 1))
        assert torch.equal(fp4.fake_quant(w, f, dim=1), fp4.fake_quant(w, f, dim=2))


@pytest.mark.parametrize("name", ["ufp4", "nvfp4", "mxfp4", "bf16"])
def test_grouped_linear_all_presets_train(name):
    torch.manual_seed(5)
    g = fp4.GroupedLinear(4, 64, 32, recipe=name)
    x = torch.randn(45, 64, requires_grad=True)
    counts = torch.tensor([7, 0, 30, 8])
    y = g(x, counts)
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(g.weight.grad).all()
    assert (g.weight.grad[1] == 0).all() and (g.weight.grad[0] != 0).any()
    exact = torch.cat([x[:7] @ g.weight[0].t(), x[7:37] @ g.weight[2].t(), x[37:] @ g.weight[3].t()])
    assert (y - exact).norm() / exact.norm() < (1e-6 if name == "bf16" else 0.2)


def test_convert_swaps_block_linears_only():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.router = nn.Linear(32, 96), nn.Linear(32, 16)
            self.experts = fp4.GroupedLinear(4, 32, 64)

    class Model(nn.Module):
        fp4_keep = ("router",)  # what convert leaves alone unless told otherwise

        def __init__(self):
            super().__init__()
            self.emb, self.lm_head = nn.Embedding(10, 32), nn.Linear(32, 10)
            self.blocks = nn.ModuleList(Block() for _ in range(3))

    assert isinstance(fp4.convert(Model(), "ufp4", keep=()).blocks[0].router, fp4.FP4Linear)
    m = Model()
    w = m.blocks[0].qkv.weight
    fp4.convert(m, fp4.make_recipe("ufp4", bf16_last=1))
    assert isinstance(m.blocks[0].qkv, fp4.FP4Linear) and m.blocks[0].qkv.weight is w
    assert m.blocks[0].qkv.recipe.name == "ufp4*" and m.blocks[0].experts.recipe.name == "ufp4*"
    assert m.blocks[2].qkv.recipe.name == "bf16" and m.blocks[2].experts.recipe.name == "bf16"
    assert type(m.blocks[0].router) is nn.Linear and type(m.lm_head) is nn.Linear
    assert set(m.state_dict()) == set(Model().state_dict())
    fp4.convert(m, "e2m1")  # converting again only changes the recipe
    assert m.blocks[0].qkv.recipe.name == "e2m1" and m.blocks[0].qkv.weight is w


def test_convert_keeps_named_modules_and_what_they_hold():
    from model import GPT, GPTConfig
    cfg = dict(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)
    for keep, kept in ((("attn.qkv",), {"attn.qkv"}), (("attn",), {"attn.qkv", "attn.proj"}),
                       ((), set())):
        m = fp4.convert(GPT(GPTConfig(**cfg)), "ufp4", keep=keep)
        linears = {n: type(mod) for n, mod in m.blocks[0].named_modules()
                   if isinstance(mod, nn.Linear)}
        assert {n for n, t in linears.items() if t is nn.Linear} == kept, (keep, linears)
    m = fp4.convert(GPT(GPTConfig(**cfg)), "ufp4", keep="attn.qkv")  # one name, not its letters
    assert type(m.blocks[0].attn.qkv) is nn.Linear and type(m.blocks[0].attn.proj) is fp4.FP4Linear
    for key in ("keep", "keep_x"):
        with pytest.raises(ValueError, match=r"\['attn.qvk'\] match no module"):
            fp4.convert(GPT(GPTConfig(**cfg)), "ufp4", **{key: ["attn.qvk"]})
    for keep_x in ("attn.proj", "proj", ["attn"]):  # matched as keep is: a name's last parts, or what holds it
        m = fp4.convert(GPT(GPTConfig(**cfg)), "ufp4", keep_x=keep_x)
        assert not m.blocks[0].attn.proj.pack_x and m.blocks[0].mlp.fc1.pack_x, keep_x
        assert m.blocks[0].attn.qkv.pack_x == (keep_x != ["attn"]), keep_x
    moe = fp4.convert(GPT(GPTConfig(**cfg, n_expert=4)), "ufp4")  # GPT's own fp4_keep, fp4_keep_x
    assert type(moe.blocks[0].mlp.router) is nn.Linear, "the router stays bf16"
    assert not moe.blocks[0].attn.proj.pack_x and moe.blocks[0].attn.qkv.pack_x


# ---------------------------------------------------------------- shrinkage diagnostics

def test_analytic_bin_bias():
    assert fp4.bin_bias("e2m1") == {0.5: 0, 1.0: 0, 1.5: 0, 2.0: -0.125, 3.0: 0, 4.0: -0.25}
    assert all(b == 0 for b in fp4.bin_bias("int4").values())
    assert all(b == 0 for b in fp4.bin_bias("e1m2").values())


def test_shrinkage_on_gaussian_data():
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(5))
    e2m1 = fp4.shrinkage_report(x, "e2m1")
    int4 = fp4.shrinkage_report(x, "ufp4")
    assert e2m1["alpha"] < 0.999
    assert abs(int4["alpha"] - 1) < 0.002
    assert 0 < e2m1["b_eff"] <= 1 and 0 < int4["b_eff"] <= 1
    assert int4["sqnr_db"] > 15 and e2m1["sqnr_db"] > 15


def test_probe_alphas_records_every_operand_without_changing_the_step():
    torch.manual_seed(6)
    lin = fp4.FP4Linear(64, 32, bias=False, recipe="e2m1")  # RHT on Wgrad, SR on dy
    lin.tag = "blocks.0.fc"
    x = torch.randn(40, 64, requires_grad=True)
    dy = torch.randn(40, 32)

    def step(probe):
        x.grad = lin.weight.grad = None
        torch.manual_seed(7)  # the SR seed
        with fp4.probe_alphas() if probe else contextlib.nullcontext() as p:
            lin(x).backward(dy)
        return x.grad.clone(), lin.weight.grad.clone(), p

    dx0, dw0, _ = step(False)
    dx1, dw1, p = step(True)
    assert torch.equal(dx0, dx1) and torch.equal(dw0, dw1)  # probing draws no RNG, changes nothing
    assert fp4.PROBE is None
    s = fp4.probe_summary(p)
    assert set(s) == {"fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x"}
    assert all(set(v) == {"blocks.0.fc"} for v in s.values())
    # Fprop x: RTNE along the features, no RHT: the same alpha as shrinkage_report
    ref = fp4.shrinkage_report(x.detach(), "e2m1")
    assert s["fprop_x"]["blocks.0.fc"][0] == pytest.approx(ref["alpha"], rel=1e-6)
    assert s["fprop_x"]["blocks.0.fc"][1] == pytest.approx(ref["sqnr_db"], rel=1e-5)
    # Wgrad x: along the tokens (padded 40 -> 48), in the RHT basis
    ref = fp4.shrinkage_report(F.pad(x.detach(), (0, 0, 0, 8)), "e2m1", dim=0, rht=16)
    assert s["wgrad_x"]["blocks.0.fc"][0] == pytest.approx(ref["alpha"], rel=1e-6)
    # the e2m1 grid shrinks: alpha below one
    assert 0.9 < s["fprop_x"]["blocks.0.fc"][0] < 0.999


def test_convert_tags_layers_for_the_probe():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.experts = nn.Linear(32, 64), fp4.GroupedLinear(2, 32, 64)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            return sum(b.fc(x).sum() + b.experts(x, [10, 6]).sum() for b in self.blocks)

    m = fp4.convert(Model(), "ufp4")
    with fp4.probe_alphas() as p:
        m(torch.randn(16, 32)).backward()
    tags = set(fp4.probe_summary(p)["wgrad_dy"])
    assert tags == {"blocks.0.fc", "blocks.0.experts", "blocks.1.fc", "blocks.1.experts"}


# ---------------------------------------------------------------- torch.compile, saved-tensor memory

class Stack(nn.Module):
    """A layer stack for fp4.convert: dense linears and grouped MoE experts, with residuals.
    exact: only ops whose compiled kernels give eager's bits (ReLU, adds): no norm, and no bias,
    whose gradient is a reduction that inductor may sum in another order."""

    def __init__(self, d=64, E=4, n_blocks=2, exact=False):
        super().__init__()
        self.act = F.relu if exact else F.gelu
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            norm=nn.Identity() if exact else nn.LayerNorm(d),
            fc1=nn.Linear(d, 2 * d, bias=not exact), fc2=nn.Linear(2 * d, d, bias=not exact),
            w_in=fp4.GroupedLinear(E, d, 2 * d), w_out=fp4.GroupedLinear(E, 2 * d, d)))
            for _ in range(n_blocks))

    def forward(self, x, counts):
        for b in self.blocks:
            x = x + b["fc2"](self.act(b["fc1"](b["norm"](x))))
            x = x + b["w_out"](self.act(b["w_in"](b["norm"](x), counts)), counts)
        return x


STACK_X, STACK_COUNTS = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)), torch.tensor([10, 0, 30, 24])


def train_step(model, params, seed):
    """One forward + backward under torch.manual_seed(seed): output, dx and every gradient."""
    for p in params:
        p.grad = None
    x = STACK_X.clone().requires_grad_()
    torch.manual_seed(seed)
    y = model(x, STACK_COUNTS)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in params]


def have_cxx():
    import shutil
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not have_cxx(), reason="inductor's CPU code needs a C++ compiler"))])
# all: SR on dy; nvfp4: 2D W tiles, last block bf16; mxfp4+fp8: FP8 GEMMs, Wgrad's x kept packed
@pytest.mark.parametrize("name", ["ufp4", "e2m1", "nvfp4", "mxfp4+fp8"])
def test_compiled_stack_equals_eager_without_breaks_or_recompiles(name, backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fp4.convert(Stack(exact=backend == "inductor"), recipe_of(name))
    params = list(model.parameters())
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # fullgraph: a break raises
    for step in range(3):
        want = train_step(model, params, step)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):  # steps 2, 3: no recompile
            got = train_step(compiled, params, step)
        assert len(want) == len(got) == 2 + len(params)
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), (step, i)
    torch._dynamo.reset()


def test_explain_finds_no_graph_breaks():
    torch._dynamo.reset()
    model = fp4.convert(Stack(), "e2m1")
    ex = torch._dynamo.explain(model)(STACK_X, STACK_COUNTS)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    torch._dynamo.reset()


def test_probe_works_under_compile_without_recompiling():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fp4.convert(Stack(), "e2m1")
    params = list(model.parameters())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    train_step(compiled, params, 0)
    with torch._dynamo.config.patch(error_on_recompile=True):  # the probe is read at run time
        with fp4.probe_alphas() as p_compiled:
            got = train_step(compiled, params, 1)
        train_step(compiled, params, 2)
    with fp4.probe_alphas() as p_eager:
        want = train_step(model, params, 1)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert set(p_compiled) == set(p_eager) and len(p_eager) == 6 * 4 * 2  # 6 operands, 4 layers, 2 blocks
    assert all(torch.equal(p_compiled[k], p_eager[k]) for k in p_eager)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["ufp4", "e2m1", "nvfp4", "mxfp4", "mxfp4+fp8"])
def test_packed_wgrad_x_equals_quantizing_x_in_backward(name, monkeypatch):
    """Forward saves Wgrad's Q(x) packed (FP8 on the FP8 path); quantizing x in backward instead
    gives the same bits (also with SR on x: the same seed)."""
    r = recipe_of(name)
    r = fp4.replace(r, wgrad=fp4.replace(r.wgrad, sr_b=True))
    torch.manual_seed(8)
    x, w, wg = torch.randn(40, 64), torch.randn(32, 64), torch.randn(3, 32, 64)
    counts = torch.tensor([7, 0, 33])

    def run():
        outs = []
        for weight, c in ((w, None), (wg, counts)):
            xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
            torch.manual_seed(9)
            y = fp4.fp4_linear(xi, wi, r, counts=c)
            y.backward(torch.ones_like(y) + y.detach())
            outs += [y.detach(), xi.grad, wi.grad]
        return outs

    packed = run()
    monkeypatch.setattr(fp4, "_packs_wgrad_x", lambda recipe, pack_x: False)
    unpacked = run()
    assert all(torch.equal(a, b) for a, b in zip(packed, unpacked))


def test_fp4_linear_saves_packed_x_not_x():
    T, d = 1024, 256
    x = torch.randn(T, d, dtype=torch.bfloat16, requires_grad=True)
    bf16 = fp4.saved_bytes(nn.Linear(d, d, bias=False, dtype=torch.bfloat16), x)
    ufp4 = fp4.saved_bytes(fp4.FP4Linear(d, d, bias=False, recipe="ufp4"), x)
    assert bf16 == T * d * 2
    # 4-bit codes + one fp32 scale per 16 tokens (0.75 bytes per element) + six int64 SR seeds
    assert ufp4 == T * d // 2 + T * d // 16 * 4 + 6 * 8
    assert ufp4 < 0.4 * bf16


def test_pack_x_false_keeps_x_and_gives_the_same_gradients():
    """A layer whose input another op keeps anyway (attention's output, kept by SDPA) saves x
    itself, not a packed copy, and quantizes it in backward: the same bits, SR included."""
    T, d = 64, 32
    r = fp4.make_recipe("ufp4")
    r = fp4.replace(r, wgrad=fp4.replace(r.wgrad, sr_b=True))
    x = torch.randn(T, d)
    grads = []
    for pack_x in (True, False):
        layer = fp4.FP4Linear(d, d, bias=False, recipe=r, pack_x=pack_x)
        torch.manual_seed(1)
        layer.weight.data.normal_()
        xi = x.clone().requires_grad_()
        torch.manual_seed(2)
        saved = fp4.saved_bytes(layer, xi)
        grads.append((xi.grad, layer.weight.grad))
        assert saved == (T * d * 4 if not pack_x else T * d // 2 + T * d // 16 * 4) + 6 * 8
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_cli_prints_tables():
    out = subprocess.run([sys.executable, "fp4.py", "--rows", "64"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert out.returncode == 0, out.stderr
    assert "e2m1" in out.stdout and "-0.250" in out.stdout and "student-t" in out.stdout


# ---------------------------------------------------------------- property-based robustness

finite_or_not = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                          st.sampled_from([0.0, -0.0, 1e-45, -1e-40, 3e38, -3e38, 1.0]))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3), nblocks=st.integers(1, 3), name=st.sampled_from(sorted(fp4.FORMATS)),
       rounding=st.sampled_from(["rtne", "sr"]), dim0=st.booleans(), data=st.data())
def test_quantizer_never_crashes_or_hides_nonfinite(rows, nblocks, name, rounding, dim0, data):
    fmt = fp4.FORMATS[name]
    K = nblocks * fmt.block
    vals = data.draw(st.lists(finite_or_not, min_size=rows * K, max_size=rows * K))
    x = torch.tensor(vals, dtype=torch.float32).reshape(rows, K)
    if dim0:
        x = x.t().contiguous()
    y = fp4.fake_quant(x, name, dim=0 if dim0 else -1, rounding=rounding, seed=0)
    assert y.shape == x.shape
    assert not torch.isfinite(y[~torch.isfinite(x)]).any()
    # saturation: |Q(x)| never exceeds qmax * block scale; with fp32 scales, never the block amax.
    # Checked in every block of finite values (their scales do not depend on the other blocks),
    # unless a non-finite value elsewhere sets an e4m3 format's tensor scale
    lim = grid_limit(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), name, dim=0 if dim0 else -1)
    xb = (x.t() if dim0 else x).reshape(rows, nblocks, fmt.block)
    yb = (y.t() if dim0 else y).reshape(rows, nblocks, fmt.block)
    ok = torch.isfinite(xb).all(-1, keepdim=True).expand_as(xb) & torch.isfinite(yb)
    if fmt.scale != "e4m3" or torch.isfinite(x).all():
        limb = (lim.t() if dim0 else lim).reshape(rows, nblocks, fmt.block)
        assert (yb.abs()[ok].double() <= limb[ok] * (1 + 1e-6) + 1e-300).all()
    if fmt.scale == "fp32":
        amax = xb.abs().amax(-1, keepdim=True).expand_as(xb)
        assert (yb.abs()[ok] <= amax[ok] * (1 + 1e-5) + 1e-38).all()


# -----------------------------------------------------------------------------
# FP8 operands and the FP8 GEMM path (power-of-two block scales)

@pytest.mark.parametrize("name", ["mxfp4", "mxint4", "int4/16/e8m0"])
@pytest.mark.parametrize("fp8", [fp4.E4M3, fp4.E5M2])
@pytest.mark.parametrize("dim", [-1, 0])
def test_to_fp8_is_fake_quant_times_a_power_of_two(name, fp8, dim):
    torch.manual_seed(3)
    x = torch.randn(64, 96) * torch.exp2(torch.randint(-6, 6, (64, 1)).float())
    v, s = fp4.to_fp8(x, name, dim=dim, fp8=fp8)
    assert v.dtype == fp8 and v.stride(dim) == 1
    assert torch.frexp(s)[0].item() == 0.5, "the tensor scale is a power of two"
    fake = fp4.fake_quant(x, name, dim=dim, dtype=torch.float32)
    assert torch.equal(v.float() * s, fake)
    bad, n = fp4.fp8_inexact_blocks(v, s, fake, name, dim)
    assert bad.item() == 0 and n == x.numel() // fp4.get_format(name).block


def test_to_fp8_counts_the_blocks_below_its_window():
    """int4 in e4m3 holds 16 binades of block scale below the largest, e5m2 30: a block 2^20
    below the rest is inexact in e4m3 (counted), exact in e5m2."""
    x = torch.randn(4, 64)
    x[1, :32] *= 2.0 ** -20
    for fp8, expect in ((fp4.E4M3, 1), (fp4.E5M2, 0)):
        v, s = fp4.to_fp8(x, "mxint4", fp8=fp8)
        fake = fp4.fake_quant(x, "mxint4", dtype=torch.float32)
        bad, n = fp4.fp8_inexact_blocks(v, s, fake, "mxint4")
        assert (bad.item(), n) == (expect, 8)
        assert (v.float() * s != fake)[1, :32].any().item() == bool(expect)


@pytest.mark.parametrize("name", ["mxfp4", "mxint4", "int4/16/e8m0"])
@pytest.mark.parametrize("fp8", [fp4.E4M3, fp4.E5M2])
@pytest.mark.parametrize("dim,rht", [(-1, None), (0, None), (0, 16), (-1, 32)])
def test_fp8_from_packed_is_the_packed_operand_times_a_power_of_two(name, fp8, dim, rht):
    """values * scale == dequantize(q) bit for bit, laid out as to_fp8's; without an RHT it is
    to_fp8's result itself; with one, its scale is the largest block's, at most to_fp8's (which
    bounds the RHT's growth from max |x| before it)."""
    torch.manual_seed(5)
    x = torch.randn(64, 96) * torch.exp2(torch.randint(-6, 6, (64, 1)).float())
    q = fp4.quantize(x, name, dim=dim, rht=rht)
    v, s = fp4.fp8_from_packed(q, fp8)
    rv, rs = fp4.to_fp8(x, name, dim=dim, rht=rht, fp8=fp8)
    assert v.dtype == fp8 and v.shape == x.shape and v.stride() == rv.stride()
    assert torch.equal(v.float() * s, fp4.dequantize(q, torch.float32))
    given = fp4.fp8_from_packed(q, fp8, top=fp4.largest_block_scale(q))
    assert torch.equal(given[0].float(), v.float()) and torch.equal(given[1], s)
    if rht is None:
        assert torch.equal(v.float(), rv.float()) and torch.equal(s, rs)
    else:
        assert s <= rs and torch.frexp(s)[0].item() == 0.5
        assert q.scales.amax() * 2 ** -fp4.FP8_ROOM[fp8] == s


def test_fp8_from_packed_edges():
    """Blocks 2^20 below the largest are counted out of e4m3's window, not of e5m2's; a zero
    tensor gets scale 1; a NaN block a NaN scale (never a finite one); formats without
    power-of-two scales are refused."""
    x = torch.randn(4, 64)
    x[1, :32] *= 2.0 ** -20
    q = fp4.quantize(x, "mxint4")
    for fp8, expect in ((fp4.E4M3, 1), (fp4.E5M2, 0)):
        v, s = fp4.fp8_from_packed(q, fp8)
        assert fp4.fp8_inexact_blocks(v, s, fp4.dequantize(q, torch.float32), "mxint4")[0].item() == expect
    v, s = fp4.fp8_from_packed(fp4.quantize(torch.zeros(32, 64), "mxfp4", dim=0))
    assert s.item() == 1.0 and not v.float().any()
    empty = torch.zeros(0, 64)   # no blocks, none inexact (telemetry of an empty expert's call)
    v, s = fp4.to_fp8(empty, "mxint4")
    bad, n = fp4.fp8_inexact_blocks(v, s, fp4.fake_quant(empty, "mxint4"), "mxint4")
    assert (bad.item(), n) == (0, 0)
    x[2, 3] = float("nan")
    assert fp4.fp8_from_packed(fp4.quantize(x, "mxint4"))[1].isnan()
    with pytest.raises(ValueError, match="power-of-two"):
        fp4.fp8_from_packed(fp4.quantize(x, "ufp4"))
    with pytest.raises(ValueError, match="largest_block_scale"):
        fp4.fp8_from_packed(q, top=q.scales.float())  # every block's scale, not the largest


def test_fp8_scale_edges():
    scale = lambda amax, fp8=fp4.E4M3, rht=None: fp4.fp8_scale(torch.tensor(amax), "mxint4", fp8, rht).item()  # noqa: E731
    assert scale(0.0) == 1.0
    assert math.isnan(scale(float("nan"))) and math.isnan(scale(float("inf")))
    assert scale(2.0 ** 12) == 2.0 ** 4      # block scale 2^10 (int4: 7 x 2^10 > 2^12), room 6
    assert scale(2.0 ** 12, rht=16) == 2.0 ** 6      # RHT16 grows an element at most 4x: +2
    assert scale(2.0 ** 12, rht=128) == 2.0 ** 8     # sqrt(128) = 11.3, rounded up to 16: +4
    assert scale(2.0 ** -127, fp4.E5M2) == 2.0 ** -126  # kept normal
    assert scale(3e38, fp4.E4M3, 128) == 2.0 ** 123    # the bound past fp32's range: still finite


@pytest.mark.parametrize("rht", [16, 32, 128])
@pytest.mark.parametrize("fp8", [fp4.E4M3, fp4.E5M2])
def test_to_fp8_scale_bounds_the_rht(rht, fp8):
    """The scale comes from max |x| before the RHT. x made of the RHT matrix's columns makes the
    RHT give sqrt(rht) max |x| in one element of each chunk (the bound's worst case): no FP8 value
    overflows, every block is exact; so for Gaussian data."""
    worst = fp4.rht_matrix(rht).t()[:4].repeat_interleave(2, 0) * 7.0 * torch.exp2(torch.arange(8.0))[:, None]
    grow = fp4.rht_transform(worst, rht).abs().amax() / worst.abs().amax()
    assert grow >= 0.999 * math.sqrt(rht), "the worst case: one output sqrt(rht) times max |x|"
    for x in (worst.repeat(1, 256 // rht), torch.randn(8, 256) * 3):
        for dim in (-1, 0):
            xd = x if dim == -1 else x.t().contiguous()
            v, s = fp4.to_fp8(xd, "mxint4", dim=dim, rht=rht, fp8=fp8)
            fake = fp4.fake_quant(xd, "mxint4", dim=dim, rht=rht, dtype=torch.float32)
            assert v.float().isfinite().all() and torch.equal(v.float() * s, fake)


def test_to_fp8_rejects_formats_without_power_of_two_scales():
    for name in ("ufp4", "nvfp4", "e2m1"):
        with pytest.raises(ValueError, match="power-of-two"):
            fp4.to_fp8(torch.randn(4, 32), name)


CPU = torch.device("cpu")

def test_uses_fp8_dispatch():
    assert fp4._uses_fp8(fp4.make_recipe("mxfp4", fp8_gemm=True), None, CPU)
    assert fp4._uses_fp8(fp4.make_recipe("mxint4", fp8_gemm=True), None, CPU)
    assert fp4._uses_fp8(fp4.make_recipe("ufp4", fmt="int4/16/e8m0", fp8_gemm=True), None, CPU)
    with pytest.raises(ValueError, match="quantizes no GEMM, so rht, sr_dy would change nothing"):
        fp4.make_recipe("bf16", rht="all", sr_dy=False)
    assert fp4.make_recipe("bf16", fmt="ufp4", rht="all").quantized   # a format makes it 4-bit
    for name, kw in (("ufp4", {}), ("nvfp4", {}), ("bf16", {}), ("mxfp4", dict(weight_2d=True))):
        with pytest.raises(ValueError, match="fp8_gemm=True needs power-of-two"):
            fp4.make_recipe(name, fp8_gemm=True, **kw)
    assert not fp4._uses_fp8(fp4.make_recipe("mxfp4"), None, CPU)  # opt-in
    assert fp4._uses_fp8(fp4.make_recipe("mxfp4", fp8_gemm=True), torch.tensor([3, 5]), CPU)  # experts


def test_uses_fp8_keeps_gpu_experts_off_the_reference_loop(monkeypatch):
    """On a GPU with FP8 GEMMs the dense layer takes them on either backend; the experts only
    with the Triton kernels (the reference's per-expert FP8 loop would wait for the host)."""
    cuda, r, counts = torch.device("cuda"), fp4.make_recipe("mxint4", fp8_gemm=True), torch.tensor([3, 5])
    monkeypatch.setattr(fp4, "_has_fp8_gemm", lambda device: True)
    monkeypatch.setattr(fp4, "_kernels_on", lambda device: None)
    assert fp4._uses_fp8(r, None, cuda) and not fp4._uses_fp8(r, counts, cuda)
    monkeypatch.setattr(fp4, "_kernels_on", lambda device: object())
    assert fp4._uses_fp8(r, counts, cuda)


@pytest.mark.parametrize("name,tokens,train_w", [("mxfp4", 64, True), ("mxint4", 64, True),
                                                 ("mxint4", 50, True), ("mxfp4", 64, False)])
def test_fp8_gemm_layer_equals_the_bf16_gemm_layer(name, tokens, train_w, monkeypatch):
    """Same operands, fp32 products on the CPU: y, dx and dW agree bit for bit (tokens that fill
    no whole Wgrad block pad; a frozen weight needs no Wgrad); the backward keeps Wgrad's x packed
    (half a byte an element and a scale per block, as on bf16 GEMMs) and makes its FP8 operand
    when it needs it."""
    x = torch.randn(tokens, 96)
    w = torch.randn(128, 96)
    outs, calls, real = [], [], fp4._fp8_mm
    monkeypatch.setattr(fp4, "_fp8_mm", lambda *a, **k: calls.append(a[1][0].dtype) or real(*a, **k))
    for on in (True, False):
        r = fp4.make_recipe(name, fp8_gemm=on)
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(train_w)
        torch.manual_seed(1)
        y = fp4.fp4_linear(xi, wi, r)
        y.backward(torch.randn_like(y))
        outs.append((y.detach(), xi.grad, wi.grad))
    # Fprop, Dgrad (and Wgrad, whose b is x in e4m3) on FP8 GEMMs, only in the FP8 layer
    assert calls == [fp4.E4M3, fp4.E4M3] + [fp4.E4M3] * train_w, calls
    for a, b in zip(*outs):
        assert (a is None and b is None and not train_w) or torch.equal(a, b)
    lin = fp4.FP4Linear(96, 128, bias=False, recipe=fp4.make_recipe(name, fp8_gemm=True))
    packed = fp4.FP4Linear(96, 128, bias=False, recipe=name)
    for layer in (lin, packed):  # codes, bf16 block scales (e8m0 values), SR seeds
        assert fp4.saved_bytes(layer, torch.randn(64, 96)) == 64 * 96 // 2 + 64 // 32 * 96 * 2 + 6 * 8


@pytest.mark.parametrize("name,aligned", [("mxint4", False), ("mxfp4", False), ("mxint4", True)])
def test_fp8_gemm_experts_equal_the_bf16_gemm_experts(name, aligned, monkeypatch):
    """GroupedLinear on FP8 GEMMs (fp8_grouped_mm) == on bf16 GEMMs over the same operands, fp32
    products on the CPU: y, dx and dW bit for bit, groups padded by the layer (an empty one among
    them) or laid out aligned; the experts' weights go through to_fp8 as one 3D tensor."""
    counts = torch.tensor([32, 0, 64] if aligned else [7, 0, 33])
    x = torch.randn(int(counts.sum()), 96)
    dy = torch.randn(int(counts.sum()), 64)
    calls, real = [], fp4.fp8_grouped_mm
    monkeypatch.setattr(fp4, "fp8_grouped_mm", lambda *a, **k: calls.append(a[0][0].dtype) or real(*a, **k))
    outs = []
    for on in (True, False):
        torch.manual_seed(1)
        layer = fp4.GroupedLinear(3, 96, 64, recipe=fp4.make_recipe(name, fp8_gemm=on))
        xi = x.clone().requires_grad_(True)
        y = layer(xi, counts, aligned=aligned)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, layer.weight.grad))
    for a, b, nm in zip(*outs, ("y", "dx", "dW")):
        assert torch.equal(a, b), nm
    assert not outs[0][2][1].any()  # the empty group's weight gets no gradient
    assert calls == [fp4.E4M3, fp4.E5M2, fp4.E5M2]  # Fprop, Dgrad, Wgrad: only the FP8 layer


def test_cache_weights_equals_quantizing_per_call():
    """fp4.cache_weights keeps W's two FP8 operands: y, dx, dW equal quantizing W in every call
    (bit for bit, over two calls); the GEMMs read the cache; an eager call after the weight or
    the recipe changed without a new cache_weights is an error; probing quantizes afresh."""
    outs = []
    for cache in (False, True):
        torch.manual_seed(1)
        lin = fp4.FP4Linear(96, 128, bias=False, recipe=fp4.make_recipe("mxint4", fp8_gemm=True))
        assert fp4.cache_weights(lin) == 1 if cache else lin.weight_fprop is None
        for call in range(2):
            x = torch.randn(64, 96, requires_grad=True)
            y = lin(x)
            y.backward(torch.randn_like(y))
            outs.append((y.detach(), x.grad, lin.weight.grad.clone()))
    for a, b in zip(outs[:2], outs[2:]):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert lin.weight_fprop.dtype == fp4.E4M3 and lin.weight_dgrad.stride(0) == 1  # as to_fp8 lays them
    with fp4.probe_alphas() as p:
        lin(x).sum().backward()
    assert {"fprop_w", "dgrad_w"} <= set(fp4.probe_summary(p))
    lin.weight_fprop.zero_()
    assert not lin(x).any(), "Fprop reads the cached operand"
    with torch.no_grad():
        lin.weight.mul_(2)
    with pytest.raises(RuntimeError, match="cache_weights"):
        lin(x)
    fp4.cache_weights(lin)
    assert lin(x).any()
    lin.weight.data = lin.weight.data * 3   # another storage, and no version bumped
    with pytest.raises(RuntimeError, match="cache_weights"):
        lin(x)
    fp4.cache_weights(lin)
    lin.recipe = fp4.make_recipe("mxint4", fp8_gemm=True, rht="none")
    with pytest.raises(RuntimeError, match="recipe changed"):
        lin(x)
    lin.recipe = "ufp4"
    assert fp4.cache_weights(lin) == 0 and lin.weight_fprop is None and lin(x).shape == (64, 128)
    assert "weight_fprop" not in lin.state_dict()


@pytest.mark.parametrize("name", ["mxfp4", "mxint4"])
def test_packed_weight_cache_gives_the_same_layer(name, monkeypatch):
    """Recipe fp8_weight_cache='packed': cache_weights keeps W's two operands as packed codes and
    block scales (about half the bytes of the FP8 cache), with each one's largest block scale,
    and every call makes its FP8 operand from them, y, dx and dW equal to the FP8 cache's bit for
    bit (mxint4's W under the RHT); a forward alone converts Fprop's alone; the FP8 cache drops
    the largest scales; an error without fp8_gemm."""
    outs, conversions = [], _count_fp8_from_packed(monkeypatch)
    for cache in ("fp8", "packed"):
        torch.manual_seed(2)
        lin = fp4.FP4Linear(96, 128, bias=False,
                            recipe=fp4.make_recipe(name, fp8_gemm=True, fp8_weight_cache=cache))
        assert fp4.cache_weights(lin) == 1
        x = torch.randn(64, 96, requires_grad=True)
        conversions.clear()
        y = lin(x)
        y.backward(torch.randn_like(y))
        outs.append((y.detach(), x.grad, lin.weight.grad.clone(), len(conversions)))
    assert all(torch.equal(u, v) for u, v in zip(outs[0][:3], outs[1][:3]))
    assert outs[1][3] == outs[0][3] + 2  # Fprop's and Dgrad's W, beside Wgrad's x in both
    assert lin.weight_fprop.dtype == torch.uint8 and lin.weight_fprop.shape == (128, 48)
    assert lin.weight_dgrad.shape == (96, 64) and lin.weight_dgrad_scale.shape == (96, 128 // 32)
    for side in ("fprop", "dgrad"):  # each orientation's own largest block scale, kept for its calls
        top, scales = getattr(lin, f"weight_{side}_top"), getattr(lin, f"weight_{side}_scale")
        assert top.dtype == torch.float32 and top.shape == () and top == scales.float().amax()
    conversions.clear()
    with torch.no_grad():
        lin(torch.randn(64, 96))
    assert len(conversions) == 1  # Fprop's W alone: Dgrad's is made in backward, where needed
    lin.recipe = fp4.make_recipe(name, fp8_gemm=True)
    assert fp4.cache_weights(lin) == 1 and lin.weight_fprop_top is None and len(lin._weight_q()) == 4
    with pytest.raises(ValueError, match="add fp8_gemm=True"):
        fp4.make_recipe(name, fp8_weight_cache="packed")


def test_weight_cache_refreshes_like_cache_weights():
    """fp4.WeightCache.refresh() caches what cache_weights does (graph=True on CPU tensors: no
    CUDA graph, eager refreshes) and keeps the eager staleness check: current after each
    refresh, an error after a weight change without one."""
    torch.manual_seed(0)
    lin = fp4.FP4Linear(96, 128, bias=False, recipe=fp4.make_recipe("mxfp4", fp8_gemm=True))
    weights = fp4.WeightCache(lin, graph=True)
    assert weights.refresh() == 1 and weights.graph is None and weights.layers == [lin]
    x = torch.randn(64, 96)
    for step in range(2):
        with torch.no_grad():
            lin.weight.add_(0.01)
        with pytest.raises(RuntimeError, match="cache_weights"):
            lin(x)
        weights.refresh()
        cached = lin(x)
        lin.weight_fprop = None  # quantized in the call
        assert torch.equal(cached, lin(x))
        weights.refresh()


@pytest.mark.parametrize("wgrad_x", ["packed", "fp8"])
def test_fp8_telemetry_reports_the_window(wgrad_x, monkeypatch):
    """Every operand of a layer on FP8 GEMMs reports its blocks out of the window; Wgrad's x (kept
    packed and turned into FP8 in backward, or kept as FP8) among them: one of its 6 x 3 blocks
    along the tokens."""
    x, w = torch.randn(64, 96, requires_grad=True), torch.randn(128, 96, requires_grad=True)
    for name, expect in ((fp4.make_recipe("mxfp4", fp8_gemm=True), 0.0), ("ufp4", None)):
        with fp4.probe_alphas() as p:
            fp4.fp4_linear(x, w, name, tag="l").sum().backward()
        summary = fp4.probe_summary(p)
        assert {v["l"][2] for v in summary.values()} == {expect}
    with torch.no_grad():
        x[32:, 5] *= 2.0 ** -30  # one block of Wgrad's x (feature 5, tokens 32-63), not of Fprop's
    conversions = _count_fp8_from_packed(monkeypatch)
    with fp4.probe_alphas() as p:
        fp4.fp4_linear(x, w, fp4.make_recipe("mxfp4", fp8_gemm=True, rht="none", fp8_wgrad_x=wgrad_x),
                       tag="l").sum().backward()
    summary = fp4.probe_summary(p)
    assert summary["wgrad_x"]["l"][2] == 1 / (96 * 2) and summary["fprop_x"]["l"][2] == 0.0
    assert len(conversions) == (wgrad_x == "packed")  # the form asked for is the one counted


@pytest.mark.parametrize("name, fp8", [("ufp4", {}), ("nvfp4", {}), ("mxfp4", {}),
                                       ("mxfp4", dict(fp8_gemm=True)),
                                       ("mxint4", dict(fp8_gemm=True, fp8_wgrad_x="fp8"))])
def test_linear_op_fake_matches_real(name, fp8):
    """The forward op's fake (what torch.compile traces) gives the real outputs' shapes and
    dtypes: y, the SR seeds and Wgrad's packed x (codes, scales in SCALE_DTYPES, tensor scale),
    or its e4m3 values and scale."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    recipe = fp4.make_recipe(name, **fp8)
    key = fp4.recipe_key(recipe)
    x, w = torch.randn(64, 96), torch.randn(128, 96)
    real = fp4._linear_op(x, w, None, key, torch.float32, "", True, [], False, [])
    with FakeTensorMode() as mode:
        fake = fp4._linear_op(mode.from_tensor(x), mode.from_tensor(w), None, key, torch.float32, "",
                              True, [], False, [])
    assert [(t.shape, t.stride(), t.dtype) for t in fake] == [(t.shape, t.stride(), t.dtype) for t in real]
    if recipe.fp8_wgrad_x == "fp8":
        assert real[2].dtype == fp4.E4M3 and real[2].shape == (96, 64)
    else:
        assert real[3].dtype == fp4.SCALE_DTYPES[fp4.get_format(recipe.wgrad.fmt).scale]


def test_layer_keeps_a_half_precision_inputs_dtype_as_nn_linear():
    """A bf16 model run without autocast: y in bf16 (fp32 doubled the activations downstream),
    equal to the layer under bf16 autocast; fp32 and fp64 inputs keep theirs."""
    for rec in ("ufp4", "nvfp4", fp4.make_recipe("mxint4", fp8_gemm=True)):
        lin = fp4.FP4Linear(64, 32, recipe=rec).to(torch.bfloat16)
        x = torch.randn(16, 64, dtype=torch.bfloat16)
        y = lin(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert y.dtype == torch.bfloat16 and torch.equal(y, lin(x))
    lin = fp4.FP4Linear(64, 32, recipe="ufp4").double()
    assert lin(torch.randn(4, 64, dtype=torch.float64)).dtype == torch.float64
