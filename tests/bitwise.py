"""Bit-exact comparison of tensors, shared by the CPU kernel tests and the GPU kernel check."""
import torch


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
