"""
fp4.py: the math of 4-bit training, in plain PyTorch (the reference; CPU and GPU).

Read top to bottom:
  1. element grids, scale kinds and block formats, as data
  2. the random Hadamard transform (RHT)
  3. the backend switch: kernels_for, the one dispatch point to kernels.py's Triton versions of
     sections 4 and 5
  4. rounding to a grid (RTNE, stochastic), block scales, pack/unpack -> quantize / dequantize
  5. FP8 operands of power-of-two-scaled formats (to_fp8)
  6. recipes: per GEMM (Fprop, Dgrad, Wgrad) which format, RHT, SR
  7. the quantized linear layer: the six operands of a layer call, the three GEMMs as one
     forward and one backward custom op (opaque to torch.compile), shared by the dense layer and
     the grouped MoE experts, on bf16 or (power-of-two scales) FP8 GEMMs; convert
  8. shrinkage diagnostics: attenuation alpha, SQNR, bucket use, per-bin bias

Conventions used everywhere:
  - blocks run along `dim`, the reduction dimension of the GEMM that consumes the tensor
  - a 4-bit code is sign-magnitude: bit 3 = sign, bits 0-2 = index into the grid's magnitudes
    (for e2m1 this is exactly the OCP E2M1 bit pattern). Two codes per byte: element 2i in the
    low nibble, element 2i+1 in the high nibble (the OCP / NVIDIA order).
  - block scales are computed in fp32 and stored in their kind's SCALE_DTYPES entry (fp32, or
    bf16 for e4m3 and e8m0, which holds them exactly); value = grid value * block scale / tensor
    scale.
  - a block holding NaN or Inf gets a NaN scale, so it dequantizes to NaN: non-finite inputs are
    never turned into finite numbers (for e4m3 scales a non-finite tensor amax makes the whole
    tensor NaN). An all-zero block gets scale 0 and dequantizes to zeros.
"""
import contextlib
import functools
import math
import numbers
import re
import typing
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# 1. Formats as data

@dataclass(frozen=True)
class Grid:
    name: str
    levels: tuple  # non-negative magnitudes, ascending, 8 of them (3 bits + sign)

    @property
    def qmax(self):
        return self.levels[-1]

GRIDS = {
    # the non-uniform OCP FP4 grid: the gap above 2 and 4 is twice the gap below -> shrinkage
    "e2m1": Grid("e2m1", (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)),
    # UFP4's uniform grid: symmetric int4, never -8 (an asymmetric range biases the mean)
    "int4": Grid("int4", (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0)),
    # = int4 / 4: quantizes identically under a float block scale
    "e1m2": Grid("e1m2", (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75)),
}

SCALE_KINDS = ("fp32", "e4m3", "e8m0")  # e4m3 comes with an fp32 per-tensor scale (NVFP4 math)
E4M3_MAX = 448.0
# How a QTensor stores each kind's block scales: the narrowest torch dtype that holds every value
# exactly, with 0 (all-zero blocks) and NaN (non-finite blocks). bf16 holds e4m3's 3-bit mantissas
# and e8m0's powers of two 2^-127..2^127 (2^-127 as a subnormal); torch's float8_e8m0fnu has no 0.
SCALE_DTYPES = {"fp32": torch.float32, "e4m3": torch.bfloat16, "e8m0": torch.bfloat16}

@dataclass(frozen=True)
class Format:
    name: str
    grid: str         # key of GRIDS
    block: int        # elements per block along the reduction dim
    scale: str        # one of SCALE_KINDS
    block_2d: bool = False  # square block x block tiles (NVIDIA's weights): same Q(W) for W and W^T

    def __post_init__(self):
        if self.grid not in GRIDS:
            raise ValueError(f"unknown grid {self.grid!r}; valid grids: {sorted(GRIDS)}")
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"unknown scale kind {self.scale!r}; valid: {list(SCALE_KINDS)}")
        if self.block not in (16, 32):
            raise ValueError(f"block must be 16 or 32, got {self.block}")

FORMATS = {
    "ufp4":   Format("ufp4",   "int4", 16, "fp32"),  # the UFP4 paper
    "e2m1":   Format("e2m1",   "e2m1", 16, "fp32"),  # the paper's E2M1 baseline
    "nvfp4":  Format("nvfp4",  "e2m1", 16, "e4m3"),  # NVIDIA
    "mxfp4":  Format("mxfp4",  "e2m1", 32, "e8m0"),  # OCP MX v1.0
    "nvint4": Format("nvint4", "int4", 16, "e4m3"),  # UFP4's grid with hardware-friendly scales
    "mxint4": Format("mxint4", "int4", 32, "e8m0"),
}

