"""Bit-exact comparison of tensors, shared by the CPU kernel tests and the GPU kernel check, and
the check that stochastic rounding lands on a grid neighbour."""
import torch

import fp4


def bits(t):
    """Integer view of a tensor of 1-, 2-, 4- or 8-byte elements (for bit-exact comparisons)."""
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(dtype)


def assert_same(a, b, what=""):
    """Bit-identical, except that any NaN matches any NaN (uint8: byte for byte)."""
    assert (a is None) == (b is None), f"{what}: one is None"
    if a is None:
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    if a.dtype == torch.uint8:
        bad = (a != b).sum().item()
        assert bad == 0, f"{what}: {bad} of {a.numel()} bytes differ"
        return
    na, nb = a.isnan(), b.isnan()
    assert torch.equal(na, nb), f"{what}: NaN positions differ ({na.sum().item()} vs {nb.sum().item()})"
    diff = (bits(a) != bits(b)) & ~na
    assert not diff.any(), (f"{what}: {diff.sum().item()} of {a.numel()} differ, e.g. "
                            f"{a[diff][:4].tolist()} vs {b[diff][:4].tolist()}")


def element_scales(q):
    """Each element's scale in a quantized tensor (its block scale over the tensor scale), fp64,
    in q's layout (blocked dim last)."""
    s = q.scales.double().repeat_interleave(q.fmt.block, -1)
    return s / q.tensor_scale.double() if q.tensor_scale is not None else s


def grid_neighbours(x, fmt):
    """For x quantized in fmt's blocks along its last dim: each element's scale, |x| in grid
    units (at most qmax), and the grid levels just below and just above it."""
    q = fp4.quantize(x, fmt)
    scale = element_scales(q)
    lv = torch.tensor(fp4.GRIDS[q.fmt.grid].levels, dtype=torch.float64)
    t = (x.double().abs() / scale).clamp(max=lv[-1].item())
    lo = lv[(torch.searchsorted(lv, t, right=True) - 1).clamp(min=0)]
    hi = lv[torch.searchsorted(lv, t).clamp(max=len(lv) - 1)]
    return scale, t, lo, hi


def assert_grid_neighbours(y, x, fmt, what=""):
    """Every value of y (x rounded in fmt's blocks along the last dim, as fake_quant returns it)
    is one of the two grid levels around |x| / its block scale (fp4.quantize's scales), never
    further: what stochastic rounding may draw."""
    scale, t, lo, hi = grid_neighbours(x, fmt)
    d = y.double().abs() / scale
    tol = 1e-6 * fp4.GRIDS[fp4.get_format(fmt).grid].qmax
    ok = ((d - lo).abs() <= tol) | ((d - hi).abs() <= tol) | (scale == 0)
    assert ok.all(), (f"{what}: {int((~ok).sum())} of {y.numel()} values are not a grid neighbour "
                      f"of x, e.g. {d[~ok][:3].tolist()} for {t[~ok][:3].tolist()} (grid units)")