def get_format(fmt):
    """A Format from a Format, a name in FORMATS, or 'grid/block/scale' (e.g. 'e1m2/32/e4m3')."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str) and fmt in FORMATS:
        return FORMATS[fmt]
    if isinstance(fmt, str) and fmt.count("/") == 2 and fmt.split("/")[1].isdigit():
        grid, block, scale = fmt.split("/")
        return Format(fmt, grid, int(block), scale)
    raise ValueError(f"unknown format {fmt!r}; valid names: {sorted(FORMATS)}, "
                     f"or 'grid/block/scale' with grid in {sorted(GRIDS)}, block 16 or 32, "
                     f"scale in {list(SCALE_KINDS)}")

# -----------------------------------------------------------------------------
# 2. Random Hadamard transform: R = diag(s) H_n / sqrt(n), applied to n-chunks along a dim
#
# Why it is free: a GEMM's two operands are rotated along their shared reduction dim, and R is
# orthogonal, so (A R)(B R)^T = A B^T: no inverse is ever applied. What it buys: R spreads an
# outlier over its n-chunk, so the block amaxes shrink and the other values keep more levels.

RHT_SEED = 20260616
RHT_SIZES = (16, 32, 64, 128)

def is_rht_size(n):
    """n is one of RHT_SIZES as a Python int (16.0 and True compare equal to sizes, but are not)."""
    return isinstance(n, int) and not isinstance(n, bool) and n in RHT_SIZES

def rht_signs(n, device=None):
    g = torch.Generator().manual_seed(RHT_SEED + n)
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).float().to(device)

def rht_matrix(n, device=None):
    """The n x n orthogonal matrix R = diag(s) H_n / sqrt(n) (Sylvester H_n)."""
    H = torch.ones(1, 1)
    while H.shape[0] < n:
        H = torch.cat((torch.cat((H, H), 1), torch.cat((H, -H), 1)), 0)
    return (rht_signs(n)[:, None] * H / math.sqrt(n)).to(device)

def rht_transform(x, n=16, dim=-1):
    """x R on n-chunks along dim, in fp32. A butterfly (fast Walsh-Hadamard) rather than a
    matmul, so that every implementation that adds in the same order gets the same bits."""
    if not is_rht_size(n):
        raise ValueError(f"RHT size must be one of {RHT_SIZES}, got {n!r}")
    x = x.float().movedim(dim, -1)
    shape = x.shape
    if shape[-1] % n:
        raise ValueError(f"length {shape[-1]} is not a multiple of the RHT size {n}")
    y = (x.reshape(-1, n) * rht_signs(n, x.device))
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(shape) * (1.0 / math.sqrt(n))
    return y.movedim(-1, dim)

# -----------------------------------------------------------------------------
# 3. Backend: the one dispatch point between this reference and kernels.py
#
# Every quantizer below and the layer ask kernels_for(x) whether kernels.py's Triton version
# runs instead; set_backend('torch') keeps everything here (tests compare the two).

BACKEND = "auto"  # "torch" (this file), "triton" (kernels.py on CUDA), "auto": triton on CUDA
SR_BITS_CHOICES = (8, 16)

def set_backend(name):
    global BACKEND
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown backend {name!r}; valid: 'auto', 'torch', 'triton'")
    BACKEND = name

def set_sr_bits(bits):
    """Random bits per stochastic-rounding draw in the Triton kernels: 8 or 16 (the torch
    reference draws fp32 uniforms; docs/formats.md on SR)."""
    if bits not in SR_BITS_CHOICES:
        raise ValueError(f"sr_bits must be one of {SR_BITS_CHOICES}, got {bits!r}")
    kernels = _import_kernels()
    if kernels:
        kernels.set_sr_bits(bits)

def _import_kernels():
    """kernels.py, or None where it cannot be imported. The only import of it here, and a lazy
    one: kernels.py imports this file (and imports without triton, HAVE_TRITON False)."""
    try:
        import kernels
    except ImportError:
        return None
    return kernels

def kernels_for(x):
    """The one dispatch point between this reference and kernels.py: the kernels module when
    tensor x is to be processed by it (a CUDA tensor, triton available, backend not 'torch'),
    else None."""
    return _kernels_on(x.device)

def _kernels_on(device):
    if BACKEND == "torch" or device.type != "cuda":
        return None
    kernels = _import_kernels()
    if BACKEND == "triton" and not (kernels and kernels.HAVE_TRITON):
        raise RuntimeError("backend 'triton' needs the triton package (pip install triton), which "
                           "did not import; set_backend('auto') runs the torch reference instead")
    if kernels and (kernels.AVAILABLE or BACKEND == "triton"):
        return kernels
    return None

# -----------------------------------------------------------------------------
# 4. Rounding, block scales, packing

def _levels(grid, device):
    return torch.tensor(grid.levels, dtype=torch.float32, device=device)

def grid_pieces(grid):
    """The grid as uniform pieces (start level, step, index of start): e2m1 is three of them."""
    q, out = grid.levels, []
    for i in range(len(q) - 1):
        step = q[i + 1] - q[i]
        if not out or out[-1][1] != step:
            out.append((q[i], step, i))
    return out

def round_to_grid(t, grid, rounding="rtne", generator=None):
    """|t| rounded to a grid magnitude (fp32); t is already divided by its block scale.
    RTNE: nearest level, ties to the even index (= even mantissa for e2m1, even integer for int4);
    saturates at qmax. SR: between neighbours lo <= |t| < hi round up with prob (|t|-lo)/(hi-lo)."""
    a = t.abs().clamp_(max=grid.qmax)
    segs = grid_pieces(grid)
    start, step = segs[0][0], segs[0][1]
    if len(segs) > 1:   # piecewise uniform (e2m1): find each element's piece
        start, step = torch.full_like(a, start), torch.full_like(a, step)
        for s0, st, _ in segs[1:]:
            inside = a >= s0
            start.masked_fill_(inside, s0)
            step.masked_fill_(inside, st)
    k = (a - start).div_(step)    # exact: steps are powers of two, starts are levels
    if rounding == "rtne":
        k.round_()                # half to even; every piece starts at an even index
    elif rounding == "sr":
        u = torch.rand(a.shape, generator=generator, device=a.device)
        lo = torch.floor(k)
        k = lo.add_((u < k.sub_(lo)).float())
    else:
        raise ValueError(f"unknown rounding {rounding!r}; valid: 'rtne', 'sr'")
    return k.mul_(step).add_(start).clamp_(max=grid.qmax)

def grid_index(mag, grid):
    """Grid magnitudes -> their index 0..7 (the low 3 bits of a code)."""
    return torch.searchsorted(_levels(grid, mag.device), mag.contiguous()).to(torch.uint8)

def round_e4m3(x):
    """fp32 -> nearest e4m3 value (ties to even), saturating at 448, returned as fp32."""
    return x.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)

def block_scales(amax, grid, scale_kind, s_enc=None):
    """Per-block scale from the block amax, in fp32 (a QTensor stores it in SCALE_DTYPES): the
    decode scale (value = code's grid value * scale) for fp32 and e8m0 scales; for e4m3 the
    decode scale times the tensor's s_enc, which is what NVFP4 stores (decode = scale / s_enc)."""
    # divide by a tensor, not a Python number: CUDA divides by a scalar as a multiply by its
    # reciprocal, which would make the GPU reference differ from the CPU one in the last bit
    qmax = torch.full_like(amax, grid.qmax)
    if scale_kind == "fp32":
        return amax / qmax
    if scale_kind == "e4m3":  # NVFP4: e4m3(amax_b / qmax * s_enc)
        return round_e4m3(amax / qmax * s_enc)
    if scale_kind == "e8m0":  # OCP MX: 2^(floor(log2 amax) - emax_elem), exact via frexp
        emax_elem = math.floor(math.log2(grid.qmax))
        _, e = torch.frexp(amax)                      # amax = m * 2^e, m in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(amax), (e - 1 - emax_elem).clamp(-127, 127))
        return torch.where(amax > 0, scale, torch.zeros_like(amax))
    raise ValueError(f"unknown scale kind {scale_kind!r}")

def tensor_scale_for(x, fmt):
    """NVFP4's fp32 per-tensor encode scale s_enc = qmax * 448 / amax(x) (1 when x is all zero),
    at most fp32's largest value: below amax ~8e-36 the quotient overflows, and an infinite s_enc
    would turn the tensor's zeros into NaN (0 * inf)."""
    amax = x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    s_enc = torch.full_like(amax, GRIDS[fmt.grid].qmax * E4M3_MAX) / amax  # (scalar / t rounds twice)
    s_enc = torch.clamp(s_enc, max=torch.finfo(torch.float32).max)        # (a NaN amax stays NaN)
    return torch.where(amax == 0, torch.ones_like(s_enc), s_enc)

def pack_codes(codes):
    """uint8 codes in 0..15, last dim even -> bytes: element 2i low nibble, 2i+1 high nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)

def unpack_codes(packed):
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)

@dataclass
class QTensor:
    """A quantized tensor. `codes` and `scales` are laid out with the blocked dim moved last:
    codes [..., K // 2] uint8, scales [..., K // block] in SCALE_DTYPES[fmt.scale] (block_2d:
    [..., R // block, K // block] with R the dim before K after the move: square tiles over the
    last two dims)."""
    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None  # e4m3 scales: s_enc (value = grid * scale / s_enc)
    fmt: Format
    shape: tuple    # original shape
    dtype: torch.dtype
    dim: int        # blocked dim of the original tensor (non-negative)
    rht: int | None  # RHT size applied before quantizing (values stay in the rotated basis)

def _quantize_blocks(x, fmt, dim, rounding, rht, seed):
    """The shared core: x -> (x's shape with dim moved last, signed grid values in blocked
    layout, block scales, s_enc or None)."""
    grid = GRIDS[fmt.grid]
    xt = x.detach().float().movedim(dim, -1)  # not differentiable (the layer's op is straight-through)
    if rht:
        xt = rht_transform(xt, rht)
    blocks = _blocked(xt, fmt)                      # [..., n_blocks, block] or 2D tiles
    red = (-3, -1) if fmt.block_2d else (-1,)
    amax = blocks.abs().amax(dim=red, keepdim=True)
    s_enc = tensor_scale_for(xt, fmt) if fmt.scale == "e4m3" else None
    scales = block_scales(amax, grid, fmt.scale, s_enc)
    # a block with NaN or Inf gets a NaN scale (amax propagates NaN): non-finite stays non-finite
    scales = torch.where(amax.isfinite(), scales, torch.full_like(scales, float("nan")))
    scaled = blocks * s_enc / scales if s_enc is not None else blocks / scales
    scaled = scaled.masked_fill_(~(scales > 0), 0.0)  # zero blocks and NaN scales: no NaN codes
    gen = None
    check_seed(seed)
    if rounding == "sr" and seed is not None:
        gen = torch.Generator(device=x.device).manual_seed(int(seed))
    values = round_to_grid(scaled, grid, rounding, gen).copysign_(scaled)
    return xt.shape, values, scales, s_enc

def quantize(x, fmt, dim=-1, rounding="rtne", rht=None, seed=None):
    """Quantize x to a block-scaled 4-bit format along `dim`. rht: None or the RHT size (16...);
    seed: makes stochastic rounding reproducible (None draws from torch's global generator); an
    int, or a one-element integer tensor (the Triton path reads it on the GPU without a sync)."""
    fmt = get_format(fmt)
    dim = blocked_dim(x, dim)
    check_blockable(x, fmt, dim, rht)
    kernels = kernels_for(x)
    if kernels:
        return kernels.quantize(x, fmt, dim=dim, rounding=rounding, rht=rht, seed=seed)
    shape, values, scales, s_enc = _quantize_blocks(x, fmt, dim, rounding, rht, seed)
    codes = grid_index(values.abs(), GRIDS[fmt.grid]) | (torch.signbit(values).to(torch.uint8) << 3)
    scales = scales.squeeze((-3, -1)) if fmt.block_2d else scales.squeeze(-1)
    return QTensor(pack_codes(codes.reshape(shape)), stored_scales(scales, fmt), s_enc, fmt, tuple(x.shape),
                   x.dtype, dim, rht)

def stored_scales(scales, fmt):
    """fp32 block scales as SCALE_DTYPES stores them: bf16 keeps the high 16 bits, exact for these
    values, each NaN keeping its sign (torch's CPU cast writes every NaN with the sign bit set)."""
    if scales.dtype != torch.float32:
        raise TypeError(f"block scales are computed in fp32, got {scales.dtype}")
    if SCALE_DTYPES[fmt.scale] != torch.bfloat16:
        return scales
    return (scales.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)

def _blocked(t, fmt):
    """View with the blocks as their own axes: [..., K/b, b], or [R/b, b, K/b, b] for 2D tiles."""
    K, b = t.shape[-1], fmt.block
    if fmt.block_2d:
        return t.reshape(*t.shape[:-2], t.shape[-2] // b, b, K // b, b)
    return t.reshape(*t.shape[:-1], K // b, b)

def check_qtensor(q):
    """A QTensor's codes and scales have the shapes its shape, dim and format imply (one built or
    altered by hand gives this error, not numbers read past its arrays)."""
    if not isinstance(q, QTensor):
        raise TypeError(f"expected an fp4.QTensor (from fp4.quantize), got {type(q).__name__}")
    moved = (*q.shape[:q.dim], *q.shape[q.dim + 1:], q.shape[q.dim])
    b = q.fmt.block
    codes = (*moved[:-1], moved[-1] // 2)
    scales = (*moved[:-2], moved[-2] // b, moved[-1] // b) if q.fmt.block_2d else (*moved[:-1], moved[-1] // b)
    if q.codes.dtype != torch.uint8 or tuple(q.codes.shape) != codes or tuple(q.scales.shape) != scales:
        raise ValueError(f"QTensor of shape {q.shape} blocked along dim {q.dim} in {q.fmt.name} needs "
                         f"uint8 codes {codes} and scales {scales}, got {q.codes.dtype} codes "
                         f"{tuple(q.codes.shape)} and scales {tuple(q.scales.shape)}")

def dequantize(q, dtype=None):
    """QTensor -> tensor of the original shape (in the RHT basis if q.rht), in q.dtype or `dtype`."""
    check_qtensor(q)
    check_out_dtype(dtype, fp8_ok=True)
    kernels = kernels_for(q.codes)
    if kernels:
        return kernels.dequantize(q, dtype)
    codes = unpack_codes(q.codes).long()
    mag = _levels(GRIDS[q.fmt.grid], codes.device)[codes & 7]
    vals = _blocked(torch.where(codes >= 8, -mag, mag), q.fmt)
    scales = q.scales.float()
    scales = scales[..., :, None, :, None] if q.fmt.block_2d else scales[..., None]
    out = (vals * scales).reshape(codes.shape)
    if q.tensor_scale is not None:
        out = out / q.tensor_scale
    return out.movedim(-1, q.dim).to(dtype or q.dtype)

def fake_quant(x, fmt, dim=-1, rounding="rtne", rht=None, seed=None, dtype=None):
    """dequantize(quantize(x, ...)), bit for bit, without packing: x as the 4-bit GEMM sees it."""
    fmt = get_format(fmt)
    dim = blocked_dim(x, dim)
    check_blockable(x, fmt, dim, rht)
    check_out_dtype(dtype)
    kernels = kernels_for(x)
    if kernels:
        return kernels.fake_quant(x, fmt, dim=dim, rounding=rounding, rht=rht, seed=seed, dtype=dtype)
    shape, values, scales, s_enc = _quantize_blocks(x, fmt, dim, rounding, rht, seed)
    out = values.mul_(scales).reshape(shape)
    if s_enc is not None:
        out = out / s_enc
    return out.movedim(-1, dim).to(dtype or x.dtype)

def quantize_both_args(x, fmt, fmt_col, rht, rht_col, packed, dtype=None):
    """quantize_both's arguments checked and resolved: (row fmt, col fmt, row RHT, col RHT,
    row packed, col packed)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_both takes a 2D tensor, got shape {tuple(x.shape)}")
    fmt = get_format(fmt)
    fmt_col = get_format(fmt_col) if fmt_col is not None else fmt
    rht_col = rht if rht_col == "same" else rht_col
    check_blockable(x, fmt, 1, rht)
    check_blockable(x, fmt_col, 0, rht_col, "rht_col")
    check_out_dtype(dtype)
    pr, pc = _per_side(packed, bool, "packed")
    return fmt, fmt_col, rht, rht_col, pr, pc

def _per_side(value, kind, name):
    """(row, col) of quantize_both's per-side arguments: one value of `kind` for both sides, or a
    pair."""
    if value is None or isinstance(value, kind):
        return value, value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return tuple(value)
    raise ValueError(f"{name} must be one value for both sides or a (row, col) pair, got {value!r}")

def quantize_both(x, fmt, fmt_col=None, rounding="rtne", rounding_col=None, rht=None,
                  rht_col="same", seed=None, seed_col=None, packed=False, dtype=None, fp8=None,
                  fp8_scale=None):
    """A 2D tensor [M, K] quantized row-wise (blocks along dim 1) and column-wise (along dim 0),
    each side with its own format, rounding, RHT and seed (fmt_col, rounding_col: the row side's
    unless given; rht_col "same": rht). Returns (row, col): fake_quant's result, quantize's where
    `packed` (a bool, or one per side) says so, to_fp8's where `fp8` (an FP8 dtype, or one dtype
    or None per side) gives a dtype, with to_fp8's scale from fp8_scale (one for both sides, or
    one per side). Here two calls; kernels.py reads x once."""
    fmt, fmt_col, rht, rht_col, pr, pc = quantize_both_args(x, fmt, fmt_col, rht, rht_col, packed, dtype)
    kernels = kernels_for(x)
    if kernels:
        return kernels.quantize_both(x, fmt, fmt_col, rounding, rounding_col, rht, rht_col, seed,
                                     seed_col, (pr, pc), dtype, fp8, fp8_scale)
    f8r, f8c, s_row, s_col = check_fp8_sides(fmt, fmt_col, pr, pc, fp8, fp8_scale, (rht, rht_col))
    out = []
    for f, d, r, h, s, p, f8, f8s in ((fmt, 1, rounding, rht, seed, pr, f8r, s_row),
                                      (fmt_col, 0, rounding_col or rounding, rht_col, seed_col, pc,
                                       f8c, s_col)):
        if p:
            out.append(quantize(x, f, d, r, h, s))
        elif f8:
            out.append(to_fp8(x, f, d, r, h, s, f8, f8s))
        else:
            out.append(fake_quant(x, f, d, r, h, s, dtype))
    return tuple(out)

# Input checks, shared with kernels.py (the same errors on both paths)

def blocked_dim(x, dim):
    """dim as an index into x's dims (0 <= dim < x.dim()), or an error if x has no such dim."""
    if not -x.dim() <= dim < x.dim() or x.dim() == 0:
        raise IndexError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)} "
                         f"(valid: {-x.dim()} to {x.dim() - 1})")
    return dim % x.dim()

def check_blockable(x, fmt, dim, rht, rht_name="rht"):
    """Raise, with the fix, unless x can be quantized in fmt's blocks along dim with RHT size rht
    (the argument rht_name: quantize_both's column side has its own)."""
    if not x.is_floating_point():
        raise TypeError(f"quantizers take a floating-point tensor, got {x.dtype}: pass x.float()")
    if rht is not None and not is_rht_size(rht):
        raise ValueError(f"{rht_name} must be None or a Python int RHT size in {RHT_SIZES}, got "
                         f"{rht!r} ({type(rht).__name__})")
    K = x.shape[dim]
    for n, what in ((fmt.block, f"block size of format {fmt.name!r}"), (rht or 1, "RHT size")):
        if K % n != 0:
            raise ValueError(f"dim {dim} of a tensor of shape {tuple(x.shape)} has length {K}, "
                             f"not a multiple of the {what} ({n}); pad it or pick sizes that fit")
    if fmt.block_2d and (x.dim() < 2 or x.movedim(dim, -1).shape[-2] % fmt.block != 0):
        raise ValueError(f"2D blocks need a tensor of 2+ dims whose two tiled dims are multiples "
                         f"of {fmt.block}, got shape {tuple(x.shape)} blocked along dim {dim}")

def check_out_dtype(dtype, fp8_ok=False):
    """fake_quant's output dtype: None (x's) or a float of 16+ bits (to_fp8 makes FP8 operands);
    fp8_ok: dequantize's, which also writes E4M3 and E5M2 (fp8_from_packed's values)."""
    if fp8_ok and dtype in (E4M3, E5M2):
        return
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point
                                  and dtype.itemsize >= 2):
        raise TypeError(f"dtype must be None or torch.float32, bfloat16, float16 or float64, got "
                        f"{dtype!r}; for FP8 operands use " + ("fp8_from_packed" if fp8_ok else "to_fp8"))

SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed takes

def check_seed(seed, name="seed"):
    """An SR seed: None, an int in SEED_RANGE, or a one-element integer tensor (read on the GPU
    by the Triton path, so its range is the tensor dtype's)."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype.is_floating_point or seed.dtype.is_complex \
                or seed.dtype == torch.bool:
            raise ValueError(f"a tensor {name} must be one integer, got {seed.dtype} "
                             f"{tuple(seed.shape)}")
    elif seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                               or not SEED_RANGE[0] <= seed < SEED_RANGE[1]):
        raise ValueError(f"{name} must be None, an int in [-2**63, 2**64) or a one-element "
                         f"integer tensor, got {seed!r} ({type(seed).__name__})")

# -----------------------------------------------------------------------------
# 5. FP8 operands of power-of-two-scaled formats
#
# With power-of-two block scales (e8m0) every quantized value q * 2^e is a small integer (int4)
# or half-integer (e2m1) times a power of two, so divided by one power-of-two scale per tensor it
# is exactly an FP8 number while its block is not too far below the tensor's largest: the FP8
# window, the binades below that scale's bound in which a block stays exact (16 for e4m3 on the
# int4 grid, 30 for e5m2; docs/formats.md gives each grid's; after an RHT the bound comes from
# max |x| before the transform). A block below the window rounds to FP8's coarser subnormals;
# fp8_inexact_blocks counts them. So FP8 tensor cores (compute capability 8.9+: Ada, Hopper) can
# run the 4-bit GEMMs on operands bit-identical to fake_quant's (docs/formats.md, FP8 GEMMs).
# The power-of-two scale is a decode scale, value = FP8 value * scale, applied by the GEMM to its
# output (NVFP4's s_enc is the other way round: an encode scale that dequantize divides by).

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# log2 of the room between the largest block scale and the FP8 maximum: 7 * 2^6 = 448 (e4m3),
# 7 * 2^13 = 57344 (e5m2); both grids' values (at most 7 and 6) fit
FP8_ROOM = {E4M3: 6, E5M2: 13}
FP8_MIN_EXP = -126  # the decode scale stays a normal fp32 number
# Fprop's x under Recipe.fp8_x_scale "unit": e5m2 at decode scale 1, set without reading x. Exact
# for block scales up to 2^13 and down to e5m2's subnormals (2^-16 per grid step: block maxima
# from about 6e-5 to just under 2^16); a block above is NaN (a non-finite loss, never clipped)
FP8_UNIT_X = (E5M2, 1.0)
# dy under Recipe.fp8_dy_scale "step": its FP8 scale comes from one pass over the first micro-step's
# dy after each optimizer step (a step state, new_step_state), with Recipe.fp8_step_room binades of
# room above it for the larger values of the step's later micro-steps (at 4096 tokens a micro-step
# the 8 x 384 ablation model's rose by more than 6 in warm-up at one seed of four: docs/formats.md);
# a block past that room is NaN (a skipped step, never clipped), and the window's bottom rises by as
# much. The default room (max_step_room: the most)
FP8_STEP_ROOM = 6

def fp8_bound(rht):
    """log2 of the bound on how much a size-rht RHT can grow an element: each output is a signed sum of
    rht inputs over sqrt(rht), at most sqrt(rht) max |x|, rounded up to a power of two."""
    return math.ceil(math.log2(rht) / 2) if rht else 0

def fp8_scale(amax, fmt, fp8, rht=None, room=0):
    """The tensor's power-of-two decode scale 2^E from amax = max |x| before any RHT: E = log2 of the block
    scale a block holding amax gets, plus fp8_bound(rht) and `room` (binades kept free above amax),
    minus FP8_ROOM[fp8]; at least FP8_MIN_EXP; 1 for an all-zero tensor, NaN if amax is NaN or Inf.
    No block scale after the RHT exceeds the bound, so one plain read of x sets the scale
    (docs/formats.md, FP8 GEMMs)."""
    amax = amax.float()
    top = block_scales(amax, GRIDS[get_format(fmt).grid], "e8m0")
    return torch.where(amax.isfinite(), _fp8_scale_above(top, fp8, fp8_bound(rht) + room), float("nan"))

def new_step_state(device):
    """A step state for to_fp8's scale (Recipe.fp8_dy_scale "step"): int32 [2], the kept amax's
    float bits and a flag; [0, 1] asks the next call to find the amax afresh."""
    return torch.tensor([0, 1], dtype=torch.int32, device=device)

def reset_step_state(state):
    """Back to [0, 1] in place (kernel launches only: fits inside a CUDA graph's capture)."""
    state[0].zero_()
    state[1].fill_(1)

def step_state_amax(state):
    """The amax a step state keeps, as a 0-dim fp32 view of its first word."""
    return state[:1].view(torch.float32)[0]

def step_fp8_scale(state, x, fmt, fp8, rht=None, room=FP8_STEP_ROOM):
    """A step state's FP8 decode scale for x: where its flag is set, x's amax is kept and the flag
    cleared; else the kept amax serves (the kernels then skip the pass over x; here x is read
    either way, so the flag is never read on the host). The scale is fp8_scale's for the kept
    amax with `room` binades of room above it."""
    fresh = x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    kept = torch.where(state[1] != 0, fresh, step_state_amax(state))
    step_state_amax(state).copy_(kept)
    state[1].zero_()
    return fp8_scale(kept, fmt, fp8, rht, room=room)

@dataclass(frozen=True, eq=False)
class StepScale:
    """to_fp8's scale kept for an optimizer step: a step state (new_step_state), which the calls
    read and write in place, and the binades of room above its amax (Recipe.fp8_step_room)."""
    state: torch.Tensor
    room: int = FP8_STEP_ROOM

    def __post_init__(self):
        s = self.state
        if not (isinstance(s, torch.Tensor) and s.dtype == torch.int32 and s.shape == (2,)
                and s.is_contiguous()):
            raise ValueError(f"an FP8 step state is new_step_state's int32 tensor of shape (2,), got {s!r}")

def is_step_state(scale):
    return isinstance(scale, StepScale)

def _fp8_scale_above(top, fp8, bound=0):
    """2^(log2 top + bound - FP8_ROOM[fp8]) for the largest block scale `top` (a power of two),
    at least 2^FP8_MIN_EXP; 1 when top is 0."""
    exp = torch.frexp(top)[1] - 1 + bound - FP8_ROOM[fp8]
    scale = torch.ldexp(torch.ones_like(top), exp.clamp(min=FP8_MIN_EXP))
    return torch.where(top > 0, scale, 1.0)

def check_fp8(fmt, fp8):
    fmt = get_format(fmt)
    if fmt.scale != "e8m0" or fmt.block_2d:
        raise ValueError(f"FP8 operands need power-of-two (e8m0) block scales in 1D blocks; format "
                         f"{fmt.name!r} has {fmt.scale} scales{' in 2D tiles' if fmt.block_2d else ''}: "
                         f"use mxfp4, mxint4 or 'grid/block/e8m0'")
    if fp8 not in FP8_ROOM:
        raise ValueError(f"fp8 must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8}")
    return fmt

def check_fp8_sides(fmt, fmt_col, packed, packed_col, fp8, fp8_scale=None, rhts=(None, None)):
    """quantize_both's fp8 argument (None, an FP8 dtype for both sides, or one dtype or None per
    side) and fp8_scale (to_fp8's scale: one for both, or one per side; rhts: each side's RHT)
    checked: -> (row dtype, col dtype, row scale, col scale)."""
    f8r, f8c = _per_side(fp8, torch.dtype, "fp8")
    s_row, s_col = _per_side(fp8_scale, (int, float, torch.Tensor, StepScale), "fp8_scale")
    for f, p, f8, s, h in ((fmt, packed, f8r, s_row, rhts[0]), (fmt_col, packed_col, f8c, s_col, rhts[1])):
        if f8 and p:
            raise ValueError("a side is either packed or FP8, not both")
        if f8:
            check_fp8(f, f8)
        if s is not None and not f8:
            raise ValueError(f"fp8_scale {s!r} is given for a side that is not FP8: give its fp8 dtype")
        check_fp8_given_scale(s, f8, h)
    return f8r, f8c, s_row, s_col

def to_fp8(x, fmt, dim=-1, rounding="rtne", rht=None, seed=None, fp8=E4M3, scale=None):
    """x quantized as quantize() quantizes it, as (values, scale): FP8 values of x's shape with
    `dim` contiguous in memory (the layout torch._scaled_mm wants of a GEMM operand reduced along
    it), and the fp32 decode scale (fp8_scale). values.float() * scale equals fake_quant(x, ...)
    bit for bit except in blocks more than the FP8 window below the scale's bound
    (fp8_inexact_blocks). scale: a given power-of-two decode scale instead of fp8_scale's (no
    pass over x for its amax), or a StepScale (step_fp8_scale's scale, a pass over x only where
    its state's flag asks); a block whose scale is above that window (values past the
    FP8 maximum) is NaN, never clipped."""
    fmt = check_fp8(fmt, fp8)
    dim = blocked_dim(x, dim)
    check_blockable(x, fmt, dim, rht)
    check_fp8_given_scale(scale, fp8, rht)
    kernels = kernels_for(x)
    if kernels:
        return kernels.to_fp8(x, fmt, dim=dim, rounding=rounding, rht=rht, seed=seed, fp8=fp8,
                              scale=scale)
    q = quantize(x, fmt, dim, rounding, rht, seed)
    values = dequantize(q, torch.float32).movedim(dim, -1)
    if scale is None:
        scale = fp8_scale(x.abs().amax() if x.numel() else x.new_zeros(()), fmt, fp8, rht)
    else:
        scale = (step_fp8_scale(scale.state, x, fmt, fp8, rht, scale.room) if is_step_state(scale)
                 else x.new_tensor(scale, dtype=torch.float32))
        over = (q.scales.float() > scale * 2.0 ** FP8_ROOM[fp8]).repeat_interleave(fmt.block, -1)
        values = values.masked_fill(over, float("nan"))
    return (values / scale).to(fp8).movedim(-1, dim), scale

def check_fp8_given_scale(scale, fp8, rht=None):
    """to_fp8's scale: None, a StepScale (e5m2 only: its window has the room), or a power of two
    (a Python float) that fp32 holds with its inverse (both normal: the kernels take the inverse
    as a constant)."""
    if isinstance(scale, torch.Tensor):
        raise ValueError("a step state goes to to_fp8 as StepScale(state, room), not bare")
    if is_step_state(scale):  # (its state is checked where it is made)
        check_step_room(scale.room, rht)
        if fp8 != E5M2:
            raise ValueError(f"a StepScale is for e5m2 operands (dy), whose window has its room; got {fp8}")
        return
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and 0 < scale < math.inf and math.frexp(scale)[0] == 0.5
                                  and 2.0 ** FP8_MIN_EXP <= scale <= 2.0 ** -FP8_MIN_EXP):
        raise ValueError(f"an FP8 decode scale must be None (from the tensor's amax), a StepScale or "
                         f"a power of two from 2^{FP8_MIN_EXP} to 2^{-FP8_MIN_EXP}, got {scale!r}")

def max_step_room(rht=None):
    """The most room a step scale may keep above its amax: e5m2's FP8_ROOM less the RHT's bound,
    less the one binade of window the kernels need above the scale."""
    return FP8_ROOM[E5M2] - fp8_bound(rht) - 1

def check_step_room(room, rht=None):
    top = max_step_room(rht)
    if not (isinstance(room, int) and not isinstance(room, bool) and 0 <= room <= top):
        raise ValueError(f"fp8_step_room must be an int from 0 to {top} (binades of room above the "
                         f"step's kept amax in dy's e5m2 window{f', with RHT {rht}' if rht else ''}), "
                         f"got {room!r}")

def fp8_from_packed(q, fp8=E4M3, top=None):
    """A QTensor of power-of-two block scales as FP8 (values, scale), laid out as to_fp8 lays
    them: values of q's shape with its blocked dim contiguous. values.float() * scale equals
    dequantize(q) bit for bit except in blocks more than the FP8 window below q's largest block
    (fp8_inexact_blocks). The decode scale is the one that largest block needs (to_fp8's, when no
    RHT was applied). So an operand can wait for its FP8 GEMM packed: half a byte an element.
    top: largest_block_scale(q) where the caller kept it (the packed weight cache), so no pass
    over the block scales looks for it (another value gives another decode scale)."""
    check_qtensor(q)
    check_fp8(q.fmt, fp8)
    if top is not None and not (isinstance(top, torch.Tensor) and top.numel() == 1
                                and top.is_floating_point() and top.device == q.codes.device):
        raise ValueError(f"top must be None or largest_block_scale(q), a one-element float tensor on "
                         f"the codes' device, got {top!r}")
    kernels = kernels_for(q.codes)
    if kernels:
        return kernels.fp8_from_packed(q, fp8, top)
    top = largest_block_scale(q) if top is None else top
    scale = torch.where(top.isnan(), float("nan"), _fp8_scale_above(top, fp8))
    # dequantize divides by the tensor scale: dividing by the decode scale gives the FP8 values
    values = dequantize(in_codes_layout(q, tensor_scale=scale), fp8)
    return values.movedim(-1, q.dim), scale

def largest_block_scale(q):
    """q's largest block scale as a 0-dim fp32 tensor (NaN if a block is NaN; 0 for no blocks)."""
    scales = q.scales.float()
    return scales.amax() if scales.numel() else scales.new_zeros(())

def in_codes_layout(q, tensor_scale=None):
    """q as a QTensor of the shape its codes are laid out in (the blocked dim moved last), so
    dequantize writes the values with that dim contiguous; with another tensor scale."""
    moved = (*q.shape[:q.dim], *q.shape[q.dim + 1:], q.shape[q.dim])
    return replace(q, tensor_scale=tensor_scale, shape=moved, dim=len(moved) - 1)

def fp8_inexact_blocks(values, scale, fake, fmt, dim=-1):
    """(blocks where values * scale differs from fake_quant's `fake`, blocks): the blocks that fell
    out of the FP8 window (or hold NaN): a device count (no host sync) and the int total."""
    diff = (values.float() * scale != fake.float()).movedim(dim, -1)
    block = get_format(fmt).block   # (the block count, not -1: an empty tensor has any)
    bad = diff.reshape(*diff.shape[:-1], diff.shape[-1] // block, block).any(-1)
    return bad.sum(), bad.numel()

# -----------------------------------------------------------------------------
# 6. Recipes: which format, RHT and SR for each of the three GEMMs of a linear layer

@dataclass(frozen=True)
class Gemm:
    """One GEMM's quantization. Operand a is x (Fprop) or dy (Dgrad, Wgrad); b is W (Fprop,
    Dgrad) or x (Wgrad). fmt None keeps this GEMM in high precision."""
    fmt: str | None = None
    rht: bool = False
    sr_a: bool = False
    sr_b: bool = False

    def __post_init__(self):
        if self.fmt is not None:
            get_format(self.fmt)  # an unknown format is an error here, not at the first GEMM
        _check_types(self, bool, "rht", "sr_a", "sr_b")

GEMMS = ("fprop", "dgrad", "wgrad")

def _check_types(obj, kind, *fields):
    """Each field of a recipe dataclass is a `kind` (bool is not taken for int): "no" or 1 for a
    bool field would otherwise read as a switch turned on."""
    for name in fields:
        v = getattr(obj, name)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise TypeError(f"{type(obj).__name__}.{name} must be {kind.__name__}, got {v!r}")

@dataclass(frozen=True)
class Recipe:
    name: str
    fprop: Gemm = Gemm()
    dgrad: Gemm = Gemm()
    wgrad: Gemm = Gemm()
    rht_size: int = 16
    weight_2d: bool = False        # block x block weight tiles: forward and backward see the same Q(W)
    bf16_first: int = 0            # keep the first N transformer blocks in bf16
    bf16_last: int = 0             # ... and the last N
    bf16_last_fraction: float = 0.0  # ... or the last fraction of them (NVIDIA keeps ~15 %)
    fp8_gemm: bool = False         # power-of-two-scaled formats: GEMMs on FP8 operands (_uses_fp8);
                                   # opt-in: exact but for counted blocks below the window (docs/formats.md)
    fp8_fast_accum: tuple = ("fprop", "dgrad")  # the FP8 GEMMs that accumulate in the tensor cores'
                                   # fast mode: up to ~10 % faster, bf16 outputs within rounding
                                   # of the exact mode (docs/formats.md)
    fp8_wgrad_x: str = "packed"    # how forward keeps Wgrad's x on FP8 GEMMs: "packed" (half a byte an
                                   # element, made FP8 in backward) or "fp8" (a byte: faster, more memory)
    fp8_x_scale: str = "amax"      # Fprop's x on FP8 GEMMs: "amax" (e4m3, its scale from a pass over x)
                                   # or "unit" (e5m2 at scale 1: no pass; an absolute window, FP8_UNIT_X)
    fp8_weight_cache: str = "fp8"  # how FP4Linear.cache_weight keeps W's two operands between optimizer
                                   # steps: "fp8" (a byte an element each) or "packed" (about half: made
                                   # FP8 in every call, fp8_from_packed; less memory, a little slower)
    fp8_dy_scale: str = "amax"     # dy on FP8 GEMMs: "amax" (a pass over dy in every call) or "step" (the
                                   # pass once per optimizer step, fp8_step_room binades of room above it:
                                   # faster; a layer's state resets in cache_weights)
    fp8_step_room: int = FP8_STEP_ROOM  # under "step": more room skips fewer steps, flushes more of
                                   # dy's small blocks (docs/formats.md)

    def __post_init__(self):  # a Recipe built directly (not by make_recipe) is checked too
        _check_types(self, Gemm, *GEMMS)
        _check_types(self, bool, "weight_2d", "fp8_gemm")
        _check_types(self, int, "rht_size", "bf16_first", "bf16_last")
        if min(self.bf16_first, self.bf16_last) < 0 or not 0 <= self.bf16_last_fraction <= 1:
            raise ValueError(f"bf16_first and bf16_last must be >= 0 and bf16_last_fraction in "
                             f"[0, 1], got {self.bf16_first}, {self.bf16_last}, "
                             f"{self.bf16_last_fraction}")
        if self.fp8_wgrad_x not in ("packed", "fp8"):
            raise ValueError(f"fp8_wgrad_x must be 'packed' (4-bit codes + scales) or 'fp8' (e4m3), "
                             f"got {self.fp8_wgrad_x!r}")
        if self.fp8_weight_cache not in ("fp8", "packed"):
            raise ValueError(f"fp8_weight_cache must be 'fp8' (e4m3) or 'packed' (4-bit codes + scales), "
                             f"got {self.fp8_weight_cache!r}")
        if self.fp8_dy_scale not in ("amax", "step"):
            raise ValueError(f"fp8_dy_scale must be 'amax' (e5m2 scaled by dy's amax in every call) or "
                             f"'step' (by the amax of its first call after each optimizer step), got "
                             f"{self.fp8_dy_scale!r}")
        check_step_room(self.fp8_step_room, self.rht_size)
        if self.fp8_x_scale not in ("amax", "unit"):
            raise ValueError(f"fp8_x_scale must be 'amax' (e4m3 scaled by x's amax) or 'unit' (e5m2 "
                             f"at scale 1), got {self.fp8_x_scale!r}")
        if self.rht_size not in RHT_SIZES:
            raise ValueError(f"rht_size must be one of {RHT_SIZES}, got {self.rht_size}")
        if not set(self.fp8_fast_accum) <= set(GEMMS):
            raise ValueError(f"fp8_fast_accum names GEMMs of {GEMMS}, got {self.fp8_fast_accum!r}")

    @property
    def quantized(self):
        return any(g.fmt for g in (self.fprop, self.dgrad, self.wgrad))

    def bf16_blocks(self, n_layer):
        """Indices of transformer blocks that stay in bf16 under this recipe."""
        last = max(self.bf16_last, math.ceil(self.bf16_last_fraction * n_layer - 1e-9))
        return set(range(min(self.bf16_first, n_layer))) | set(range(max(n_layer - last, 0), n_layer))

def _preset(name, fmt, rht_on, weight_2d=False, bf16_last_fraction=0.0):
    gemm = lambda which, sr_dy: Gemm(fmt, which in rht_on, sr_a=sr_dy)
    return Recipe(name, gemm("fprop", False), gemm("dgrad", True), gemm("wgrad", True),
                  weight_2d=weight_2d, bf16_last_fraction=bf16_last_fraction)

RECIPES = {
    "bf16": Recipe("bf16"),
    "ufp4": _preset("ufp4", "ufp4", ("fprop", "dgrad", "wgrad")),   # uniform grid: RHT everywhere
    "e2m1": _preset("e2m1", "e2m1", ("wgrad",)),
    "nvfp4": _preset("nvfp4", "nvfp4", ("wgrad",), weight_2d=True, bf16_last_fraction=0.15),
    "mxfp4": _preset("mxfp4", "mxfp4", ("wgrad",)),
    # UFP4's recipe on power-of-two 1x32 block scales (FP8 GEMMs with fp8_gemm: _uses_fp8)
    "mxint4": _preset("mxint4", "mxint4", ("fprop", "dgrad", "wgrad")),
}
def _gemm_names(value, key):
    """'all', 'none' or a list of GEMMs, comma or slash separated ('fprop,wgrad', 'fprop/wgrad':
    the slash form fits in bench.py's comma list of recipes) -> a tuple in GEMMS order."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if not isinstance(value, str):
        raise TypeError(f"{key} must be 'all', 'none' or a list of GEMMs {list(GEMMS)}, got {value!r}")
    on = {"all": GEMMS, "none": (), "": ()}.get(value, tuple(s.strip() for s in re.split("[,/]", value)))
    bad = [g for g in on if g not in GEMMS]
    if bad:
        raise ValueError(f"{key}={value!r}: unknown GEMM(s) {bad}; use 'all', 'none' or a comma "
                         f"or slash list of {list(GEMMS)}")
    return tuple(g for g in GEMMS if g in on)

def make_recipe(name, fmt=None, rht=None, sr_dy=None, rht_size=None, weight_2d=None,
                bf16_first=None, bf16_last=None, fp8_gemm=None, fp8_fast_accum=None, fp8_wgrad_x=None,
                fp8_x_scale=None, fp8_weight_cache=None, fp8_dy_scale=None, fp8_step_room=None):
    """A preset, with ablation overrides (None keeps the preset's choice):
    fmt: a format for all three GEMMs (name or 'grid/block/scale'); rht: 'all', 'none' or a
    list of GEMMs ('fprop,wgrad' or 'fprop/wgrad'); sr_dy: stochastic rounding on dy in Dgrad
    and Wgrad; fp8_gemm: True runs power-of-two-scaled formats on FP8 GEMMs (opt-in);
    fp8_fast_accum: the FP8 GEMMs that accumulate in fast mode, a list as for rht; fp8_wgrad_x:
    'packed' or 'fp8', how an FP8-GEMM layer keeps Wgrad's x from forward to backward;
    fp8_x_scale: 'amax' or 'unit', how it scales Fprop's x (Recipe.fp8_x_scale); fp8_weight_cache:
    'fp8' or 'packed', how it keeps its cached weight operands (Recipe.fp8_weight_cache);
    fp8_dy_scale: 'amax' or 'step', how often dy's FP8 scale is found (Recipe.fp8_dy_scale);
    fp8_step_room: the binades of room above the amax kept under 'step' (Recipe.fp8_step_room)."""
    if isinstance(name, Recipe):
        r = name
    elif name in RECIPES:
        r = RECIPES[name]
    else:
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {sorted(RECIPES)}")
    gemms = {g: getattr(r, g) for g in GEMMS}
    if isinstance(fmt, Format):   # a Gemm holds a format's name: one that means this format
        if fmt.block_2d:
            raise ValueError(f"fmt={fmt}: 2D tiles are the weights' choice, not the format's: "
                             f"give the format without block_2d and weight_2d=True")
        fmt = fmt.name if FORMATS.get(fmt.name) == fmt else f"{fmt.grid}/{fmt.block}/{fmt.scale}"
    if fmt is not None:
        fmt = get_format(fmt).name if fmt not in ("bf16", "none", "") else None
        gemms = {g: replace(v, fmt=fmt) for g, v in gemms.items()}
    if rht is not None:
        on = _gemm_names(rht, "rht")
        gemms = {g: replace(v, rht=g in on) for g, v in gemms.items()}
    if sr_dy is not None:
        if not isinstance(sr_dy, bool):
            raise TypeError(f"sr_dy must be bool, got {sr_dy!r}")
        gemms["dgrad"] = replace(gemms["dgrad"], sr_a=sr_dy)
        gemms["wgrad"] = replace(gemms["wgrad"], sr_a=sr_dy)
    changes = dict(gemms)
    fast = _gemm_names(fp8_fast_accum, "fp8_fast_accum") if fp8_fast_accum is not None else None
    for k, v in dict(rht_size=rht_size, weight_2d=weight_2d, bf16_first=bf16_first,
                     bf16_last=bf16_last, fp8_gemm=fp8_gemm, fp8_fast_accum=fast,
                     fp8_wgrad_x=fp8_wgrad_x, fp8_x_scale=fp8_x_scale,
                     fp8_weight_cache=fp8_weight_cache, fp8_dy_scale=fp8_dy_scale,
                     fp8_step_room=fp8_step_room).items():
        if v is not None:
            changes[k] = v
    if bf16_last is not None:
        changes["bf16_last_fraction"] = 0.0
    out = replace(r, **changes)
    moot = [k for k, v in dict(rht=rht, sr_dy=sr_dy, rht_size=rht_size, weight_2d=weight_2d,
                               bf16_first=bf16_first, bf16_last=bf16_last).items() if v is not None]
    if moot and not out.quantized:
        raise ValueError(f"recipe {r.name!r} quantizes no GEMM, so {', '.join(moot)} would change "
                         f"nothing: pick a 4-bit recipe (or a format: fmt / recipe_format)")
    if out.fp8_gemm and not fp8_capable(out):
        raise ValueError(f"fp8_gemm=True needs power-of-two (e8m0) block scales on all three GEMMs "
                         f"and 1D weight blocks; recipe {r.name!r} has formats "
                         f"{[getattr(out, g).fmt for g in GEMMS]}, weight_2d={out.weight_2d}: pick "
                         f"mxfp4, mxint4 or a 'grid/block/e8m0' format, or leave fp8_gemm off")
    for key, value, asks_fp8 in (("fp8_fast_accum", fp8_fast_accum, fast),
                                 ("fp8_wgrad_x", fp8_wgrad_x, fp8_wgrad_x == "fp8"),
                                 ("fp8_x_scale", fp8_x_scale, fp8_x_scale == "unit"),
                                 ("fp8_weight_cache", fp8_weight_cache, fp8_weight_cache == "packed"),
                                 ("fp8_dy_scale", fp8_dy_scale, fp8_dy_scale == "step")):
        if asks_fp8 and not out.fp8_gemm:
            raise ValueError(f"{key}={value!r} only changes FP8 GEMMs: add fp8_gemm=True "
                             f"(recipe_fp8_gemm), or leave {key} out")
    if fp8_step_room is not None and fp8_step_room != r.fp8_step_room and out.fp8_dy_scale != "step":
        raise ValueError(f"fp8_step_room={fp8_step_room!r} only changes dy's scale kept per step: add "
                         f"fp8_dy_scale='step' (recipe_fp8_dy_scale), or leave fp8_step_room out")
    return r if out == r else replace(out, name=r.name + "*")  # '*' marks a modified preset in logs

def check_dims(recipe, *dims):
    """Raise early, with the fix, if a layer dimension cannot be blocked under the recipe."""
    need = 1
    for g in (recipe.fprop, recipe.dgrad, recipe.wgrad):
        if g.fmt:
            need = math.lcm(need, get_format(g.fmt).block, recipe.rht_size if g.rht else 1)
    for d in dims:
        if d % need:
            raise ValueError(f"recipe {recipe.name!r} quantizes in blocks of {need} (format block "
                             f"and RHT size); dimension {d} is not a multiple: choose model widths "
                             f"that are multiples of {need}")

# -----------------------------------------------------------------------------
# 7. The quantized linear layer
#
# y = x W^T with its three GEMMs quantized per the recipe, each operand along the GEMM's
# reduction dim, gradients straight through (_forward, _backward):
#   Fprop  y  = Q(x) Q(W)^T     over in
#   Dgrad  dx = Q(dy) Q(W)      over out
#   Wgrad  dW = Q(dy)^T Q(x)    over tokens
# for a dense layer (weight [out, in]) and for MoE experts (weight [E, out, in], rows of x sorted
# by expert, counts [E] rows each: one grouped matmul per GEMM). Forward and backward are two
# custom ops glued by register_autograd: torch.compile sees each as one opaque call (register_fake
# gives the shapes), compiles the norms, attention and activations around them without graph
# breaks, and the code below (reference or Triton kernels) runs as is inside them at run time. On
# the Triton path nothing in them waits for the host (the SR seeds are drawn on the GPU and read
# there), so compile mode 'reduce-overhead' replays them inside CUDA graphs; probe_alphas() is the
# exception (Python that a replay skips).

def _qparams(gemm, recipe, sr, weight=False):
    """(format, rounding, RHT size) of one GEMM operand under the recipe."""
    fmt = get_format(gemm.fmt)
    if weight and recipe.weight_2d:
        fmt = replace(fmt, block_2d=True)
    return fmt, "sr" if sr else "rtne", recipe.rht_size if gemm.rht else None

class PerOperand(typing.NamedTuple):
    """One value per quantized operand of a layer call, in the order of its six SR seeds: Fprop's
    x and W, Dgrad's dy and W, Wgrad's dy and x. The names are probe_alphas()' operand names."""
    fprop_x: typing.Any
    fprop_w: typing.Any
    dgrad_dy: typing.Any
    dgrad_w: typing.Any
    wgrad_dy: typing.Any
    wgrad_x: typing.Any

class Operand(typing.NamedTuple):
    """How one GEMM operand is quantized: its name, its GEMM's settings, stochastic rounding or
    not, its SR seed, and whether it is the weight (2D blocks under recipe.weight_2d)."""
    name: str
    gemm: Gemm
    sr: bool
    seed: typing.Any
    weight: bool = False

def _operands(recipe, seeds):
    """The six operands of a layer call (a PerOperand of Operand) from its SR seeds (int64 [6]).
    Each GEMM's operand a (x or dy) takes the GEMM's sr_a, operand b (W, or x in Wgrad) sr_b."""
    f, d, g = recipe.fprop, recipe.dgrad, recipe.wgrad
    seed = PerOperand(*seeds)
    return PerOperand(Operand("fprop_x", f, f.sr_a, seed.fprop_x),
                      Operand("fprop_w", f, f.sr_b, seed.fprop_w, weight=True),
                      Operand("dgrad_dy", d, d.sr_a, seed.dgrad_dy),
                      Operand("dgrad_w", d, d.sr_b, seed.dgrad_w, weight=True),
                      Operand("wgrad_dy", g, g.sr_a, seed.wgrad_dy),
                      Operand("wgrad_x", g, g.sr_b, seed.wgrad_x))

def _quantize_operand(t, op, recipe, dim, dtype, tag, packed=False, fp8=None):
    """Operand t as its GEMM sees it: fake-quantized along its reduction dim `dim`, or as is.
    packed: its QTensor instead (dequantize(q, dtype) gives the same tensor, bit for bit); fp8
    (an FP8 dtype, or (dtype, given scale) as FP8_UNIT_X): to_fp8's (values, scale). Inside
    probe_alphas() it is recorded under (layer tag, op.name), an FP8 operand with its blocks out
    of the FP8 window."""
    if not op.gemm.fmt:
        return t.to(dtype)
    fmt, rounding, rht = _qparams(op.gemm, recipe, op.sr, op.weight)
    how = dict(dim=dim, rounding=rounding, rht=rht, seed=op.seed)
    if fp8:
        f8, f8_scale = _fp8_spec(fp8)
        q = to_fp8(t, fmt, fp8=f8, scale=f8_scale, **how)
    elif packed:
        q = quantize(t, fmt, **how)
    else:
        q = fake_quant(t, fmt, dtype=dtype, **how)
    if PROBE is not None:
        ref = rht_transform(t, rht, dim) if rht else t
        if fp8:
            fake = fake_quant(t, fmt, dtype=torch.float32, **how)
            _record_probe((tag, op.name), ref, fake, fp8_inexact_blocks(*q, fake, fmt, dim))
        else:
            _record_probe((tag, op.name), ref, dequantize(q, dtype) if packed else q)
    return q

def _fp8_spec(fp8):
    """An operand's FP8 request -> (dtype, given decode scale): None, a dtype (its scale from the
    amax) or a (dtype, scale) pair such as FP8_UNIT_X."""
    return tuple(fp8) if isinstance(fp8, tuple) else (fp8, None)

def _quantize_operand_pair(t, row, col, recipe, dtype, tag, packed=(False, False), fp8=None):
    """_quantize_operand(t, row) along dim -1 and _quantize_operand(t, col) along dim 0 (packed:
    per side (row, col); fp8: None, or the (row, col) FP8 requests as _quantize_operand takes them,
    None for a side not in FP8): on the Triton path from one read of t (kernels.quantize_both, the
    same bits as two calls) when both sides quantize; else two calls."""
    f8r, f8c = fp8 or (None, None)
    if row.gemm.fmt and col.gemm.fmt and PROBE is None and kernels_for(t):
        (fr, rr, hr), (fc, rc, hc) = (_qparams(o.gemm, recipe, o.sr, o.weight) for o in (row, col))
        (d_row, s_row), (d_col, s_col) = _fp8_spec(f8r), _fp8_spec(f8c)
        return quantize_both(t, fr, fc, rr, rc, hr, hc, row.seed, col.seed, tuple(packed), dtype,
                             (d_row, d_col), (s_row, s_col))
    return (_quantize_operand(t, row, recipe, -1, dtype, tag, packed=packed[0], fp8=f8r),
            _quantize_operand(t, col, recipe, 0, dtype, tag, packed=packed[1], fp8=f8c))

def _mm_fp32(a, b):
    """a @ b with an fp32 result: bf16 operands accumulate in fp32 and stay fp32 on CUDA."""
    if a.dtype == torch.bfloat16 and a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # torch without mm(out_dtype=)
            pass
    return a.float() @ b.float()

def _grouped_mm(a, b, offs, out_dtype=None):
    """Per-group matmuls in one call (torch._grouped_mm: CPU and CUDA bf16), in two forms, T
    being tokens: a [T, K] with row groups ending at offs, b [E, K, N] -> [T, N] (Fprop, Dgrad);
    a [M, T], b [T, N] with groups along T -> [E, M, N] (Wgrad). CUDA's kernel is bf16-only:
    other dtypes loop over the groups, which reads the group ends on the host (a sync: fp32
    experts on CUDA are for checks, not for speed)."""
    if not a.is_cuda:
        return torch._grouped_mm(a, b, offs=offs).to(out_dtype or a.dtype)
    if a.dtype == torch.bfloat16:  # accumulates in fp32 but (torch 2.11) writes bf16 out
        return torch._grouped_mm(a, b, offs=offs).to(out_dtype or a.dtype)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for e, (s, t) in enumerate(zip(starts, ends)):
            out[s:t] = a[s:t] @ b[e]
        return out.to(out_dtype or a.dtype)
    return torch.stack([a[:, s:t] @ b[s:t] for s, t in zip(starts, ends)]).to(out_dtype or a.dtype)

def _group_ends(counts):
    return None if counts is None else torch.cumsum(counts, 0).to(torch.int32)

def group_multiple(recipe, device):
    """The row multiple of expert groups under `recipe` on `device`: Wgrad quantizes x and dy in
    blocks (and RHT chunks) along the tokens, which must not span two experts, and CUDA's grouped
    GEMM wants 16-aligned groups. GroupedLinear pads each group to it, unless the caller laid the
    rows out so already (GroupedLinear.forward's aligned)."""
    return max(_wgrad_block_rows(recipe), 16 if device.type == "cuda" else 1)

def _wgrad_block_rows(recipe):
    g = recipe.wgrad
    return math.lcm(get_format(g.fmt).block, recipe.rht_size if g.rht else 1) if g.fmt else 1

def _wgrad_padding(recipe, n_rows, counts, device, aligned=False):
    """Wgrad quantizes x and dy in blocks along the tokens: (the multiple the rows, or each
    expert's group of rows, are padded to; the rows after padding). Experts pad each group to
    group_multiple, in a static bound (_padded_bound): no host sync; aligned groups need no
    padding."""
    if counts is None:
        multiple = _wgrad_block_rows(recipe)
        return multiple, n_rows + (-n_rows % multiple)
    multiple = group_multiple(recipe, device)
    return multiple, n_rows if aligned else _padded_bound(n_rows, counts.shape[0], multiple)

def _padded_bound(n_rows, groups, multiple):
    """A static bound on the rows n_rows rows in `groups` groups take, each group padded to
    `multiple`: n_rows + groups (multiple - 1), rounded up to a multiple (a few rows above the
    most they can take, kept because the bound sets the padded tensor's shape, and with it the
    SR counters of its column-wise blocks)."""
    return (n_rows + groups * (multiple - 1) + multiple - 1) // multiple * multiple

def group_layout(counts, multiple, n_rows):
    """Rows sorted by group (counts [E] summing to n_rows) laid out with each group followed by
    zero rows up to a multiple of `multiple`, with no host sync: (padded counts [E], the new row
    of each of the n_rows rows, the static bound on the rows the layout takes)."""
    padded = (counts + multiple - 1) // multiple * multiple
    shift = torch.cumsum(padded, 0) - padded - torch.cumsum(counts, 0) + counts  # per group
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                    output_size=n_rows)
    dest = torch.arange(n_rows, device=counts.device) + shift[group]
    return padded, dest, _padded_bound(n_rows, counts.numel(), multiple)

def _wgrad_rows(t, counts, recipe, aligned=False):
    """Wgrad's operand t [T, n] (x or dy) padded with zero rows to whole blocks: at the end
    (dense), or after each expert's group (no block spans two experts; aligned groups are so
    already). Zero rows add nothing to dW = dy^T x. Returns (padded t, padded group ends or None)."""
    multiple, length = _wgrad_padding(recipe, t.shape[0], counts, t.device, aligned)
    if counts is None:
        return (F.pad(t, (0, 0, 0, length - t.shape[0])) if length > t.shape[0] else t), None
    if aligned:
        return t, _group_ends(counts)
    padded, dest, _ = group_layout(counts, multiple, t.shape[0])
    return t.new_zeros(length, t.shape[1]).index_copy_(0, dest, t), _group_ends(padded)

def _wgrad_dtype(x, dtype):
    """Wgrad's operand dtype: bf16 on CUDA under bf16 autocast (its GEMMs take bf16 and
    accumulate in fp32), else fp32 (the CPU reference's exact products)."""
    return torch.bfloat16 if x.is_cuda and dtype == torch.bfloat16 else torch.float32

def _unpadded(t, counts, recipe, dtype, aligned=False):
    """A t [T, n] (dense, or aligned expert groups) whose Wgrad side needs no padding and no other
    dtype: one tensor serves its row-wise and column-wise quantization (_quantize_operand_pair)."""
    return ((aligned or counts is None)
            and _wgrad_padding(recipe, t.shape[0], counts, t.device, aligned)[1] == t.shape[0]
            and _wgrad_dtype(t, dtype) == dtype)

def _packs_wgrad_x(recipe, pack_x):
    """Forward saves Wgrad's x quantized (packed 4-bit codes + scales, or FP8 values under
    fp8_wgrad_x="fp8"), not x itself, when asked to and Wgrad quantizes it."""
    return bool(pack_x and recipe.wgrad.fmt)

def _uses_fp8(recipe, counts, device):
    """The GEMM path: FP8 GEMMs (torch._scaled_mm for the dense layer, fp8_grouped_mm for the
    grouped experts) when the recipe allows it, all three GEMMs quantize to power-of-two (e8m0)
    block scales and the device has FP8 GEMMs (the CPU, or a GPU of compute capability 8.9+;
    for the experts, with the Triton kernels: the reference's per-expert loop on the GPU would
    wait for the host in every call); else bf16 GEMMs on fake-quantized operands."""
    if not (recipe.fp8_gemm and fp8_capable(recipe)):
        return False
    if device.type == "cpu":
        return True
    return _has_fp8_gemm(device) and (counts is None or _kernels_on(device) is not None)

def fp8_capable(recipe):
    """Whether the recipe's operands can be exact FP8 numbers: every GEMM quantizes to
    power-of-two (e8m0) block scales, with 1D weight blocks."""
    return not recipe.weight_2d and all(
        g.fmt and get_format(g.fmt).scale == "e8m0" for g in (recipe.fprop, recipe.dgrad, recipe.wgrad))

@functools.lru_cache(maxsize=None)
def _has_fp8_gemm(device):
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)

def _fp8_mm(a, b, out_dtype, fast=False):
    """a @ b for FP8 operands (values, scale), a row-major and b column-major: the exact products
    accumulated in fp32, or with fast (the tensor cores' own accumulation, which cuBLAS does not
    promote to fp32 along the way: Recipe.fp8_fast_accum, docs/formats.md)."""
    out = torch._scaled_mm(a[0], b[0], a[1], b[1], use_fast_accum=fast,
                           out_dtype=torch.float32 if out_dtype == torch.float64 else out_dtype)
    return out.to(out_dtype)  # (fp64 inputs: CUDA's FP8 GEMM writes at most fp32)

def fp8_grouped_mm(a, b, offs, out_dtype, fast=False):
    """_grouped_mm for FP8 operands (values, fp32 tensor scale), in its two forms: a [T, K] with
    row groups ending at offs, b [E, K, N] -> [T, N]; a [M, T], b [T, N] with groups along T ->
    [E, M, N]. Each operand's reduced dim is contiguous (to_fp8's layout). The exact products of
    the operands' values summed in fp32; kernels.fp8_grouped_mm on the GPU (the MoE experts have
    no FP8 grouped GEMM in torch that pays: docs/kernels.md), where fast is the tensor cores' own
    accumulation as in _fp8_mm, else promoted to fp32 every 128 products."""
    kernels = kernels_for(a[0])
    if kernels:
        return kernels.fp8_grouped_mm(a, b, offs, out_dtype, fast)
    return _grouped_mm(a[0].float() * a[1], b[0].float() * b[1], offs, out_dtype)

def _t(q):
    """A GEMM operand (2D, or a 3D stack of experts' weights) with its last two dims swapped: a
    tensor, or FP8 (values, tensor scale)."""
    return (q[0].transpose(-1, -2), q[1]) if isinstance(q, tuple) else q.transpose(-1, -2)

def _gemm(a, b, offs, dtype, fp32=False, fast=False):
    """a @ b for the layer (dense), or per expert group where offs (the groups' end rows) is
    given: FP8 operands (values, scale) on the FP8 tensor cores (_fp8_mm, fp8_grouped_mm; fast:
    their fast accumulation), else torch's matmuls on the dequantized operands; fp32: an fp32
    result (Wgrad; CUDA's bf16 grouped GEMM rounds it to bf16 first)."""
    if isinstance(a, tuple):
        out = torch.float32 if fp32 else dtype
        return _fp8_mm(a, b, out, fast) if offs is None else fp8_grouped_mm(a, b, offs, out, fast)
    if offs is not None:
        return _grouped_mm(a, b, offs, out_dtype=torch.float32 if fp32 else None)
    return _mm_fp32(a, b) if fp32 else a @ b

def _wgrad_x_fp8(recipe, fp8):
    """Whether forward keeps Wgrad's x as FP8 (values, scale) rather than packed: on FP8 GEMMs
    with Recipe.fp8_wgrad_x 'fp8'."""
    return fp8 and recipe.fp8_wgrad_x == "fp8"

def _forward(x, weight, counts, recipe, dtype, tag, seeds, pack_x, fp8=False, wq=None, aligned=False):
    """Fprop: y = Q(x) Q(W)^T, reduction over `in`. With pack_x, also Wgrad's Q(x), quantized
    along the padded tokens now, while x is at hand, so x need not be kept: a QTensor (on FP8
    GEMMs too: backward turns it into FP8 with fp8_from_packed), or its e4m3 (values, scale)
    where _wgrad_x_fp8. fp8: x and W in e4m3 (x in e5m2 at scale 1 under fp8_x_scale "unit").
    wq: Q(W) as FP4Linear.cache_weight made it, else W is quantized here. aligned: the expert
    groups need no padding (GroupedLinear.forward)."""
    op = _operands(recipe, seeds)
    e4 = E4M3 if fp8 else None
    x8 = (FP8_UNIT_X if recipe.fp8_x_scale == "unit" else E4M3) if fp8 else None
    xw, packs = None, _packs_wgrad_x(recipe, pack_x)
    xw_fp8 = E4M3 if _wgrad_x_fp8(recipe, fp8) else None
    if packs and _unpadded(x, counts, recipe, dtype, aligned):
        xq, xw = _quantize_operand_pair(x, op.fprop_x, op.wgrad_x, recipe, dtype, tag,
                                        packed=(False, not xw_fp8), fp8=(x8, xw_fp8))
    else:
        xq = _quantize_operand(x, op.fprop_x, recipe, -1, dtype, tag, fp8=x8)
        if packs:
            xw = _quantize_operand(_wgrad_rows(x, counts, recipe, aligned)[0], op.wgrad_x, recipe, 0,
                                   _wgrad_dtype(x, dtype), tag, packed=not xw_fp8, fp8=xw_fp8)
    wq = wq if wq is not None else _quantize_operand(weight, op.fprop_w, recipe, -1, dtype, tag, fp8=e4)
    return _gemm(xq, _t(wq), _group_ends(counts), dtype, fast="fprop" in recipe.fp8_fast_accum), xw

def _backward(dy, weight, counts, x_or_q, recipe, dtype, x_dtype, tag, seeds, need_dx, need_dw,
              fp8=False, wq=None, aligned=False, dy_state=None):
    """Dgrad dx = Q(dy) Q(W), reduction over `out`; Wgrad dW = Q(dy)^T Q(x), reduction over the
    tokens, fp32 out (bf16-rounded for experts on CUDA's bf16 grouped GEMM). x_or_q: x, or
    Wgrad's Q(x) as forward saved it. On FP8 GEMMs (fp8) dy is e5m2 (gradients need its range),
    W and x e4m3. wq: Dgrad's Q(W) if cached. dy_state: the layer's step state (new_step_state)
    under Recipe.fp8_dy_scale "step", which sets dy's FP8 scale: found once per optimizer step."""
    op = _operands(recipe, seeds)
    e4, e5 = (E4M3, E5M2) if fp8 else (None, None)
    if fp8 and dy_state is not None:
        e5 = (E5M2, StepScale(dy_state, recipe.fp8_step_room))
    dy = dy.contiguous()
    dx = dw = dyq_w = None
    if need_dx and need_dw and _unpadded(dy, counts, recipe, dtype, aligned):
        dyq, dyq_w = _quantize_operand_pair(dy, op.dgrad_dy, op.wgrad_dy, recipe, dtype, tag, fp8=(e5, e5))
    elif need_dx:
        dyq = _quantize_operand(dy, op.dgrad_dy, recipe, -1, dtype, tag, fp8=e5)
    if need_dx:
        wq = wq if wq is not None else _quantize_operand(weight, op.dgrad_w, recipe, -2, dtype, tag, fp8=e4)
        dx = _gemm(dyq, wq, _group_ends(counts), dtype, fast="dgrad" in recipe.fp8_fast_accum).to(x_dtype)
    if need_dw:
        wdtype = _wgrad_dtype(dy, dtype)
        dy_pad, pad_offs = _wgrad_rows(dy, counts, recipe, aligned)
        if dyq_w is None:
            dyq_w = _quantize_operand(dy_pad, op.wgrad_dy, recipe, 0, wdtype, tag, fp8=e5)
        if isinstance(x_or_q, QTensor):
            xq = _fp8_of_packed_x(x_or_q, tag) if fp8 else dequantize(x_or_q, wdtype)
        elif isinstance(x_or_q, tuple):  # FP8 (values, scale)
            xq = x_or_q
        else:
            xq = _quantize_operand(_wgrad_rows(x_or_q, counts, recipe, aligned)[0], op.wgrad_x, recipe,
                                   0, wdtype, tag, fp8=e4)
        dw = _gemm(_t(dyq_w), xq, pad_offs, dtype, fp32=True,
                   fast="wgrad" in recipe.fp8_fast_accum).to(weight.dtype)
    return dx, dw

def _fp8_of_packed_x(q, tag):
    """Wgrad's saved packed x as its e4m3 GEMM operand; inside probe_alphas() its blocks out of
    the FP8 window are added to the wgrad_x record its forward made."""
    values, scale = fp8_from_packed(q, E4M3)
    if PROBE is not None and (tag, "wgrad_x") in PROBE:
        inexact, blocks = fp8_inexact_blocks(values, scale, dequantize(q, torch.float32), q.fmt, q.dim)
        PROBE[(tag, "wgrad_x")][3:] += torch.stack([inexact.double(), inexact.new_tensor(blocks).double()])
    return values, scale

def _seed_device(x):
    """Where a layer's SR seeds live: the GPU for the Triton kernels (they read them there), the
    CPU for the torch reference (which int()s them: free on the CPU, a host sync on the GPU)."""
    return x.device if kernels_for(x) else torch.device("cpu")

def _sr_seeds(recipe, device):
    """The six SR seeds of one layer call (int64 [6]), from torch's generator of `device`
    (_seed_device): reproducible under torch.manual_seed and saved with the RNG state in
    checkpoints. On the GPU they stay there (no host sync, so a CUDA graph replays fresh seeds)
    and take one kernel; on the CPU they are base + 0..5 from one draw. Recipes without SR draw
    nothing (zeros). Drawn inside the forward op, so no Python int reaches the compiler. Layers
    draw in the order they run: fine for a chain of layers, but two independent FP4 layers
    (parallel branches) could be reordered by the compiler and swap their seeds."""
    if not any(g.sr_a or g.sr_b for g in (recipe.fprop, recipe.dgrad, recipe.wgrad)):
        return torch.zeros(6, dtype=torch.int64, device=device)
    if device.type == "cpu":
        return torch.arange(6) + torch.randint(0, 2**31 - 8, (1,))
    return torch.randint(0, 2**31 - 8, (6,), device=device)

# Custom ops take no dataclasses: they get a recipe's repr (every field; names are not unique,
# a modified recipe keeps its preset's) and look the Recipe up here.
_RECIPES_BY_KEY = {}

def recipe_key(recipe):
    key = repr(recipe)
    _RECIPES_BY_KEY.setdefault(key, recipe)
    return key

_Tensor, _OptTensor = torch.Tensor, typing.Optional[torch.Tensor]

# tagged random: the compiler must neither merge two calls nor recompute one in backward
@torch.library.custom_op("nanofp4::linear", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _linear_op(x: _Tensor, weight: _Tensor, counts: _OptTensor, recipe: str, dtype: torch.dtype,
               tag: str, pack_x: bool, weight_q: list[_Tensor], aligned: bool,
               dy_state: list[_Tensor]) -> tuple[_Tensor, _Tensor, _Tensor, _Tensor, _Tensor]:
    """-> y, the SR seeds (int64 [6], PerOperand order; see _seed_device) and Wgrad's packed x: codes, scales,
    tensor scale (empty tensors where there is none); where _wgrad_x_fp8, its FP8 values [in, T]
    and scale in the first two. weight_q: [] or the weight's cached operands (_cached_operand).
    aligned: expert groups laid out in whole group_multiple rows (GroupedLinear.forward).
    dy_state: [] or the layer's step state, which backward reads and writes in place (never
    returned: a CUDA graph replays the writes into the module's own buffer)."""
    r = _RECIPES_BY_KEY[recipe]
    seed = _sr_seeds(r, _seed_device(x))
    none = lambda dt: x.new_empty(0, dtype=dt)  # noqa: E731
    y, q = _forward(x, weight, counts, r, dtype, tag, seed, pack_x, _uses_fp8(r, counts, x.device),
                    _cached_operand(weight_q, "fprop", r, weight), aligned)
    if q is None:
        return y, seed, none(torch.uint8), none(torch.float32), none(torch.float32)
    if isinstance(q, tuple):  # FP8 (values [T, in], scale): saved as [in, T] rows
        return y, seed, q[0].t(), q[1], none(torch.float32)
    return y, seed, q.codes, q.scales, q.tensor_scale if q.tensor_scale is not None else none(torch.float32)

@_linear_op.register_fake
def _(x, weight, counts, recipe, dtype, tag, pack_x, weight_q, aligned, dy_state):
    r = _RECIPES_BY_KEY[recipe]
    empty = lambda *shape, dt=torch.float32: x.new_empty(shape, dtype=dt)  # noqa: E731
    y = empty(x.shape[0], weight.shape[-2], dt=dtype)
    seed = torch.empty(6, dtype=torch.int64, device=_seed_device(x))
    if not _packs_wgrad_x(r, pack_x):
        return y, seed, empty(0, dt=torch.uint8), empty(0), empty(0)
    fmt = get_format(r.wgrad.fmt)
    n = _wgrad_padding(r, x.shape[0], counts, x.device, aligned)[1]
    if _wgrad_x_fp8(r, _uses_fp8(r, counts, x.device)):
        return y, seed, empty(x.shape[1], n, dt=E4M3), empty(), empty(0)
    return (y, seed, empty(x.shape[1], n // 2, dt=torch.uint8),
            empty(x.shape[1], n // fmt.block, dt=SCALE_DTYPES[fmt.scale]),
            empty() if fmt.scale == "e4m3" else empty(0))

def _saved_x(x_saved, recipe, x_dtype):
    """Wgrad's x as forward saved it: [x] -> x; [codes, scales, tensor scale] -> its QTensor;
    [FP8 values [in, T], scale, empty] -> (values [T, in], scale)."""
    if len(x_saved) == 1:
        return x_saved[0]
    if x_saved[0].dtype == E4M3:
        return x_saved[0].t(), x_saved[1]
    codes, scales, s_enc = x_saved
    fmt, _, rht = _qparams(recipe.wgrad, recipe, recipe.wgrad.sr_b)
    return QTensor(codes, scales, s_enc if s_enc.numel() else None, fmt,
                   (2 * codes.shape[1], codes.shape[0]), x_dtype, 0, rht)

@torch.library.custom_op("nanofp4::linear_backward", mutates_args=())
def _linear_backward_op(dy: _Tensor, weight: _Tensor, counts: _OptTensor, seed: _Tensor,
                        x_saved: list[_Tensor], weight_q: list[_Tensor], recipe: str,
                        dtype: torch.dtype, x_dtype: torch.dtype, tag: str, need_dx: bool,
                        need_dw: bool, aligned: bool, dy_state: list[_Tensor]) -> tuple[_Tensor, _Tensor]:
    """-> dx, dW (empty where not needed). x_saved: as _saved_x takes it. weight_q, dy_state: as
    _linear_op's."""
    r = _RECIPES_BY_KEY[recipe]
    dx, dw = _backward(dy, weight, counts, _saved_x(x_saved, r, x_dtype), r, dtype, x_dtype, tag, seed,
                       need_dx, need_dw, _uses_fp8(r, counts, dy.device),
                       _cached_operand(weight_q, "dgrad", r, weight) if need_dx else None, aligned,
                       dy_state[0] if dy_state else None)
    return (dx if dx is not None else dy.new_empty(0, dtype=x_dtype),
            dw if dw is not None else weight.new_empty(0))

@_linear_backward_op.register_fake
def _(dy, weight, counts, seed, x_saved, weight_q, recipe, dtype, x_dtype, tag, need_dx, need_dw, aligned,
      dy_state):
    return (dy.new_empty((dy.shape[0], weight.shape[-1]) if need_dx else (0,), dtype=x_dtype),
            weight.new_empty(weight.shape if need_dw else (0,)))

def _setup_context(ctx, inputs, output):
    x, weight, counts, recipe, dtype, tag, pack_x, weight_q, aligned, dy_state = inputs
    _, seed, codes, scales, s_enc = output
    packed = _packs_wgrad_x(_RECIPES_BY_KEY[recipe], pack_x)
    ctx.save_for_backward(weight, counts, seed, *weight_q, *dy_state,
                          *((codes, scales, s_enc) if packed else (x,)))
    ctx.n_weight_q, ctx.n_dy_state = len(weight_q), len(dy_state)
    ctx.mark_non_differentiable(seed, codes, scales, s_enc)
    ctx.set_materialize_grads(False)
    ctx.recipe, ctx.dtype, ctx.x_dtype, ctx.tag, ctx.aligned = recipe, dtype, x.dtype, tag, aligned

def _linear_autograd(ctx, dy, *_):
    weight, counts, seed, *rest = ctx.saved_tensors
    n_q, n_s = ctx.n_weight_q, ctx.n_dy_state
    weight_q, dy_state, x_saved = rest[:n_q], rest[n_q:n_q + n_s], rest[n_q + n_s:]
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = _linear_backward_op(dy, weight, counts, seed, x_saved, weight_q, ctx.recipe,
                                 ctx.dtype, ctx.x_dtype, ctx.tag, need_dx, need_dw, ctx.aligned,
                                 dy_state)
    return (dx if need_dx else None, dw if need_dw else None, None, None, None, None, None,
            [None] * n_q, None, [None] * n_s)

_linear_op.register_autograd(_linear_autograd, setup_context=_setup_context)

def compute_dtype(x):
    """The dtype of the layer's GEMMs and output: autocast's, else x's, as nn.Linear keeps its
    input's (a bf16 model without autocast computes as one under bf16 autocast)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype if x.is_floating_point() and x.dtype.itemsize >= 2 else torch.float32

def _cached_operand(weight_q, gemm, recipe, weight):
    """Fprop's (gemm "fprop") or Dgrad's ("dgrad") Q(W) as FP8 (values, scale) from the cache
    [Fprop's values, scale, Dgrad's values, scale]: FP8 as kept, or packed codes and block scales
    (Recipe.fp8_weight_cache "packed", followed by Fprop's and Dgrad's largest block scales) made
    FP8 here, for this call. None when there is no cache, or inside probe_alphas(), which records
    the weight's operands as it quantizes them."""
    if not weight_q or PROBE is not None:
        return None
    i = 0 if gemm == "fprop" else 2
    values, scale = weight_q[i], weight_q[i + 1]
    if values.dtype != torch.uint8:
        return values, scale
    fmt, _, rht = _qparams(getattr(recipe, gemm), recipe, False, weight=True)
    dim = weight.dim() - (1 if gemm == "fprop" else 2)
    q = QTensor(values, scale, None, fmt, tuple(weight.shape), weight.dtype, dim, rht)
    return fp8_from_packed(q, E4M3, top=weight_q[4 + i // 2])

def _check_shapes(x, weight, counts):
    """x [T, in] against weight [out, in], or [E, out, in] with counts [E] (the experts)."""
    want = 2 if counts is None else 3
    if x.dim() != 2 or weight.dim() != want or x.shape[1] != weight.shape[-1]:
        layout = "weight [out, in]" if counts is None else "weight [E, out, in] with counts [E]"
        raise ValueError(f"a quantized linear takes x [T, in] and {layout}; got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}"
                         + (": reshape x to 2D" if x.dim() != 2 else ""))

def _apply(x, weight, counts, key, tag, pack_x=True, weight_q=(), aligned=False, dy_state=None):
    if counts is not None:
        counts = _group_counts(x, weight, counts, _RECIPES_BY_KEY[key], aligned)
    _check_shapes(x, weight, counts)
    dtype = compute_dtype(x)
    if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
        # as autocast's F.linear: x in the autocast dtype (a LayerNorm's fp32 output, cast where
        # it is made by the compiler's fused kernel; dx comes back in that dtype, cast back there)
        x = x.to(dtype)
    pack_x = pack_x and torch.is_grad_enabled() and weight.requires_grad  # eval: no Wgrad
    with torch.autocast(x.device.type, enabled=False):
        return _linear_op(x, weight, counts, key, dtype, tag, pack_x, list(weight_q), aligned,
                          [] if dy_state is None else [dy_state])[0]

def fp4_linear(x, weight, recipe, counts=None, tag=""):
    """x [T, in] @ weight[out, in]^T with the three GEMMs quantized per `recipe` (a Recipe or a
    preset name); with counts [E], weight [E, out, in] and x's rows sorted by group (MoE
    experts). tag: the layer's name in probe_alphas() records."""
    return _apply(x, weight, counts, recipe_key(make_recipe(recipe)), tag)

def _group_counts(x, weight, counts, recipe, aligned=False):
    """counts (a tensor or list: the rows of each group, x sorted by group) as a long tensor on
    x's device, checked against weight [E, out, in] and x where that costs no host sync (counts on
    the host, eager: checked before they move): others give wrong gradients or a device-side
    assert. aligned: as GroupedLinear.forward's."""
    on_device = isinstance(counts, torch.Tensor) and counts.device.type != "cpu"
    counts = torch.as_tensor(counts, device=counts.device if on_device else "cpu")
    if counts.is_floating_point() or counts.is_complex():
        raise TypeError(f"counts must be integers, got {counts.dtype}")
    counts = counts.long()
    groups = weight.shape[0] if weight.dim() == 3 else None
    if counts.dim() != 1 or counts.shape[0] != groups:
        raise ValueError(f"counts must hold one row count per group of weight [E, out, in] "
                         f"(weight {tuple(weight.shape)}), got shape {tuple(counts.shape)}")
    if counts.device.type == "cpu" and not torch.compiler.is_compiling():
        if int(counts.sum()) != x.shape[0] or bool((counts < 0).any()):
            raise ValueError(f"counts {counts.tolist()} must be non-negative and sum to the rows "
                             f"of x ({x.shape[0]}): x holds each group's rows, sorted by group")
        m = group_multiple(recipe, x.device)
        if aligned and bool((counts % m).any()):
            raise ValueError(f"aligned=True needs counts that are multiples of {m} (zero rows "
                             f"after each group's real ones), got {counts.tolist()}; or pass "
                             f"aligned=False and the layer pads")
    return counts.to(x.device)

class _Quantized:
    """The `recipe` attribute of the quantized modules, kept with the string key the ops take
    (the ops never see the dataclass)."""

    @property
    def recipe(self):
        return self._recipe

    @recipe.setter
    def recipe(self, recipe):
        self._recipe = make_recipe(recipe)
        self._recipe_key = recipe_key(self._recipe)

    def reset_dy_state(self):
        """Under the recipe's fp8_dy_scale "step" on FP8 GEMMs: the next backward finds dy's FP8
        scale afresh and the calls after it keep it (the dy_state buffer, made here; cache_weights
        calls this after every optimizer step). Else dy_state is None: a pass over dy in every call."""
        counts = torch.ones(1) if self.weight.dim() == 3 else None  # (_uses_fp8 asks: groups?)
        if not (self.recipe.fp8_dy_scale == "step" and _uses_fp8(self.recipe, counts, self.weight.device)):
            self.dy_state = None
        elif self.dy_state is None or self.dy_state.device != self.weight.device:
            self.dy_state = new_step_state(self.weight.device)
        else:
            reset_step_state(self.dy_state)  # in place: a CUDA graph that read it reads this one

class FP4Linear(_Quantized, nn.Linear):
    """Drop-in nn.Linear whose three GEMMs are quantized per `recipe` (bf16: exactly nn.Linear)."""

    def __init__(self, in_features, out_features, bias=True, recipe="bf16", device=None, dtype=None,
                 pack_x=True):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        check_dims(self.recipe, in_features, out_features)
        self.tag = ""  # the layer's name in probe_alphas() records (convert sets it)
        # Wgrad's x saved quantized (True: packed 4-bit codes + scales, or FP8 values under the
        # recipe's fp8_wgrad_x="fp8"), or x itself (False): for a layer whose
        # input another op saves anyway (attention's output, which SDPA keeps for its backward),
        # where a packed copy would add memory instead of saving it
        self.pack_x = pack_x
        # the weight's operands for Fprop and Dgrad (FP8 values and scale each, or packed codes
        # and block scales under the recipe's fp8_weight_cache "packed", with each one's largest
        # block scale: no pass over the scales per call), kept between optimizer steps when
        # cache_weight() fills them; None: quantized in every call
        for name in self.CACHE + self.CACHE_TOPS + ("dy_state",):
            self.register_buffer(name, None, persistent=False)
        self._cached_for = None  # _cache_key() of the cached operands

    CACHE = ("weight_fprop", "weight_fprop_scale", "weight_dgrad", "weight_dgrad_scale")
    CACHE_TOPS = ("weight_fprop_top", "weight_dgrad_top")  # packed only

    def cache_weight(self):
        """Quantizes the weight for Fprop and Dgrad now and keeps both operands for every call
        until the next cache_weight(): as FP8 (1 byte per weight element each, from one read), or
        packed under the recipe's fp8_weight_cache "packed" (about half a byte; each call makes its
        FP8 operand from them). Call it after each change to the weight (cache_weights). Only
        layers on FP8 GEMMs whose weight rounds to nearest (the same bits in every call) cache;
        returns whether this one does."""
        r = self.recipe
        weight_rtne = not (r.fprop.sr_b or r.dgrad.sr_b)
        if not (_uses_fp8(r, None, self.weight.device) and weight_rtne):
            for name in self.CACHE + self.CACHE_TOPS:
                setattr(self, name, None)
            return False
        packed = r.fp8_weight_cache == "packed"
        op = _operands(r, torch.zeros(6, dtype=torch.int64))
        with torch.no_grad():  # both orientations from one read
            qf, qd = _quantize_operand_pair(self.weight.detach(), op.fprop_w, op.dgrad_w, r, torch.float32,
                                            self.tag, packed=(packed, packed),
                                            fp8=None if packed else (E4M3, E4M3))
            kept = (qf.codes, qf.scales, qd.codes, qd.scales) if packed else (*qf, *qd)
            tops = (largest_block_scale(qf), largest_block_scale(qd)) if packed else (None, None)
        for name, t in zip(self.CACHE + self.CACHE_TOPS, kept + tops):
            old = getattr(self, name)
            if (t is not None and old is not None and old.dtype == t.dtype and old.shape == t.shape
                    and old.stride() == t.stride()):
                old.copy_(t)  # in place: a CUDA graph that read the old one reads this one
            else:
                setattr(self, name, t)
        self._cached_for = self._cache_key()
        return True

    def _cache_key(self):
        """What the cached operands depend on: the recipe, and the weight tensor, its storage and
        its version (bumped by every in-place change; a new tensor, e.g. from
        load_state_dict(assign=True), has another identity, and weight.data = t another storage).
        Writes into weight.data in place bump no version: no key can see them."""
        return self._recipe_key, id(self.weight), self.weight.data_ptr(), self.weight._version

    def _weight_q(self):
        """The cached FP8 operands for _apply ([] when none); in eager mode, an error if the
        weight changed after they were made."""
        if self.weight_fprop is None:
            return []
        if not torch.compiler.is_compiling() and self._cache_key() != self._cached_for:
            raise RuntimeError(f"{self.tag or 'FP4Linear'}: the weight or recipe changed after "
                               f"cache_weight(); call fp4.cache_weights(model) after every change")
        kept = [getattr(self, name) for name in self.CACHE + self.CACHE_TOPS]
        return [t for t in kept if t is not None]

    def forward(self, x):
        if not self.recipe.quantized:
            return F.linear(x, self.weight, self.bias)
        y = _apply(x.reshape(-1, x.shape[-1]), self.weight, None, self._recipe_key, self.tag,
                   self.pack_x, self._weight_q(), dy_state=self.dy_state)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self):
        return super().extra_repr() + f", recipe={self.recipe.name}" + ("" if self.pack_x else
                                                                        ", pack_x=False")

class GroupedLinear(_Quantized, nn.Module):
    """num_groups independent linears (no bias) applied to row groups: the MoE experts.
    forward(x [N, in] sorted by group, counts [num_groups] (tensor or list) summing to N) -> [N, out].
    With aligned=True each count is a multiple of group_multiple(x.device) (rows past a group's
    real ones are zero): the layer then pads nothing (no copy of x and dy per call). Counts on
    the GPU are not checked (that would wait for the host): others give wrong gradients."""

    def __init__(self, num_groups, in_features, out_features, recipe="bf16", device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features,
                                               device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)
        self.recipe = recipe
        check_dims(self.recipe, in_features, out_features)
        self.tag = ""
        self.register_buffer("dy_state", None, persistent=False)  # reset_dy_state

    def group_multiple(self, device):
        """The row multiple of each group for aligned=True (fp4.group_multiple of the recipe)."""
        return group_multiple(self.recipe, device)

    def forward(self, x, counts, aligned=False):
        return _apply(x, self.weight, counts, self._recipe_key, self.tag, aligned=aligned,
                      dy_state=self.dy_state)

    def extra_repr(self):
        g, o, i = self.weight.shape
        return f"groups={g}, in_features={i}, out_features={o}, recipe={self.recipe.name}"

def reset_dy_scales(model):
    """Each quantized layer's next backward finds dy's step scale afresh (_Quantized.reset_dy_state:
    Recipe.fp8_dy_scale "step"). cache_weights calls it after every weight change; train.py also
    between micro-steps in warm-up, where a layer's dy rose past the room within one step."""
    for m in model.modules():
        if isinstance(m, _Quantized):
            m.reset_dy_state()

def cache_weights(model):
    """Quantizes each FP4Linear's weight once for the calls until it changes, where the layer
    can keep it (FP4Linear.cache_weight: FP8 GEMMs, round-to-nearest weights): micro-steps of
    one optimizer step then skip the weight's quantize passes. Call it after every change to
    the weights (train.py: at the start and after each optimizer step). An eager call after a
    change without it is an error; compiled code cannot check, and would use the stale copy, as
    does an eager call after an in-place write through weight.data, which torch does not count.
    Also resets each quantized layer's dy scale (reset_dy_scales). Returns the number of layers
    that cache."""
    reset_dy_scales(model)
    return sum(m.cache_weight() for m in model.modules() if isinstance(m, FP4Linear))

class WeightCache:
    """cache_weights for a training loop: refresh() after every change to the weights (train.py:
    at the start and after each optimizer step). With graph=True on CUDA the first refresh runs
    eagerly and later ones replay it as one CUDA graph: eager, each layer's quantize calls cost
    host time while the GPU waits for the next step (docs/performance.md). The graph reads each
    weight where it lay: a weight replaced by another tensor, or a changed recipe, captures
    afresh."""

    def __init__(self, model, graph=False):
        self.model, self.use_graph = model, graph
        self.graph, self.key, self.layers = None, None, []

    def _linears(self):
        return [m for m in self.model.modules() if isinstance(m, FP4Linear)]

    def _key(self):  # what the captured graph depends on: each weight's recipe and address
        return [(m._recipe_key, m.weight.data_ptr()) for m in self._linears()]

    def refresh(self):
        """Quantizes the weights for the calls until the next refresh; returns the number of
        layers that cache."""
        if self.graph is not None and self._key() == self.key:
            self.graph.replay()
            for m in self.layers:  # what the eager check compares: these operands are current
                m._cached_for = m._cache_key()
            return len(self.layers)
        self.graph = None
        n = cache_weights(self.model)
        self.layers = [m for m in self._linears() if m.weight_fprop is not None]
        if n and self.use_graph and self.layers[0].weight.is_cuda:
            self.graph, self.key = torch.cuda.CUDAGraph(), self._key()
            with torch.cuda.graph(self.graph):  # records the in-place copies into the cache
                cache_weights(self.model)
        return n

def convert(model, recipe, blocks_attr="blocks", keep=None, keep_x=None):
    """Swap the linears of model.<blocks_attr>[i] for FP4Linear (and set the recipe of their
    GroupedLinears), except blocks the recipe keeps in bf16 and the modules named in `keep` with
    all they hold (an entry matches a name's last dotted parts: "router", "attn.qkv"). Linears
    named in `keep_x` (matched as in `keep`) save their input x for Wgrad rather than packed codes (FP4Linear.pack_x):
    for a layer whose input another op saves for backward anyway, where a packed copy would add
    memory. Both default to the model's own `fp4_keep` and `fp4_keep_x` (model.GPT names its
    router, and its attention output projection, whose input is a view of SDPA's saved output on
    the GPU), else none. Parameters are shared, not copied. Returns the model."""
    recipe = make_recipe(recipe)
    blocks = getattr(model, blocks_attr)
    keep = getattr(model, "fp4_keep", ()) if keep is None else _module_names(blocks, keep, "keep")
    keep_x = (getattr(model, "fp4_keep_x", ()) if keep_x is None
              else _module_names(blocks, keep_x, "keep_x"))
    bf16 = recipe.bf16_blocks(len(blocks))
    for i, block in enumerate(blocks):
        r = RECIPES["bf16"] if i in bf16 else recipe
        for name, mod in list(block.named_modules()):
            if not name or _kept(name, keep):
                continue
            if isinstance(mod, (GroupedLinear, FP4Linear)):  # already converted: just re-recipe
                check_dims(r, mod.in_features, mod.out_features)
                mod.recipe, mod.tag = r, f"{blocks_attr}.{i}.{name}"
                if isinstance(mod, FP4Linear):
                    mod.pack_x = not _kept(name, keep_x)
            elif isinstance(mod, nn.Linear):
                check_dims(r, mod.in_features, mod.out_features)
                new = FP4Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                recipe=r, device="meta", pack_x=not _kept(name, keep_x))
                new.weight, new.tag = mod.weight, f"{blocks_attr}.{i}.{name}"
                if mod.bias is not None:
                    new.bias = mod.bias
                parent = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
                setattr(parent, name.split(".")[-1], new)
    return model

def _module_names(blocks, names, key):
    """convert's keep or keep_x given by the caller: a name or a list of names, each matching a
    module in some block (a misspelt name would quietly quantize what it meant to keep)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    found = {n for block in blocks for n, _ in block.named_modules() if n}
    missing = [k for k in names if not isinstance(k, str) or not any(_kept(n, (k,)) for n in found)]
    if missing:
        raise ValueError(f"convert({key}=...): {missing} match no module of the blocks; names are "
                         f"dotted paths within a block or their last parts, e.g. {sorted(found)[:6]}")
    return names

def _kept(name, keep):
    """Whether the module `name` (dotted, within a block) or a module holding it is in `keep`."""
    parts = name.split(".")
    paths = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(p == k or p.endswith("." + k) for p in paths for k in keep)

def saved_bytes(layer, x, dy=None):
    """Bytes a forward of `layer` on x keeps for backward, its parameters left out; then runs the
    backward (with dy, or ones), so what was kept is shown to suffice. Call it under autocast to
    measure the autocast forward."""
    params = {p.data_ptr() for p in layer.parameters()}
    sizes = []

    def pack(t):
        if t.data_ptr() not in params:
            sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    y.backward(torch.ones_like(y) if dy is None else dy)
    return sum(sizes)

# -----------------------------------------------------------------------------
# 8. Shrinkage diagnostics

def attenuation(x, xq):
    """alpha = <Q(A), A> / ||A||^2: how much of the coherent signal survives quantization."""
    x, xq = x.double(), xq.double()
    return ((xq * x).sum() / (x * x).sum()).item()

def sqnr_db(x, xq):
    x, xq = x.double(), xq.double()
    return (10 * torch.log10((x * x).sum() / ((xq - x) ** 2).sum())).item()

PROBE = None  # the dict of an open probe_alphas() block, else None

@contextlib.contextmanager
def probe_alphas():
    """Live shrinkage telemetry. Inside the block, every quantized GEMM operand adds its terms to
    the yielded dict {(layer tag, operand): [<Q(A),A>, ||A||^2, ||Q(A)-A||^2]} (device tensors,
    summed over calls, with the FP8 path's count of blocks out of its window and of blocks); A is
    in the RHT basis when the GEMM uses one. Operands: fprop_x, fprop_w,
    dgrad_dy, dgrad_w, wgrad_dy, wgrad_x. No RNG is drawn, so probing leaves training unchanged."""
    global PROBE
    outer, PROBE = PROBE, {}
    try:
        yield PROBE
    finally:
        PROBE = outer

def _record_probe(key, ref, q, fp8_blocks=None):
    """Adds [<Q(A),A>, ||A||^2, ||Q(A)-A||^2, FP8 blocks out of window, FP8 blocks] to PROBE[key]
    (the last two 0 for an operand not on the FP8 path)."""
    ref, q = ref.detach().float(), q.detach().float()
    inexact, blocks = fp8_blocks if fp8_blocks is not None else (q.new_zeros(()), 0)
    terms = torch.stack([(q * ref).sum(), (ref * ref).sum(), ((q - ref) ** 2).sum(),
                         inexact.float(), q.new_full((), float(blocks))]).double()
    if key in PROBE:
        PROBE[key] += terms
    else:
        PROBE[key] = terms

def probe_summary(probe):
    """{operand: {layer tag: (alpha, SQNR dB, fraction of blocks out of the FP8 window or None
    off the FP8 path)}} from a probe_alphas() dict (one host sync)."""
    if not probe:
        return {}
    keys = list(probe)
    vals = torch.stack([probe[k] for k in keys]).cpu().tolist()
    out = {}
    for (tag, operand), (qa, aa, err, inexact, blocks) in zip(keys, vals):
        alpha = qa / aa if aa > 0 else float("nan")
        sqnr = 10 * math.log10(aa / err) if err > 0 and aa > 0 else float("inf")
        out.setdefault(operand, {})[tag] = (alpha, sqnr, inexact / blocks if blocks else None)
    return out

def bucket_use(q):
    """B_eff = exp(entropy of the 16-code histogram) / 16 of a QTensor: how evenly codes are used."""
    hist = torch.bincount(unpack_codes(q.codes).flatten().long(), minlength=16).double()
    p = hist[hist > 0] / hist.sum()
    return (torch.exp(-(p * p.log()).sum()) / 16).item()

def bin_bias(grid):
    """Analytic per-level conditional bias of RTNE under a locally uniform density:
    (2 q_i - q_{i-1} - q_{i+1}) / 4 for interior levels (negative = toward zero)."""
    q = GRIDS[grid].levels if isinstance(grid, str) else grid.levels
    return {q[i]: (2 * q[i] - q[i - 1] - q[i + 1]) / 4 for i in range(1, len(q) - 1)}

def shrinkage_report(x, fmt, dim=-1, rht=None):
    """alpha, SQNR and B_eff of one tensor under one format (in the RHT basis when rht is set)."""
    ref = rht_transform(x, rht, dim) if rht else x.float()
    q = quantize(x, fmt, dim=dim, rht=rht)
    xq = dequantize(q, torch.float32)
    return dict(alpha=attenuation(ref, xq), sqnr_db=sqnr_db(ref, xq), b_eff=bucket_use(q))

if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="print the shrinkage tables of every format")
    p.add_argument("--rows", type=int, default=1024, help="rows of 4096 synthetic values")
    rows = p.parse_args().rows
    print("per-level RTNE bias (locally uniform density), in grid units:")
    for g in GRIDS:
        print(f"  {g:5s} " + "  ".join(f"{q:g}:{b:+.3f}" for q, b in bin_bias(g).items()))
    torch.manual_seed(0)
    data = {"gaussian": torch.randn(rows, 4096),
            "student-t(3)": torch.distributions.StudentT(3.0).sample((rows, 4096))}
    print(f"\n{'data':14s} {'format':7s} {'rht':>4s} {'alpha':>8s} {'SQNR dB':>8s} {'B_eff':>6s}")
    for dname, x in data.items():
        for fname in FORMATS:
            for rht in (None, 16):
                r = shrinkage_report(x, fname, rht=rht)
                print(f"{dname:14s} {fname:7s} {str(rht or '-'):>4s} {r['alpha']:8.4f} "
                      f"{r['sqnr_db']:8.2f} {r['b_eff']:6.3f}")
