"""
kernels.py: Triton versions of fp4.py's quantizers, its dequantizer, and a GEMM over packed 4-bit
operands. Same signatures and meaning as fp4.py; with RTNE the same bits (codes, scales,
dequantized values); stochastic rounding draws its own random numbers (same distribution).
fp4.py calls them through its one dispatch point, fp4.kernels_for(x) (CUDA tensors, triton
available, backend not 'torch'); this file imports fp4.py, which imports it back only lazily
(fp4._import_kernels), at its first use.

  quantize(x, fmt, dim, rounding, rht, seed)           -> fp4.QTensor (packed codes + scales)
  fake_quant(x, fmt, dim, rounding, rht, seed, dtype)  -> dequantize(quantize(x)) in one pass
  to_fp8(x, fmt, dim, rounding, rht, seed, fp8, scale) -> (FP8 values, power-of-two tensor scale)
                                                          for formats with e8m0 block scales
  quantize_both(x, fmt, ...)                           -> a 2D tensor's row-wise and column-wise
                                                          results from one read of it
  dequantize(q, dtype)                                 -> tensor in the original layout
  fp8_from_packed(q, fp8, top)                         -> a packed operand with e8m0 scales as
                                                          (FP8 values, power-of-two tensor scale)
  fp4_matmul(qa, qb, dtype)                            -> a @ b^T from packed operands
  fp8_grouped_mm(a, b, offs, out_dtype, fast)          -> per-expert products of FP8 operands
  set_sr_bits(bits), philox_rounds(n)                  -> SR's random bits per draw (8 or 16);
                                                          Philox rounds (a context, benchmarks)

What runs where. On Hopper (the H200) training runs its GEMMs on fake-quantized bf16 operands
through cuBLAS: each operand is quantized and dequantized in one fused kernel (fake_quant,
quantize_both), then torch.mm / torch._grouped_mm multiply; Wgrad's x is kept packed between
forward and backward (quantize, then dequantize). Formats with power-of-two block scales write
exact FP8 instead (to_fp8, quantize_both(fp8=...)) for torch._scaled_mm; Wgrad's x stays packed
there too and becomes FP8 in backward (fp8_from_packed); the MoE experts' three GEMMs run on
fp8_grouped_mm (torch's grouped FP8 GEMM runs slower than its bf16 one at their shapes).
fp4_matmul, the packed GEMM that dequantizes in its main loop, is not on the training path:
Hopper has no FP4 tensor cores, so the dequantize competes with the bf16 MMA for the same SMs
and the GEMM reaches about 0.5x cuBLAS. It would pay on hardware with native block-scaled FP4
MMA (which takes codes and scales as they are), or where a GEMM is memory-bound (small batches:
4-bit operands move a quarter of bf16's bytes).
docs/kernels.md has the measurements.

Sections: 1. device helpers, 2. host helpers, 3. quantize, 4. dequantize, 5. the packed GEMM,
6. the grouped FP8 GEMM.
How a tile is quantized (_quant_tile, one per program): load [R, C] -> optional RHT butterfly in
the reference's add order -> block amax (NaN/Inf flagged: Triton's max may drop NaN) -> block
scale (fp32 / e4m3 by explicit bit rounding / e8m0 from the exponent bits) -> x / scale (exact
for RTNE, a product for SR) -> round to the grid (RTNE by float arithmetic, SR as floor(k + u)
with SR_BITS Philox bits per element) -> code and dequantized value. NVFP4's tensor amax comes
from a first pass (_amax_kernel), an FP8 side's plain amax from a flat one (_flat_amax_kernel):
no host sync. The kernels are bound by instruction issue, so
no kernel converts int <-> float or rounds to an integer per element (those run at 1/8 of the
fp32 rate): bit tricks instead (_small_f32, _small_int, _grid_mag, _floor_m1). On the GPU the GEMM
dequantizes with a few lines of PTX (_dequant_operand). fp32 -> bf16 (and fp8_from_packed's
fp32 -> FP8) casts happen in the kernel on the GPU (hardware RNE); under TRITON_INTERPRET the
kernel writes fp32 and torch casts (the interpreter truncates). So do bf16 block scales, which
the interpreter's casts would flush to 0 where subnormal (e8m0's 2^-127): it writes and reads
them as fp32.

AVAILABLE is True when triton imports and a CUDA device exists. Under TRITON_INTERPRET=1 the
same functions run on CPU tensors (what the tests run).
"""
import contextlib
import functools
import math
import os
import threading

import torch

import fp4

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice
    from triton.tools.tensor_descriptor import TensorDescriptor
    HAVE_TRITON = True
except ImportError:  # the module still imports: fp4.py falls back to its torch reference
    HAVE_TRITON = False

    class _Shim:
        constexpr = None

        def jit(self, fn=None, **kw):
            return fn if fn is not None else (lambda f: f)
    triton = tl = libdevice = _Shim()

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
AVAILABLE = HAVE_TRITON and torch.cuda.is_available()

PHILOX_ROUNDS = 10  # Philox4x32 rounds per call: Random123's default (docs/kernels.md on SR)
# Random bits per SR draw: 8 (16 draws per Philox call) or 16 (8 per call). With b bits an element
# k + f rounds up with probability round(2^b f) / 2^b: |bias| <= 2^-(b+1) of a grid step, and
# f < 2^-(b+1) never rounds up (2^-9 of a step at 8 bits). 8 is the design point (within about
# 20 % of RTNE); Blackwell's cvt.rs also takes 8 per FP4 value. Set with set_sr_bits (or
# fp4.set_sr_bits); the kernels read it at launch.
SR_BITS = 8


def set_sr_bits(bits):
    """Random bits per stochastic-rounding draw: 8 or 16."""
    global SR_BITS
    if bits not in fp4.SR_BITS_CHOICES:
        raise ValueError(f"sr_bits must be one of {fp4.SR_BITS_CHOICES}, got {bits!r}")
    SR_BITS = bits


@contextlib.contextmanager
def philox_rounds(rounds):
    """Inside the block, SR draws use Philox4x32 with `rounds` rounds (benchmarks)."""
    global PHILOX_ROUNDS
    outer, PHILOX_ROUNDS = PHILOX_ROUNDS, int(rounds)
    try:
        yield
    finally:
        PHILOX_ROUNDS = outer


# -----------------------------------------------------------------------------
# 1. Device helpers: bit tricks in place of slow conversions, the RHT butterfly, random bits

@triton.jit
def _bfly(y, T: tl.constexpr, H: tl.constexpr):
    """One butterfly stage on T elements: in each group of 2H, (a, b) at distance H -> (a+b, a-b)
    (fp4.rht_transform's stack((a + b, a - b)) in the same order)."""
    if H == 1:
        a, b = tl.split(tl.reshape(y, [T // 2, 2]))
        return tl.reshape(tl.join(a + b, a - b), [T // 2, 2])
    else:
        y3 = tl.permute(tl.reshape(y, [T // (2 * H), 2, H]), (0, 2, 1))
        a, b = tl.split(y3)
        return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [T // (2 * H), 2 * H])


@triton.jit
def _rht(x, signs_ptr, R: tl.constexpr, C: tl.constexpr, N: tl.constexpr, INV: tl.constexpr,
         SMASK: tl.constexpr):
    """x [R, C] fp32 -> x times the RHT matrix (fp4.rht_matrix) on N-chunks along axis 1: signs,
    Walsh-Hadamard butterfly, * 1/sqrt(N).
    SMASK >= 0: the signs as bits of a constant (bit j set: s_j = -1), which the compiler folds
    into the first adds where a thread holds whole chunks; else loaded from signs_ptr."""
    T: tl.constexpr = R * C
    if SMASK >= 0:
        s = 1.0 - 2.0 * ((tl.full([N], SMASK, tl.int64) >> tl.arange(0, N).to(tl.int64)) & 1).to(tl.float32)
    else:
        s = tl.load(signs_ptr + tl.arange(0, N))
    y = tl.reshape(x, [T // N, N]) * s[None, :]
    y = _bfly(y, T, 1)
    y = _bfly(y, T, 2)
    y = _bfly(y, T, 4)
    y = _bfly(y, T, 8)
    if N > 16:
        y = _bfly(y, T, 16)
    if N > 32:
        y = _bfly(y, T, 32)
    if N > 64:
        y = _bfly(y, T, 64)
    return tl.reshape(y, [R, C]) * INV


@triton.jit
def _rtne_int(k):
    """k >= 0 (fp32, < 2^31) -> nearest integer, ties to even, as int32 (exact, no libdevice)."""
    i = k.to(tl.int32)  # truncation = floor for k >= 0
    f = k - i.to(tl.float32)
    up = (f > 0.5) | ((f == 0.5) & ((i & 1) == 1))
    return i + up.to(tl.int32)


@triton.jit
def _round_e4m3(s):
    """0 <= s <= 448 (or NaN) fp32 -> nearest e4m3 value (ties to even), as fp32. Explicit bits:
    the interpreter's fp8 cast rounds ties away from zero."""
    bits = s.to(tl.int32, bitcast=True)
    nb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits (0xFFF00000)
    normal = nb.to(tl.float32, bitcast=True)
    sub = _rtne_int(s * 512.0).to(tl.float32) * 0.001953125  # subnormals: multiples of 2^-9
    r = tl.where(s >= 0.015625, normal, sub)
    return tl.where(s != s, s, r)


@triton.jit
def _small_f32(i):
    """int32 0 <= i < 2^23 -> fp32, exactly: 2^23 + i by its bits, minus 2^23. Two full-rate
    instructions where a conversion (I2FP) runs at an eighth of the rate on the H200."""
    return (i | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _small_int(v):
    """fp32 holding an integer 0 <= v < 2^23 -> int32, exactly: the inverse of _small_f32 (the
    low bits of 2^23 + v), with no float -> int conversion (F2I: an eighth of the fp32 rate)."""
    return (v + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000


@triton.jit
def _grid_mag(idx, E2M1: tl.constexpr, NSEG: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
              ST0: tl.constexpr, ST1: tl.constexpr, ST2: tl.constexpr, I1: tl.constexpr,
              I2: tl.constexpr):
    """grid index 0..7 (int32) -> magnitude (fp32), from the grid's uniform pieces, with no
    int -> float conversion. E2M1's from the index's own bits: e e m placed as an fp32's lowest
    exponent bits and top mantissa bit are E2M1(idx) * 2^-126 (index 1 a subnormal), so one
    shift and one multiply by 2^126."""
    if E2M1:
        return (idx << 22).to(tl.float32, bitcast=True) * 8.507059173023462e37
    m = _small_f32(idx) * ST0
    if NSEG > 1:
        m = tl.where(idx >= I1, S1 + _small_f32(idx - I1) * ST1, m)
    if NSEG > 2:
        m = tl.where(idx >= I2, S2 + _small_f32(idx - I2) * ST2, m)
    return m


@triton.jit
def _random_bits(seed, roff, R: tl.constexpr, C: tl.constexpr, ROUNDS: tl.constexpr, BITS: tl.constexpr,
                 TOP: tl.constexpr):
    """r + 0.5 in units of 2^(TOP - BITS) (int32) per element of an [R, C] tile: r BITS random bits
    (8 or 16) at bits TOP - BITS .. TOP - 1, and the half at the bit below, from one Philox call per
    128 / BITS elements; roff [R, C * BITS / 128] int32 are the element-group counters (distinct
    across the tensor)."""
    tl.static_assert(BITS == 8 or BITS == 16)
    r0, r1, r2, r3 = tl.randint4x(seed, roff, ROUNDS)
    HALF: tl.constexpr = 1 << (TOP - BITS - 1)
    if BITS == 8:
        M8: tl.constexpr = 255 << (TOP - 8)
        w = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [R, C // 16, 4])
        u = tl.join(tl.join(((w << (TOP - 8)) & M8) | HALF, ((w << (TOP - 16)) & M8) | HALF),
                    tl.join(((w >> (24 - TOP)) & M8) | HALF, ((w >> (32 - TOP)) & M8) | HALF))
    else:
        M16: tl.constexpr = 65535 << (TOP - 16)
        u = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [R, C // 8, 4])
        u = tl.join(((u << (TOP - 16)) & M16) | HALF, ((u >> (32 - TOP)) & M16) | HALF)
    return tl.reshape(u, [R, C]).to(tl.int32, bitcast=True)


@triton.jit
def _uniform(seed, roff, R: tl.constexpr, C: tl.constexpr, ROUNDS: tl.constexpr, BITS: tl.constexpr):
    """1 + (r + 0.5) / 2^BITS (fp32) per element of an [R, C] tile: _random_bits placed in the
    mantissa of 1 (no int -> float conversion)."""
    return (_random_bits(seed, roff, R, C, ROUNDS, BITS, 23) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _maxnan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


_INTERP = tl.constexpr(INTERPRET) if HAVE_TRITON else INTERPRET


@triton.jit
def _amax(v, axis: tl.constexpr):
    """max along axis, NaN if any element is NaN (like torch.amax). The interpreter runs custom
    reductions element by element, so there: max + a NaN flag (same result)."""
    if _INTERP:
        m = tl.max(v, axis=axis)
        return tl.where(tl.max(tl.where(v != v, 1, 0), axis=axis) > 0, float("nan"), m)
    else:
        return tl.reduce(v, axis, _maxnan)


@triton.jit
def _div(x, y, ns):
    """RN(x / s) for s > 0 from y = RN(1 / s) and ns = -s: q = x y, then one exact-residual
    correction (Markstein); bit-equal to IEEE division while x, s, 1/s and x/s stay normal. The
    sign of a zero result may be lost: callers take signs from x."""
    q = x * y
    r = tl.fma(q, ns, x)
    return tl.fma(r, y, q)


@triton.jit
def _pow2_floor_1(a):
    """2^floor(log2 a), at least 1, for a >= 0 (from a's exponent bits): E2M1's step at a is half
    of it (0.5 below 2, 1 up to 4, 2 above)."""
    return tl.maximum((a.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True), 1.0)


@triton.jit
def _floor_m1(x):
    """floor(x) - 1 for 0 <= x < 2^23: x + 2^23 rounded toward zero is 2^23 + floor(x). Full-rate
    adds where FRND runs at an eighth of the rate on the H200 (the interpreter has no libdevice)."""
    if _INTERP:
        return tl.floor(x) - 1.0
    else:
        return libdevice.add_rz(x, 8388608.0) - 8388609.0


# -----------------------------------------------------------------------------
# 2. Host helpers: formats as kernel constants, seeds, launching

_SCALE_ID = {"fp32": 0, "e4m3": 1, "e8m0": 2}
_SIGNS = {}


@functools.lru_cache(maxsize=None)
def _smask(n):
    """The RHT signs of size n as bits (bit j set: sign -1), or -1 to load them (n > 32)."""
    if not n or n > 32:
        return -1
    return sum(1 << j for j, v in enumerate(fp4.rht_signs(n).tolist()) if v < 0)


def _signs(n, device, dummy):
    """The RHT signs as a tensor on the device, for kernels that load them (n > 32); else dummy.
    Cached, and made on a helper thread: the first call may come during a CUDA-graph warm-up,
    whose memory pool takes this thread's allocations and must not own a tensor kept for later."""
    if _smask(n) != -1:
        return dummy
    key = (n, str(device))
    if key not in _SIGNS:
        if device.type != "cuda":
            _SIGNS[key] = fp4.rht_signs(n, device).contiguous()
        else:
            def make():
                _SIGNS[key] = fp4.rht_signs(n, device).contiguous()
                torch.cuda.synchronize(device)  # ready before any stream of this thread reads it
            helper = threading.Thread(target=make)
            helper.start()
            helper.join()
    return _SIGNS[key]


@functools.lru_cache(maxsize=None)
def _grid_meta_cached(grid_name):
    return _grid_meta_uncached(grid_name)


def _grid_meta(grid_name):
    return dict(_grid_meta_cached(grid_name))


def _grid_meta_uncached(grid_name):
    grid = fp4.GRIDS[grid_name]
    segs = fp4.grid_pieces(grid)
    if len(segs) > 3 or grid.levels[0] != 0.0 or len(grid.levels) != 8:
        raise ValueError(f"grid {grid_name!r}: kernels handle 8 levels from 0 in at most 3 pieces")
    for _, st, _ in segs:
        if math.frexp(st)[0] != 0.5:
            raise ValueError(f"grid {grid_name!r}: steps must be powers of two")
    pad = segs + [(grid.qmax, 1.0, 8)] * (3 - len(segs))
    return dict(E2M1=grid.levels == fp4.GRIDS["e2m1"].levels,  # (kernels decode it from bits)
                NSEG=len(segs), S1=float(pad[1][0]), S2=float(pad[2][0]), ST0=float(pad[0][1]),
                ST1=float(pad[1][1]), ST2=float(pad[2][1]), I1=int(pad[1][2]), I2=int(pad[2][2]))


def _side_meta(fmt, rounding, rht, p):
    return dict(_side_meta_cached(fmt, rounding, rht, p))


@functools.lru_cache(maxsize=None)
def _side_meta_cached(fmt, rounding, rht, p):
    if rht and rht not in fp4.RHT_SIZES:
        raise ValueError(f"RHT size must be one of {fp4.RHT_SIZES}, got {rht}")
    grid = fp4.GRIDS[fmt.grid]
    m = dict(QMAX=float(grid.qmax), EMAX=int(math.floor(math.log2(grid.qmax))),
             BLOCK=fmt.block, SCALE=_SCALE_ID[fmt.scale], B2D=bool(fmt.block_2d),
             SR=rounding == "sr", RHT=int(rht or 0), INV=float(1.0 / math.sqrt(rht or 1)),
             G=max(16, fmt.block), SMASK=_smask(rht))
    m.update(_grid_meta(fmt.grid))
    return {p + k: v for k, v in m.items()}


def _off_meta(p):
    return {p + "QMAX": 1.0, p + "EMAX": 0, p + "E2M1": False, p + "NSEG": 1, p + "S1": 0.0, p + "S2": 0.0,
            p + "ST0": 1.0, p + "ST1": 1.0, p + "ST2": 1.0, p + "I1": 8, p + "I2": 8,
            p + "BLOCK": 16, p + "SCALE": 0, p + "B2D": False, p + "SR": False, p + "RHT": 0,
            p + "INV": 1.0, p + "G": 16, p + "SMASK": -1, p + "SEEDPTR": False, p + "FAKE": False,
            p + "PACKED": False, p + "FP8": 0, p + "FIX": 0.0, p + "OVER": 0.0}


def _seed(seed, device):
    """An int, or a one-element integer tensor on the device (read by the kernel: no host sync,
    and a CUDA graph replays whatever value it holds then; values in [0, 2^31 - 1) give the same
    random bits as that int). An int kernel argument stays below 2^31 - 1 (one compiled kernel
    for all seeds): other ints are mixed into that range (splitmix64), so that seeds built as
    step * 2^32 + layer do not meet, as they would modulo 2^31 - 1."""
    if seed is None:  # one draw from torch's CPU generator (the reference draws on x's device)
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    if isinstance(seed, torch.Tensor):
        if seed.device == device:
            return seed.reshape(()).to(torch.int64)
        seed = int(seed)
    seed = int(seed)
    if 0 <= seed < 2**31 - 1:
        return seed
    z = (seed + 0x9E3779B97F4A7C15) % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return (z ^ (z >> 31)) % (2**31 - 1)


def _cdiv(a, b):  # triton.cdiv costs microseconds of host time per call (constexpr unwrapping)
    return -(-a // b)


def _pow2_at_least(n, lo):
    return max(lo, 1 << (max(int(n), 1) - 1).bit_length())


_FAST = {}


def _spec(v):
    """What Triton specializes a launch argument on (ints: ==1, %16, 64-bit; pointers: 16-byte
    alignment, dtype), so a cached compiled kernel is only reused where Triton would reuse it."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, int):
        return ("i", v == 1, v % 16 == 0, -2**31 <= v < 2**31)
    return (type(v),)


def _launch(kernel, grid, args, meta, meta_key=None):
    """kernel[grid](*args, **meta), but later calls with the same specialization launch the
    compiled kernel directly (Triton's generic launch path costs tens of microseconds of host
    time per call, which dominates small tensors). meta_key: tuple(sorted(meta.items())), if the
    caller has it cached."""
    if INTERPRET:
        kernel[grid](*args, **meta)
        return
    key = (kernel, args[0].device.index, meta_key or tuple(sorted(meta.items())),
           tuple(_spec(v) for v in args))
    ck = _FAST.get(key)
    if ck is None:
        ck = kernel[grid](*args, **meta)
        if ck is not None:
            names = kernel.arg_names[len(args):]
            _FAST[key] = (ck, [meta[n] for n in names])
        return
    ck, tail = ck
    ck[grid](*args, *tail)


# -----------------------------------------------------------------------------
# 3. Quantize (fp4.quantize, fake_quant, quantize_both): one tile per program

@triton.jit
def _block_scales(xb, s_enc, R: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                  QMAX: tl.constexpr, EMAX: tl.constexpr, SCALE: tl.constexpr, B2D: tl.constexpr):
    """The block scales of xb [R, NB, BLOCK] (fp4.block_scales): the stored ones ([R, NB], or
    [R/BLOCK, NB] for 2D tiles) and one per row and block. A block holding NaN or Inf: NaN."""
    xa = tl.abs(xb)
    if B2D:  # NaN-propagating max: a block holding NaN or Inf gets a non-finite amax
        amax = _amax(_amax(tl.reshape(xa, [R // BLOCK, BLOCK, NB, BLOCK]), 3), 1)
    else:
        amax = _amax(xa, 2)
    qm = tl.zeros_like(amax) + QMAX
    if SCALE == 0:    # fp32: amax / qmax
        sc = tl.div_rn(amax, qm)
    elif SCALE == 1:  # e4m3: e4m3_rtne(min(amax / qmax * s_enc, 448))
        sc = tl.div_rn(amax, qm) * s_enc
        sc = _round_e4m3(tl.where(sc > 448.0, 448.0, sc))
    else:             # e8m0: 2^(floor(log2 amax) - EMAX) clamped to 2^[-127, 127]
        ebits = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.maximum(ebits - 127 - EMAX, -127)
        pw = tl.where(e >= -126, (e + 127) << 23, 0x400000).to(tl.float32, bitcast=True)
        sc = tl.where(amax > 0, pw, 0.0)
    sc = tl.where(amax <= 3.4028234663852886e38, sc, float("nan"))  # NaN/Inf block: NaN scale
    if B2D:  # tile scales -> one per row and block
        sc_rows = tl.reshape(tl.broadcast_to(sc[:, None, :], [R // BLOCK, BLOCK, NB]), [R, NB])
    else:
        sc_rows = sc
    return sc, sc_rows


@triton.jit
def _divide(xb, sc_rows, s_enc, valid, R: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
            SCALE: tl.constexpr, SR: tl.constexpr):
    """xb / its block's scale (times s_enc for e4m3 scales): one division as a multiply + 2 FMAs
    by the block's reciprocal (RTNE; SR takes the product alone). Invalid blocks divide by 1."""
    # per block: the divisor d, its reciprocal y and the numerator's factor f (x / d = x f / (d f))
    if SCALE == 0:  # keep d f and 1 / (d f) normal for tiny and huge blocks
        f = tl.where(sc_rows < 5.421010862427522e-20, 1.8446744073709552e19,
                     tl.where(sc_rows > 1.8446744073709552e19, 5.421010862427522e-20, 1.0))
        d = sc_rows * f
    elif SCALE == 1:
        f = tl.zeros_like(sc_rows) + s_enc
        d = sc_rows
    else:
        d = sc_rows
    dd = tl.where(valid, d, 1.0)
    y = tl.div_rn(tl.zeros_like(dd) + 1.0, dd)
    yb = tl.broadcast_to(y[:, :, None], [R, NB, BLOCK])
    if SCALE == 2:  # a power of two: the product is the correctly rounded quotient
        t = xb * yb
    elif SR:  # within an ulp of x / d: SR needs its distribution, not RTNE's bits
        t = xb * f[:, :, None] * yb
    else:
        t = _div(xb * f[:, :, None], yb, tl.broadcast_to(-dd[:, :, None], [R, NB, BLOCK]))
    return t


@triton.jit
def _round_to_grid(a, seed, roff, R: tl.constexpr, C: tl.constexpr, NB: tl.constexpr,
                   BLOCK: tl.constexpr, E2M1: tl.constexpr, NSEG: tl.constexpr, S1: tl.constexpr,
                   S2: tl.constexpr, ST0: tl.constexpr, ST1: tl.constexpr, ST2: tl.constexpr,
                   SR: tl.constexpr, ROUNDS: tl.constexpr, RBITS: tl.constexpr):
    """Magnitudes a (in grid units, at most qmax) -> (grid magnitudes, RTNE's a + step 2^23 or 0)."""
    biased = 0
    if SR and E2M1:  # E2M1 is a float of one mantissa bit whose subnormal step (0.5) is its first
        # binade's; so is fp32 at its smallest normal binade, and a * 2^-126 lays a's grid over
        # fp32's bits there (as _grid_code). floor(a / step + u) is then an integer add of the
        # random bits below the kept mantissa bit and a mask (below 1, a subnormal there, a is
        # first rounded to 2^-23, as the float add it replaces rounded to 24 bits: both far
        # finer than u's 2^-8)
        low = (a * 1.1754943508222875e-38).to(tl.int32, bitcast=True)
        r = tl.reshape(_random_bits(seed, roff, R, C, ROUNDS, RBITS, 22), [R, NB, BLOCK])
        mag = ((low + r) & -4194304).to(tl.float32, bitcast=True) * 8.507059173023462e37
    elif SR and NSEG == 1:  # floor(k + u), u uniform on (0, 1) in RBITS bits: up with
        # probability ~frac(k); a / step is exact (a power of two), so the fused multiply-add
        # rounds as the add alone
        one_u = tl.reshape(_uniform(seed, roff, R, C, ROUNDS, RBITS), [R, NB, BLOCK])
        mag = _floor_m1(tl.fma(a, 1.0 / ST0, one_u)) * ST0
    elif SR:  # the same per piece: k = (a - start) / step
        start = tl.zeros_like(a)
        step = tl.zeros_like(a) + ST0
        inv = tl.zeros_like(a) + 1.0 / ST0
        in1 = a >= S1
        start = tl.where(in1, S1, start)
        step = tl.where(in1, ST1, step)
        inv = tl.where(in1, 1.0 / ST1, inv)
        if NSEG > 2:
            in2 = a >= S2
            start = tl.where(in2, S2, start)
            step = tl.where(in2, ST2, step)
            inv = tl.where(in2, 1.0 / ST2, inv)
        one_u = tl.reshape(_uniform(seed, roff, R, C, ROUNDS, RBITS), [R, NB, BLOCK])
        # (a - start) * inv and the result times step plus start are exact (powers of two)
        mag = tl.fma(_floor_m1(tl.fma(a - start, inv, one_u)), step, start)
    else:  # RNE of a to a multiple of its piece's step: (a + step 2^23) - step 2^23
        if E2M1:  # step * 2^23 with E2M1's step at a
            big = _pow2_floor_1(a) * 4194304.0
        else:
            big = tl.zeros_like(a) + ST0 * 8388608.0
            if NSEG > 1:
                big = tl.where(a >= S1, ST1 * 8388608.0, big)
            if NSEG > 2:
                big = tl.where(a >= S2, ST2 * 8388608.0, big)
        biased = a + big
        mag = biased - big
    return mag, biased


@triton.jit
def _grid_code(mag, biased, sign, R: tl.constexpr, C: tl.constexpr, E2M1: tl.constexpr,
               NSEG: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, ST0: tl.constexpr,
               ST1: tl.constexpr, ST2: tl.constexpr, I1: tl.constexpr, I2: tl.constexpr,
               SR: tl.constexpr):
    """The 4-bit codes [R, C] (sign bit 3, grid index bits 0-2) of grid magnitudes mag."""
    if NSEG == 1 and not SR:  # a uniform grid's index: the low mantissa bits of a + step 2^23
        idx = biased.to(tl.int32, bitcast=True) & 7
    elif E2M1:  # the index is E2M1's own bits: mag * 2^-126 has them as its lowest exponent
        # bits and top mantissa bit (0.5 a subnormal, as in _grid_mag, whose inverse this is:
        # a thread that flushes subnormals, torch.set_flush_denormal, would break both)
        idx = (mag * 1.1754943508222875e-38).to(tl.int32, bitcast=True) >> 22
    else:  # any grid of up to three uniform pieces
        idx = _small_int(mag * (1.0 / ST0))  # exact: levels are multiples of their piece's step
        if NSEG > 1:
            idx = tl.where(mag >= S1, I1 + _small_int((mag - S1) * (1.0 / ST1)), idx)
        if NSEG > 2:
            idx = tl.where(mag >= S2, I2 + _small_int((mag - S2) * (1.0 / ST2)), idx)
    return tl.reshape(idx | (sign >> 28 & 8), [R, C])


@triton.jit
def _quant_tile(x, s_enc, fp8_inv, seed, roff, R: tl.constexpr, C: tl.constexpr,
                QMAX: tl.constexpr, EMAX: tl.constexpr, E2M1: tl.constexpr, NSEG: tl.constexpr,
                S1: tl.constexpr, S2: tl.constexpr, ST0: tl.constexpr, ST1: tl.constexpr,
                ST2: tl.constexpr, I1: tl.constexpr, I2: tl.constexpr,
                BLOCK: tl.constexpr, SCALE: tl.constexpr, B2D: tl.constexpr, SR: tl.constexpr,
                CODES: tl.constexpr, DEQ: tl.constexpr, ROUNDS: tl.constexpr, RBITS: tl.constexpr,
                FP8: tl.constexpr, OVER: tl.constexpr = 0.0):
    """Quantize an fp32 tile [R, C] in blocks along axis 1 (fp4._quantize_blocks, bit for bit).
    Returns codes [R, C] int32 (if CODES), stored scales ([R, C/BLOCK], or [R/BLOCK, C/BLOCK]
    for 2D tiles) and dequantized values [R, C] fp32 (if DEQ; divided by s_enc for e4m3):
    block scales, the division by them, rounding to the grid (RTNE by adding and subtracting
    step * 2^23: RNE in fp32 = ties to the even grid index; SR as floor(k + u)), then codes and
    values. FP8 (e8m0 scales): the values also times fp8_inv, the inverse FP8 tensor scale,
    folded into each block's scale (one multiply per block, not per element; the same FP8
    values: the products differ only below fp32's normal range, which FP8 rounds to +-0).
    OVER (a given FP8 scale): blocks whose folded scale passes it are NaN blocks, not clipped by
    the cast."""
    NB: tl.constexpr = C // BLOCK
    xb = tl.reshape(x, [R, NB, BLOCK])
    sc, sc_rows = _block_scales(xb, s_enc, R, NB, BLOCK, QMAX, EMAX, SCALE, B2D)
    if OVER > 0:  # a block above a given FP8 scale's window: a NaN block, as the reference's
        sc_rows = tl.where(sc_rows * fp8_inv > OVER, float("nan"), sc_rows)
    valid = sc_rows > 0  # zero blocks and NaN scales: code 0 (+0)
    if FP8:  # a NaN tensor scale: every value +NaN (unsigned, as fp4's division gives it)
        valid = tl.where(fp8_inv == fp8_inv, valid, False)  # (the interpreter's & fails on a scalar)
    t = _divide(xb, sc_rows, s_enc, valid, R, NB, BLOCK, SCALE, SR)
    # the sign bit of x where the block is valid (per-block mask: one AND per element)
    smask = tl.broadcast_to(tl.where(valid, -2147483648, 0)[:, :, None], [R, NB, BLOCK])
    sign = xb.to(tl.int32, bitcast=True) & smask
    # invalid blocks: t is +-0 (zero / underflowed scale) or the block is NaN (its values are NaN
    # whatever the codes). Saturate: rounded scales (e4m3, e8m0) and subnormal fp32 scales (amax
    # below ~1e-37, where amax / qmax loses bits) let |t| pass qmax
    a = tl.minimum(tl.abs(t), QMAX)
    if CODES:
        a = tl.where(smask != 0, a, 0.0)
    mag, biased = _round_to_grid(a, seed, roff, R, C, NB, BLOCK, E2M1, NSEG, S1, S2, ST0, ST1, ST2,
                                 SR, ROUNDS, RBITS)
    code = 0
    if CODES:
        code = _grid_code(mag, biased, sign, R, C, E2M1, NSEG, S1, S2, ST0, ST1, ST2, I1, I2, SR)
    deq = 0
    if DEQ:
        scr = sc_rows
        if FP8:  # (e8m0 scales: a power of two times a power of two)
            scr = sc_rows * fp8_inv
        scb = tl.broadcast_to(scr[:, :, None], [R, NB, BLOCK])
        v = mag * scb  # exact for e4m3 / e8m0 scales; NaN for NaN blocks
        if SCALE == 1:  # / s_enc, kept normal by a power-of-two factor for huge s_enc
            ft = tl.where(s_enc > 1.8446744073709552e19, 5.421010862427522e-20, 1.0)
            st = s_enc * ft
            v = _div(mag * (scb * ft), tl.div_rn(tl.zeros_like(st) + 1.0, st), -st)
        deq = tl.reshape((v.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True), [R, C])
    return code, sc, deq


# Tiles are loaded so that each thread holds whole groups of G consecutive elements along the
# blocked dim (G = 16 or 32, a multiple of the block): block amax, per-block scale math and a
# 16-point RHT then stay inside a thread (no shuffles, no replicated per-block work).
#   row side (blocks along N, contiguous): two loads of the half-groups, joined.
#   column side (blocks along M): G loads of one row each per group, joined by a tree of
#   tl.join (the new minor dims of a join live in registers), so no transpose copy is needed.


@triton.jit
def _ld(p, mask, EVEN: tl.constexpr):
    """tl.load as fp32, masked unless EVEN (the tile lies inside the tensor: the compiler drops
    the unused mask)."""
    if EVEN:
        return tl.load(p).to(tl.float32)
    return tl.load(p, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _st(p, v, mask, EVEN: tl.constexpr):
    """tl.store in p's dtype, masked unless EVEN."""
    if EVEN:
        tl.store(p, v.to(p.dtype.element_ty))
    else:
        tl.store(p, v.to(p.dtype.element_ty), mask=mask)


@triton.jit
def _load_rows(x_ptr, base, m0, n0, M, N, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
               MODE: tl.constexpr, EVEN: tl.constexpr):
    """x[m0:m0+BM, n0:n0+BN] as fp32 [BM, BN]. MODE 0: two strided loads of the half-groups,
    joined, so each thread holds whole G-groups along N (for G = 32 a half-group is two 16-byte
    vectors, which the compiler gives to two lanes); MODE 2: G / 8 loads of 8-element pieces, so
    each thread holds a whole 32-group (the same as MODE 0 for G = 16); MODE 1: one plain
    coalesced load (a group spans lanes: the compiler shuffles). EVEN: the tile lies inside x
    (no masks)."""
    if MODE == 1:
        r1 = m0 + tl.arange(0, BM)
        c1 = n0 + tl.arange(0, BN)
        off1 = base + r1[:, None].to(tl.int64) * N + c1[None, :]
        return _ld(x_ptr + off1, (r1[:, None] < M) & (c1[None, :] < N), EVEN)
    P: tl.constexpr = 8 if MODE == 2 else G // 2  # elements per piece
    r = m0 + tl.arange(0, BM)
    c = n0 + (tl.arange(0, BN // G) * G)[None, :, None] + tl.arange(0, P)[None, None, :]
    off = base + r[:, None, None].to(tl.int64) * N + c
    mask = (r[:, None, None] < M) & (c < N)
    v = tl.join(_ld(x_ptr + off, mask, EVEN), _ld(x_ptr + off + P, mask, EVEN))  # piece j: [.., P, 2]
    if G == 2 * P:
        out = tl.reshape(tl.permute(v, (0, 1, 3, 2)), [BM, BN])
    else:  # four pieces, piece 2 i + j: [.., P, 2, 2]
        v = tl.join(v, tl.join(_ld(x_ptr + off + 2 * P, mask, EVEN),
                               _ld(x_ptr + off + 3 * P, mask, EVEN)))
        out = tl.reshape(tl.permute(v, (0, 1, 4, 3, 2)), [BM, BN])
    return out


@triton.jit
def _store_rows(ptr, base, v, m0, n0, M, N, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
                MODE: tl.constexpr, EVEN: tl.constexpr):
    """Inverse of _load_rows: v [BM, BN] -> ptr (row-major [M, N] at base)."""
    if MODE == 1:
        r1 = m0 + tl.arange(0, BM)
        c1 = n0 + tl.arange(0, BN)
        off1 = base + r1[:, None].to(tl.int64) * N + c1[None, :]
        _st(ptr + off1, v, (r1[:, None] < M) & (c1[None, :] < N), EVEN)
        return
    P: tl.constexpr = 8 if MODE == 2 else G // 2
    r = m0 + tl.arange(0, BM)
    c = n0 + (tl.arange(0, BN // G) * G)[None, :, None] + tl.arange(0, P)[None, None, :]
    off = base + r[:, None, None].to(tl.int64) * N + c
    mask = (r[:, None, None] < M) & (c < N)
    if G == 2 * P:
        q0, q1 = tl.split(tl.permute(tl.reshape(v, [BM, BN // G, 2, P]), (0, 1, 3, 2)))
    else:
        w0, w1 = tl.split(tl.permute(tl.reshape(v, [BM, BN // G, 2, 2, P]), (0, 1, 4, 3, 2)))
        q0, q1 = tl.split(w0)
        q2, q3 = tl.split(w1)
        _st(ptr + off + 2 * P, q2, mask, EVEN)
        _st(ptr + off + 3 * P, q3, mask, EVEN)
    _st(ptr + off, q0, mask, EVEN)
    _st(ptr + off + P, q1, mask, EVEN)


# The column side's join trees: leaf J moves the tile's row pointers p (rows m0 + g G) down J
# rows, one add of a uniform J N per pointer (not a new 64-bit row product per leaf).


@triton.jit
def _ldc(p, rows, nok, M, N, J: tl.constexpr, EVEN: tl.constexpr):
    return _ld(p + J * N, ((rows + J) < M)[:, None] & nok, EVEN)


@triton.jit
def _ldc2(p, rows, nok, M, N, J: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr):
    return tl.join(_ldc(p, rows, nok, M, N, J, EVEN), _ldc(p, rows, nok, M, N, J + S, EVEN))


@triton.jit
def _ldc4(p, rows, nok, M, N, J: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr):
    return tl.join(_ldc2(p, rows, nok, M, N, J, 2 * S, EVEN), _ldc2(p, rows, nok, M, N, J + S, 2 * S, EVEN))


@triton.jit
def _ldc8(p, rows, nok, M, N, J: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr):
    return tl.join(_ldc4(p, rows, nok, M, N, J, 2 * S, EVEN), _ldc4(p, rows, nok, M, N, J + S, 2 * S, EVEN))


@triton.jit
def _ldc16(p, rows, nok, M, N, J: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr):
    return tl.join(_ldc8(p, rows, nok, M, N, J, 2 * S, EVEN), _ldc8(p, rows, nok, M, N, J + S, 2 * S, EVEN))


@triton.jit
def _ldc32(p, rows, nok, M, N, J: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr):
    return tl.join(_ldc16(p, rows, nok, M, N, J, 2 * S, EVEN), _ldc16(p, rows, nok, M, N, J + S, 2 * S, EVEN))


@triton.jit
def _load_cols(x_ptr, base, m0, n0, M, N, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
               EVEN: tl.constexpr):
    """x[m0:m0+BM, n0:n0+BN] transposed, as fp32 [BN, BM]; each thread holds whole G-groups
    along M. Leaf j of the join tree loads rows m0 + g G + j (g < BM / G)."""
    rows = m0 + tl.arange(0, BM // G) * G
    n = n0 + tl.arange(0, BN)
    p = x_ptr + (base + rows[:, None].to(tl.int64) * N + n[None, :])
    if G == 16:
        t = _ldc16(p, rows, (n < N)[None, :], M, N, 0, 1, EVEN)
    else:
        t = _ldc32(p, rows, (n < N)[None, :], M, N, 0, 1, EVEN)
    t = tl.reshape(t, [BM // G, BN, G])
    return tl.reshape(tl.permute(t, (1, 0, 2)), [BN, BM])


@triton.jit
def _stc(p, v, rows, nok, M, N, J: tl.constexpr, EVEN: tl.constexpr):
    _st(p + J * N, v, ((rows + J) < M)[:, None] & nok, EVEN)


@triton.jit
def _stc2(p, v, rows, nok, M, N, J: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr):
    a, b = tl.split(v)
    _stc(p, a, rows, nok, M, N, J, EVEN)
    _stc(p, b, rows, nok, M, N, J + S, EVEN)


@triton.jit
def _stc4(p, v, rows, nok, M, N, J: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr):
    a, b = tl.split(v)
    _stc2(p, a, rows, nok, M, N, J, 2 * S, EVEN)
    _stc2(p, b, rows, nok, M, N, J + S, 2 * S, EVEN)


@triton.jit
def _stc8(p, v, rows, nok, M, N, J: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr):
    a, b = tl.split(v)
    _stc4(p, a, rows, nok, M, N, J, 2 * S, EVEN)
    _stc4(p, b, rows, nok, M, N, J + S, 2 * S, EVEN)


@triton.jit
def _stc16(p, v, rows, nok, M, N, J: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr):
    a, b = tl.split(v)
    _stc8(p, a, rows, nok, M, N, J, 2 * S, EVEN)
    _stc8(p, b, rows, nok, M, N, J + S, 2 * S, EVEN)


@triton.jit
def _stc32(p, v, rows, nok, M, N, J: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr):
    a, b = tl.split(v)
    _stc16(p, a, rows, nok, M, N, J, 2 * S, EVEN)
    _stc16(p, b, rows, nok, M, N, J + S, 2 * S, EVEN)


@triton.jit
def _store_cols(ptr, base, v, m0, n0, M, N, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
                EVEN: tl.constexpr):
    """Inverse of _load_cols: v [BN, BM] (transposed tile) -> ptr (row-major [M, N] at base)."""
    t = tl.permute(tl.reshape(v, [BN, BM // G, G]), (1, 0, 2))
    rows = m0 + tl.arange(0, BM // G) * G
    n = n0 + tl.arange(0, BN)
    p = ptr + (base + rows[:, None].to(tl.int64) * N + n[None, :])
    if G == 16:
        _stc16(p, tl.reshape(t, [BM // G, BN, 2, 2, 2, 2]), rows, (n < N)[None, :], M, N, 0, 1, EVEN)
    else:
        _stc32(p, tl.reshape(t, [BM // G, BN, 2, 2, 2, 2, 2]), rows, (n < N)[None, :], M, N, 0, 1, EVEN)


@triton.jit
def _store_packed(code, sc, a, r0, k0, NR, NK, codes_ptr, scales_ptr, R: tl.constexpr,
                  C: tl.constexpr, BLOCK: tl.constexpr, B2D: tl.constexpr, G: tl.constexpr):
    """Codes of a tile (rows r0 + [0, R), blocked columns k0 + [0, C)) -> [a, NR, NK/2] bytes
    (element 2i low nibble), scales -> [a, NR, NK/BLOCK] (2D tiles: [NR/BLOCK, NK/BLOCK])."""
    lo, hi = tl.split(tl.reshape(code, [R, C // 2, 2]))
    byte = tl.reshape((lo | (hi << 4)).to(tl.uint8), [R, C // G, G // 2])
    rr = r0 + tl.arange(0, R)
    kh = k0 // 2 + (tl.arange(0, C // G) * (G // 2))[None, :, None] + tl.arange(0, G // 2)[None, None, :]
    off = (a * NR + rr[:, None, None].to(tl.int64)) * (NK // 2) + kh
    tl.store(codes_ptr + off, byte, mask=(rr[:, None, None] < NR) & (kh < NK // 2))
    NB: tl.constexpr = C // BLOCK
    kb = k0 // BLOCK + tl.arange(0, NB)
    if B2D:
        rb = r0 // BLOCK + tl.arange(0, R // BLOCK)
        off2 = (a * (NR // BLOCK) + rb[:, None]) * (NK // BLOCK) + kb[None, :]
        m2 = (rb[:, None] < NR // BLOCK) & (kb[None, :] < NK // BLOCK)
    else:
        off2 = (a * NR + rr[:, None].to(tl.int64)) * (NK // BLOCK) + kb[None, :]
        m2 = (rr[:, None] < NR) & (kb[None, :] < NK // BLOCK)
    tl.store(scales_ptr + off2, sc.to(scales_ptr.dtype.element_ty), mask=m2)  # (exact: fp4.SCALE_DTYPES)


@triton.jit
def _s_enc(amax_ptr, senc_ptr, QMAX: tl.constexpr, FIRST):
    """NVFP4's tensor scale from the tensor amax (int32 bits of a non-negative float or NaN, as
    _amax_kernel leaves them): s_enc = qmax 448 / amax, at most fp32's largest value, 1 when amax
    is 0 (fp4.tensor_scale_for). The first program also stores it (the QTensor's tensor_scale)."""
    amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
    s = tl.minimum(tl.div_rn(tl.zeros_like(amax) + QMAX * 448.0, amax), 3.4028234663852886e38)
    s = tl.where(amax == 0.0, 1.0, tl.where(amax != amax, amax, s))  # (a NaN amax: NaN)
    tl.store(senc_ptr, s, mask=FIRST)
    return s


@triton.jit
def _fp8_inv(amax_ptr, scale_ptr, EMAX: tl.constexpr, ROOM: tl.constexpr, FIRST):
    """fp4.fp8_scale from the plain tensor amax (int32 bits, as _flat_amax leaves them): the
    block scale of amax is 2^max(floor(log2 amax) - EMAX, -127), so the tensor scale is 2^E with
    E = max(that exponent - ROOM, -126), ROOM being FP8_ROOM less the RHT's bound. The first program
    stores 2^E; returns 2^-E."""
    bits = tl.load(amax_ptr)
    amax = bits.to(tl.float32, bitcast=True)
    e = tl.maximum(tl.maximum(((bits >> 23) & 0xFF) - 127 - EMAX, -127) - ROOM, -126)
    scale = tl.where(amax > 0, ((e + 127) << 23).to(tl.float32, bitcast=True), 1.0)
    inv = tl.where(amax > 0, ((127 - e) << 23).to(tl.float32, bitcast=True), 1.0)
    finite = amax <= 3.4028234663852886e38  # NaN or Inf somewhere: NaN scale (a NaN block, as fp4)
    tl.store(scale_ptr, tl.where(finite, scale, float("nan")), mask=FIRST)
    return tl.where(finite, inv, float("nan"))


@triton.jit
def _store_t(ptr, base, v, m0, n0, M, N, BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr):
    """A column-side tile v [BN, BM] (blocks along M) -> ptr as [N, M] row-major at base: the
    transposed layout, the blocked dim contiguous (FP8 GEMM operands)."""
    rn = n0 + tl.arange(0, BN)
    rm = m0 + tl.arange(0, BM)
    off = base + rn[:, None].to(tl.int64) * M + rm[None, :]
    _st(ptr + off, v, (rn[:, None] < N) & (rm[None, :] < M), EVEN)


@triton.jit
def _side_consts(amax_ptr, senc_ptr, seed, a, r0, pid_c, R, L, BR: tl.constexpr, BC: tl.constexpr,
                 QMAX: tl.constexpr, EMAX: tl.constexpr, SCALE: tl.constexpr, FP8: tl.constexpr,
                 FIX: tl.constexpr, OVER: tl.constexpr, SR: tl.constexpr, SEEDPTR: tl.constexpr,
                 EPC: tl.constexpr, FIRST):
    """What a side's tile [BR, BC] needs beside its values (rows r0.. of a [R, L] slab a, blocks
    along L, tile column pid_c): NVFP4's tensor scale s_enc, the inverse FP8 tensor scale, the SR
    seed, and SR's Philox counters (one per EPC draws, distinct across the tensor)."""
    s_enc = 1.0
    if SCALE == 1:
        s_enc = _s_enc(amax_ptr, senc_ptr, QMAX, FIRST)
    inv = 1.0
    if FIX > 0:  # a given decode scale: nothing to read first
        inv = FIX
        tl.store(senc_ptr, tl.full((), 1.0 / FIX, tl.float32), mask=FIRST)
    elif FP8 > 0:
        inv = _fp8_inv(amax_ptr, senc_ptr, EMAX, FP8, FIRST)
        if OVER > 0:  # a step state (fp4.step_fp8_scale): its amax is kept, the flag cleared
            tl.store(amax_ptr + 1, 0, mask=FIRST)
    roff = 0
    if SR:
        if SEEDPTR:
            seed = tl.load(seed)
        rows = r0 + tl.arange(0, BR)
        roff = ((a * R).to(tl.int32) + rows[:, None]) * (L // EPC) + pid_c * (BC // EPC) \
            + tl.arange(0, BC // EPC)[None, :]
    return s_enc, inv, seed, roff


@triton.jit
def _quant_kernel(x_ptr, M,
                  r_fake, r_codes, r_scales, r_amax, r_senc, r_signs, r_seed,
                  c_fake, c_codes, c_scales, c_amax, c_senc, c_signs, c_seed,
                  N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr,
                  ROWLOAD: tl.constexpr, ROUNDS: tl.constexpr, RBITS: tl.constexpr, DO_ROW: tl.constexpr,
                  R_FAKE: tl.constexpr, R_PACKED: tl.constexpr, R_G: tl.constexpr, R_QMAX: tl.constexpr, R_EMAX: tl.constexpr,
                  R_E2M1: tl.constexpr, R_NSEG: tl.constexpr, R_S1: tl.constexpr, R_S2: tl.constexpr,
                  R_ST0: tl.constexpr, R_ST1: tl.constexpr, R_ST2: tl.constexpr,
                  R_I1: tl.constexpr, R_I2: tl.constexpr, R_BLOCK: tl.constexpr,
                  R_SCALE: tl.constexpr, R_B2D: tl.constexpr, R_SR: tl.constexpr,
                  R_RHT: tl.constexpr, R_INV: tl.constexpr, R_SMASK: tl.constexpr,
                  R_SEEDPTR: tl.constexpr, R_FP8: tl.constexpr, R_FIX: tl.constexpr,
                  R_OVER: tl.constexpr, DO_COL: tl.constexpr,
                  C_FAKE: tl.constexpr, C_PACKED: tl.constexpr, C_G: tl.constexpr, C_QMAX: tl.constexpr, C_EMAX: tl.constexpr,
                  C_E2M1: tl.constexpr, C_NSEG: tl.constexpr, C_S1: tl.constexpr, C_S2: tl.constexpr,
                  C_ST0: tl.constexpr, C_ST1: tl.constexpr, C_ST2: tl.constexpr,
                  C_I1: tl.constexpr, C_I2: tl.constexpr, C_BLOCK: tl.constexpr,
                  C_SCALE: tl.constexpr, C_B2D: tl.constexpr, C_SR: tl.constexpr,
                  C_RHT: tl.constexpr, C_INV: tl.constexpr, C_SMASK: tl.constexpr,
                  C_SEEDPTR: tl.constexpr, C_FP8: tl.constexpr, C_FIX: tl.constexpr,
                  C_OVER: tl.constexpr):
    """x: [A, M, N] contiguous; one [BM, BN] tile per program. N is a constant of the compiled
    kernel: the column side's G loads per group, a row apart, then share one address with
    immediate offsets (docs/kernels.md, instruction counts). Row side: blocks along N (codes
    [A, M, N/2]); column side: blocks along M (codes [A, N, M/2], the blocked dim moved last as
    in fp4.py); fake outputs in x's layout; EVEN: M % BM == N % BN == 0 (no masks). Each side
    writes fake values (FAKE), packed codes + scales (PACKED) or both. With both sides the second
    read of the tile comes from L2 (one pass over HBM). A side's seed is an int, or (SEEDPTR) a
    pointer to an int64 seed in device memory, which a replayed CUDA graph reads afresh.
    FP8 (a side's FP8_ROOM less fp4.fp8_bound of its RHT and a step scale's room, at least 1;
    0: off): the fake values divided by the tensor's power-of-two scale (_fp8_inv, stored in the
    side's senc) in the output's FP8 dtype; the column side then writes them transposed ([A, N, M]:
    the blocked dim contiguous, as the FP8 GEMM wants). FIX: a given decode scale's inverse (fp4.to_fp8's scale;
    0: from the amax); OVER (with FIX, or a step state as the amax): 2^FP8_ROOM, above which a
    block's scale makes it NaN.
    With an e4m3-scaled or FP8 side (its scale from an amax) the tiles go in reverse launch
    order: the tensor-amax pass has just read x in launch order (in its own tiles), so the first
    tiles here are roughly those it read last, still in L2."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    a = tl.program_id(2)
    if (DO_ROW and (R_SCALE == 1 or (R_FP8 > 0 and R_FIX == 0))) or \
            (DO_COL and (C_SCALE == 1 or (C_FP8 > 0 and C_FIX == 0))):
        pid_m = tl.num_programs(0) - 1 - pid_m
        pid_n = tl.num_programs(1) - 1 - pid_n
        a = tl.num_programs(2) - 1 - a
    a = a.to(tl.int64)
    m0 = pid_m * BM
    n0 = pid_n * BN
    base = a * M * N
    EPC: tl.constexpr = 128 // RBITS  # SR draws per Philox call
    first = pid_m + pid_n + a == 0  # the program that stores the tensor scales
    if DO_ROW:
        xr = _load_rows(x_ptr, base, m0, n0, M, N, BM, BN, R_G, ROWLOAD, EVEN)
        if R_RHT > 0:
            xr = _rht(xr, r_signs, BM, BN, R_RHT, R_INV, R_SMASK)
        s_enc, inv, seed, roff = _side_consts(r_amax, r_senc, r_seed, a, m0, pid_n, M, N, BM, BN,
                                              R_QMAX, R_EMAX, R_SCALE, R_FP8, R_FIX, R_OVER, R_SR,
                                              R_SEEDPTR, EPC, first)
        code, sc, deq = _quant_tile(xr, s_enc, inv, seed, roff, BM, BN, R_QMAX, R_EMAX, R_E2M1, R_NSEG,
                                    R_S1, R_S2, R_ST0, R_ST1, R_ST2, R_I1, R_I2,
                                    R_BLOCK, R_SCALE, R_B2D, R_SR, R_PACKED, R_FAKE, ROUNDS, RBITS, R_FP8 > 0,
                                    R_OVER)
        if R_FAKE:
            _store_rows(r_fake, base, deq, m0, n0, M, N, BM, BN, R_G, ROWLOAD, EVEN)
        if R_PACKED:
            _store_packed(code, sc, a, m0, n0, M, N, r_codes, r_scales, BM, BN, R_BLOCK, R_B2D, R_G)
    if DO_COL:
        xc = _load_cols(x_ptr, base, m0, n0, M, N, BM, BN, C_G, EVEN)  # [BN, BM]: blocks along M
        if C_RHT > 0:
            xc = _rht(xc, c_signs, BN, BM, C_RHT, C_INV, C_SMASK)
        s_enc, inv, seed, roff = _side_consts(c_amax, c_senc, c_seed, a, n0, pid_m, N, M, BN, BM,
                                              C_QMAX, C_EMAX, C_SCALE, C_FP8, C_FIX, C_OVER, C_SR,
                                              C_SEEDPTR, EPC, first)
        code, sc, deq = _quant_tile(xc, s_enc, inv, seed, roff, BN, BM, C_QMAX, C_EMAX, C_E2M1, C_NSEG,
                                    C_S1, C_S2, C_ST0, C_ST1, C_ST2, C_I1, C_I2,
                                    C_BLOCK, C_SCALE, C_B2D, C_SR, C_PACKED, C_FAKE, ROUNDS, RBITS, C_FP8 > 0,
                                    C_OVER)
        if C_FAKE and C_FP8 > 0:
            _store_t(c_fake, base, deq, m0, n0, M, N, BM, BN, EVEN)
        elif C_FAKE:
            _store_cols(c_fake, base, deq, m0, n0, M, N, BM, BN, C_G, EVEN)
        if C_PACKED:
            _store_packed(code, sc, a, n0, m0, N, M, c_codes, c_scales, BN, BM, C_BLOCK, C_B2D, C_G)


@triton.jit
def _amax_kernel(x_ptr, r_part, c_part, M, N, r_signs, c_signs, BM: tl.constexpr, BN: tl.constexpr,
                 DO_ROW: tl.constexpr, R_G: tl.constexpr, R_RHT: tl.constexpr, R_INV: tl.constexpr,
                 R_SMASK: tl.constexpr, DO_COL: tl.constexpr, C_G: tl.constexpr,
                 C_RHT: tl.constexpr, C_INV: tl.constexpr, C_SMASK: tl.constexpr,
                 PLAIN: tl.constexpr, TILES: tl.constexpr, ROWLOAD: tl.constexpr, EVEN: tl.constexpr):
    """max |x| over the tensor, after the RHT along N (row side, from row loads) and/or along M
    (column side, from column loads). PLAIN (one side loads): the other side has no RHT, so its
    amax is the plain max |x| of the same loads, stored in the other side's output. Each program
    takes TILES tiles down M and ends with one atomic max per output. NaN if the tensor has NaN."""
    tl.static_assert(not (PLAIN and DO_ROW and DO_COL))  # (a plain side has no loads of its own)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    a = tl.program_id(2)
    base = a.to(tl.int64) * M * N
    n0 = pid_n * BN
    if DO_ROW:  # the shape of the loads it takes: row loads [BM, BN], column loads [BN, BM]
        acc = tl.zeros([BM, BN], tl.float32)
    else:
        acc = tl.zeros([BN, BM], tl.float32)
    if DO_ROW:
        plain = acc
    else:  # reduced per tile: a second elementwise accumulator beside column loads costs
        # registers and time (docs/kernels.md, the amax pass)
        plain = tl.full((), 0.0, tl.float32)
    acc_c = tl.zeros([BN, BM], tl.float32)
    for t in range(TILES):
        m0 = (pid_m * TILES + t) * BM
        if DO_ROW:
            x = _load_rows(x_ptr, base, m0, n0, M, N, BM, BN, R_G, ROWLOAD, EVEN)
            if PLAIN:
                plain = _maxnan(plain, tl.abs(x))
            if R_RHT > 0:
                x = _rht(x, r_signs, BM, BN, R_RHT, R_INV, R_SMASK)
            acc = _maxnan(acc, tl.abs(x))
        if DO_COL:  # (with DO_ROW: the second read of the tile comes from L2)
            x = _load_cols(x_ptr, base, m0, n0, M, N, BM, BN, C_G, EVEN)
            if PLAIN:
                plain = _maxnan(plain, _amax(_amax(tl.abs(x), 1), 0))
            if C_RHT > 0:
                x = _rht(x, c_signs, BN, BM, C_RHT, C_INV, C_SMASK)
            if DO_ROW:
                acc_c = _maxnan(acc_c, tl.abs(x))
            else:
                acc = _maxnan(acc, tl.abs(x))
    # non-negative floats (and +NaN) order like their int32 bits: one atomic max per output
    if DO_ROW:
        _atomic_amax(r_part, acc)
        if DO_COL:
            _atomic_amax(c_part, acc_c)
        elif PLAIN:
            _atomic_amax(c_part, plain)
    else:
        _atomic_amax(c_part, acc)
        if PLAIN:
            _atomic_max_bits(r_part, plain)


@triton.jit
def _atomic_amax(part, v):
    _atomic_max_bits(part, _amax(_amax(v, 1), 0))


@triton.jit
def _atomic_max_bits(part, m):
    tl.atomic_max(part, tl.where(m != m, 0x7FC00000, m.to(tl.int32, bitcast=True)))


@triton.jit
def _flat_amax_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr, TILES: tl.constexpr,
                      STEP: tl.constexpr = False):
    """max |x| over n contiguous elements (NaN if any is) into out_ptr's int32 bits: TILES
    consecutive BLOCKs per program, one atomic each. No layout or RHT to follow, so flat loads.
    STEP: out_ptr is a step state (fp4.new_step_state), read only where its flag is set."""
    go = True
    if STEP:
        go = tl.load(out_ptr + 1) != 0
    if go:
        start = tl.program_id(0).to(tl.int64) * (BLOCK * TILES)
        acc = tl.zeros([BLOCK], tl.float32)
        for t in range(TILES):
            offs = start + t * BLOCK + tl.arange(0, BLOCK)
            acc = _maxnan(acc, tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)))
        _atomic_max_bits(out_ptr, _amax(acc, 0))


FLAT_AMAX = (8192, 2, 8)  # (BLOCK, TILES, warps) of _flat_amax: results/kernels/flat_amax_sweep.txt


def _flat_amax(t, cfg=None, state=None):
    """max |t| (the plain tensor amax of an FP8 side; the largest block scale of fp8_from_packed)
    as an int32 [1] holding the float's bits, as _tensor_amax leaves them; 0 for an empty t.
    cfg: (BLOCK, TILES, warps), else FLAT_AMAX. state: a step state (fp4.new_step_state), whose
    kept amax this finds where its flag asks (reset_step_state zeroed it) and returns; else the
    programs return unread (the quantize kernel then clears the flag)."""
    out = torch.zeros(1, device=t.device, dtype=torch.int32) if state is None else state
    n = t.numel()
    if n:
        BLOCK, tiles, nw = cfg or FLAT_AMAX
        _launch(_flat_amax_kernel, (_cdiv(n, BLOCK * tiles), 1, 1), (t.contiguous(), n, out),
                dict(BLOCK=BLOCK, TILES=tiles, STEP=state is not None, num_warps=nw))
    return out


def _need(fmt, rht):
    return math.lcm(fmt.block, rht or 1)


def _tile(M, N, row, col, cfg=None, esize=2, heavy=False, packed=False, row_2d=False):
    """(BM, BN, num_warps, row load mode): BN a multiple of what the row side needs (block,
    G-group, RHT), BM of what the column side needs; about 32 elements per thread. cfg: an
    explicit (BM, BN, warps[, mode]) (benchmarks; mode 1 when left out). The choices below are the
    fastest measured per case (docs/kernels.md, tiles): row alone: the widest of 2048, 1024, 512
    that divides N, in 4096-element tiles with whole G-groups per thread (mode 0; row_2d keeps 512,
    wider spills registers); both sides fake (dy): 16 x 256; a packed side (x): 64 x 64; a packed
    column side alone: 128 x 64; a fake column side alone: 16 x 256; heavy (SR on a grid of
    several pieces with fp32 scales): 16-row tiles. fp32 inputs take plain loads (mode 1): mode 0
    miscompiled for them on sm_90. _run adjusts two choices for 32-element groups."""
    if cfg:
        return tuple(cfg) + ((1,) if len(cfg) == 3 else ())  # (default: plain row loads)
    if row and not col and esize == 2:  # (verified on 16-bit inputs; fp32 inputs take the plain load)
        for BN in (512,) if row_2d else (2048, 1024, 512):
            if N % BN == 0 and BN % row == 0:
                return 4096 // BN, BN, 4, 0
    if row and col and esize == 2 and not packed and N % 256 == 0 and 256 % row == 0 and 16 % col == 0:
        return 16, 256, 4, 0
    if row and col and esize == 2 and packed and N % 64 == 0 and 64 % row == 0 and 64 % col == 0:
        return 64, 64, 4, 1
    if col and not row and esize == 2 and packed and not heavy and 128 % col == 0:
        return 128, 64, 4, 1
    if col and not row and esize == 2 and not packed and not heavy and 16 % col == 0 and N % 256 == 0:
        return 16, 256, 4, 1
    BN = max(row or 16, min(128, _pow2_at_least(N, 16)))
    if row and not col:  # wide along the contiguous N
        BM = max(16, min((2048 if heavy else 4096) // BN, _pow2_at_least(M, 16)))
    else:
        BM = max(col or 16, 32, 2 * (col or 16) if (col or 16) >= 32 else 32)
        BM = max(BM, min(4096 // BN, 64)) if row else (max(col, 16) if heavy else BM)
    while BM * BN > 8192 and BN > max(row or 16, 16):
        BN //= 2
    return BM, BN, _num_warps(BM, BN), 1


def _num_warps(BM, BN):
    return max(4, min(8, BM * BN // 1024))


def _tensor_amax(x3, fmt, rht, col, col_rht=None, col_fmt=None, cfg=None):
    """NVFP4's tensor amax (after the RHT, along N or along M when col; no RHT: plain max |x|) from
    a first pass over x: an int32 [1] holding the float's bits (no host sync; the quantize kernel
    derives the tensor scale from it).
    col_rht (with col False): also the column side's amax after that RHT (0: none), for a column
    side of format col_fmt (default fmt), from the same read; returns (row amax, col amax) then.
    A side without RHT takes max |x| from the other side's loads (col without RHT: row loads).
    cfg: (BM, BN, warps, row load mode, tiles per program), else _amax_tile's."""
    A, M, N = x3.shape
    both = col_rht is not None
    outs = [torch.zeros(1, device=x3.device, dtype=torch.int32) for _ in range(1 + both)]
    r_part, c_part = outs[0], outs[-1]
    r_rht, c_rht = (rht, col_rht) if both else (None if col else rht, rht if col else None)
    groups = (max(16, fmt.block), max(16, (col_fmt if both and col_fmt else fmt).block))
    # which loads: rows unless only the column side has an RHT; both when both sides have one
    do_row, do_col = bool(r_rht) or not c_rht, bool(c_rht)
    plain = both and not (do_row and do_col)
    BM, BN, nw, mode, tiles = cfg or _amax_tile(M, N, do_row and math.lcm(groups[0], r_rht or 1),
                                                do_col and math.lcm(groups[1], c_rht or 1), x3.element_size())
    meta, meta_key = _amax_meta(((do_row, r_rht), (do_col, c_rht)), groups, plain, BM, BN, tiles,
                                M % (BM * tiles) == 0 and N % BN == 0, mode, nw)
    signs = [_signs(n, x3.device, r_part) if on and n else r_part for on, n in ((do_row, r_rht), (do_col, c_rht))]
    grid = (_cdiv(M, BM * tiles), _cdiv(N, BN), A)
    _launch(_amax_kernel, grid, (x3, r_part, c_part, M, N, *signs), meta, meta_key)
    return tuple(outs) if both else outs[0]


def _amax_tile(M, N, row, col, esize):
    """The amax pass's tile (BM, BN, warps, row load mode, tiles per program) for row loads (row:
    what BN must be a multiple of) and/or column loads (col: what BM must be a multiple of). Row
    loads take the row quantize's tile shape with plain loads (its whole-group loads gave a wrong
    amax now and then on the H200), four tiles per program (fewer atomics); column loads alone
    128 x 64; both at least 64 x 64 (docs/kernels.md, the amax pass)."""
    if row and col:
        return max(64, col), max(64, row), 4, 1, 1
    if col:
        return max(128, col), 64, 4, 1, 1
    BM, BN, nw, _ = _tile(M, N, row, None, esize=esize)
    return BM, BN, nw, 1, 4 if M % (4 * BM) == 0 else 1


@functools.lru_cache(maxsize=None)
def _amax_meta(sides, groups, plain, BM, BN, tiles, even, mode, nw):
    """_amax_kernel's constexprs (and their launch-cache key) for one launch signature: sides
    ((loads, RHT size) for the row and column side), groups (each side's G), plain (the side
    without loads takes max |x| of the other's)."""
    meta = dict(BM=BM, BN=BN, PLAIN=plain, TILES=tiles, ROWLOAD=mode, EVEN=even, num_warps=nw,
                enable_fp_fusion=False)
    for p, (on, n), g in zip(("R_", "C_"), sides, groups):
        meta.update({"DO_" + ("ROW" if p == "R_" else "COL"): on, p + "G": g,
                     p + "RHT": int(n or 0) if on else 0, p + "INV": float(1.0 / math.sqrt(n or 1)),
                     p + "SMASK": _smask(n) if on else -1})
    return meta, tuple(sorted(meta.items()))


@functools.lru_cache(maxsize=None)
def _quant_meta(row_sig, col_sig, N, BM, BN, even, mode, rounds, nw, rbits):
    """_quant_kernel's constexprs for one launch signature (a side's signature: format, rounding,
    RHT, seed in memory, packed, FP8 dtype, given FP8 scale or ("step", its room); None when off),
    and the same as the launch cache's key: built once, not per call."""
    if rbits not in fp4.SR_BITS_CHOICES:
        raise ValueError(f"kernels.SR_BITS is {rbits!r}: stochastic rounding draws "
                         f"{' or '.join(map(str, fp4.SR_BITS_CHOICES))} random bits per element")
    meta = {}
    for sig, p, flag in ((row_sig, "R_", "DO_ROW"), (col_sig, "C_", "DO_COL")):
        if sig is None:
            meta.update(_off_meta(p))
        else:
            fmt, rounding, rht, seed_ptr, packed, fp8, fp8_scale = sig
            step = fp8 and isinstance(fp8_scale, tuple)   # a step state: its kept amax, with room above
            fixed = fp8 and fp8_scale is not None and not step
            room = fp4.FP8_ROOM[fp8] - fp4.fp8_bound(rht) - (fp8_scale[1] if step else 0) if fp8 else 0
            meta.update(_side_meta(fmt, rounding, rht, p))
            meta.update({p + "SEEDPTR": seed_ptr, p + "PACKED": packed, p + "FAKE": not packed,
                         p + "FP8": room, p + "FIX": 1.0 / fp8_scale if fixed else 0.0,
                         p + "OVER": 2.0 ** fp4.FP8_ROOM[fp8] if fixed or step else 0.0})
        meta[flag] = sig is not None
    meta.update(N=N, BM=BM, BN=BN, EVEN=even, ROWLOAD=mode, ROUNDS=rounds, RBITS=rbits, num_warps=nw,
                enable_fp_fusion=False)
    return meta, tuple(sorted(meta.items()))


class _Side:
    """One orientation's request (packed: codes + scales; fp8: FP8 values + tensor scale, the one
    fp8_scale gives or else from the amax; else fake-quantized values) and outputs."""

    def __init__(self, fmt, rounding, rht, seed, device, packed, fp8=None, fp8_scale=None):
        self.fmt, self.rounding, self.rht, self.packed, self.fp8 = fmt, rounding, rht, bool(packed), fp8
        self.fp8_scale = fp8_scale if fp8 else None
        if rounding not in ("rtne", "sr"):  # here, not at launch: an empty tensor launches nothing
            raise ValueError(f"unknown rounding {rounding!r}; valid: 'rtne', 'sr'")
        fp4.check_seed(seed)
        self.seed = _seed(seed, device) if rounding == "sr" else 0


def _side_amaxes(x3, row, col):
    """({side: its tensor amax, or its step state}, the step-scaled sides), before the kernel runs.

    NVFP4 sides take the amax after their RHT (one pass over x for both, shared when equal); FP8
    sides the amax before any RHT (fp4.fp8_scale bounds what it adds), in one plain pass."""
    nv = [s for s in (row, col) if s is not None and s.fmt.scale == "e4m3"]
    fp8 = [s for s in (row, col) if s is not None and s.fp8 and s.fp8_scale is None]
    step = [s for s in (row, col) if s is not None and s.fp8 and fp4.is_step_state(s.fp8_scale)]
    amaxes = {}
    if len(nv) == 2 and (row.rht or col.rht):  # the RHT differs by orientation
        amaxes[row], amaxes[col] = _tensor_amax(x3, row.fmt, row.rht, False, col_rht=col.rht or 0,
                                                col_fmt=col.fmt)
    elif nv:
        first = nv[0]
        amax = _tensor_amax(x3, first.fmt, first.rht, first is col and bool(first.rht))
        amaxes = {s: amax for s in nv}
    if fp8:
        amax = _flat_amax(x3)
        amaxes.update({s: amax for s in fp8})
    for s in step:  # one pass per state, where its flag asks (a pair shares its state)
        if not any(amaxes.get(o) is s.fp8_scale.state for o in step):
            _flat_amax(x3, state=s.fp8_scale.state)
        amaxes[s] = s.fp8_scale.state
    return amaxes, step


def _run(x3, row, col, out_dtype, cfg=None):
    """x3 [A, M, N] contiguous; row/col: _Side or None. Fills each side's outputs."""
    A, M, N = x3.shape
    dev = x3.device
    heavy = any(s and s.rounding == "sr" and s.fmt.scale == "fp32" and _grid_meta_cached(s.fmt.grid)["NSEG"] > 1
                for s in (row, col))
    BM, BN, nw, mode = _tile(M, N, row and math.lcm(_need(row.fmt, row.rht), 16),
                             col and math.lcm(_need(col.fmt, col.rht), 16), cfg, x3.element_size(), heavy,
                             any(s and s.packed for s in (row, col)), bool(row and row.fmt.block_2d))
    # 32-element groups (32-blocks; docs/kernels.md, tiles):
    if not cfg and row and max(16, row.fmt.block) == 32 and mode == 0 and \
            (row.packed or row.rounding == "sr"):
        mode = 2  # whole groups per thread: faster for SR and packed, slower for RTNE fake
    if not cfg and col and not row and max(16, col.fmt.block) == 32 and col.rounding == "sr" and \
            (BM, BN, nw) == (64, 128, 8):
        nw = 4  # two columns per thread, 4-byte loads: faster for SR
    if row and row.fmt.block_2d:
        BM = max(BM, row.fmt.block)
    if col and col.fmt.block_2d:
        BN = max(BN, col.fmt.block)
    fake_dtype = torch.float32 if INTERPRET else out_dtype
    if fake_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        fake_dtype = torch.float32
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    amaxes, step = _side_amaxes(x3, row, col)
    args = []
    for side, col_side in ((row, False), (col, True)):
        if side is None:
            args += [dummy, dummy, dummy, dummy, dummy, dummy, 0]
            continue
        fmt, blk = side.fmt, side.fmt.block
        NR, NK = (N, M) if col_side else (M, N)
        if side.fp8:  # (the interpreter casts to FP8 with ties away from zero: torch casts after)
            side.fake = torch.empty((A, NR, NK) if col_side else (A, M, N), device=dev,
                                    dtype=torch.float32 if INTERPRET else side.fp8)
        else:
            side.fake = None if side.packed else torch.empty((A, M, N), device=dev, dtype=fake_dtype)
        if side.packed:
            side.codes = torch.empty((A, NR, NK // 2), device=dev, dtype=torch.uint8)
            sshape = (A, NR // blk, NK // blk) if fmt.block_2d else (A, NR, NK // blk)
            side.scales = torch.empty(sshape, device=dev,
                                      dtype=torch.float32 if INTERPRET else fp4.SCALE_DTYPES[fmt.scale])
        else:
            side.codes = side.scales = None
        fixed = side.fp8_scale is not None and side not in amaxes  # (the kernel writes the given scale)
        side.s_enc = torch.empty((), device=dev, dtype=torch.float32) if side in amaxes or fixed else None
        if side.s_enc is not None and not M * N * A:  # no program runs to write it: an empty
            # tensor's scale is 1 (NVFP4's s_enc as for an all-zero tensor; FP8's), the given one,
            # or the step state's (which the reference updates as for any call)
            side.s_enc = (fp4.step_fp8_scale(side.fp8_scale.state, x3, side.fmt, side.fp8, side.rht,
                                             side.fp8_scale.room)
                          if side in step else
                          torch.full((), side.fp8_scale if fixed else 1.0, device=dev, dtype=torch.float32))
        args += [dummy if side.packed else side.fake, side.codes if side.packed else dummy,
                 side.scales if side.packed else dummy, amaxes.get(side, dummy),
                 side.s_enc if side.s_enc is not None else dummy,
                 _signs(side.rht, dev, dummy) if side.rht else dummy, side.seed]
    grid = (_cdiv(M, BM), _cdiv(N, BN), A)
    if M * N * A:
        sig = lambda s: s and (s.fmt, s.rounding, s.rht, isinstance(s.seed, torch.Tensor), s.packed, s.fp8,  # noqa: E731
                               ("step", s.fp8_scale.room) if s in step else s.fp8_scale)
        meta, meta_key = _quant_meta(sig(row), sig(col), N, BM, BN, M % BM == 0 and N % BN == 0,
                                     mode, PHILOX_ROUNDS, nw, SR_BITS)
        _launch(_quant_kernel, grid, (x3, M, *args), meta, meta_key)
    for side in (row, col):
        if INTERPRET and side is not None and side.packed:
            side.scales = fp4.stored_scales(side.scales, side.fmt)
        want = side and (side.fp8 or out_dtype)
        if side is not None and side.fake is not None and side.fake.dtype != want:
            side.fake = side.fake.to(want)


def _as3(x, dim):
    """x -> ([A, M, N] contiguous view, is_column): blocks along N (dim last) or along M."""
    shape = x.shape
    A = math.prod(shape[:dim])
    B = math.prod(shape[dim + 1:])
    xc = x.contiguous()
    if B == 1:
        return xc.view(1, A, shape[dim]), False
    return xc.view(A, shape[dim], B), True


def _prep(x, fmt, dim, rht):
    fmt = fp4.get_format(fmt)
    dim = fp4.blocked_dim(x, dim)
    fp4.check_blockable(x, fmt, dim, rht)
    return fmt, dim


def _qtensor(x, side, dim, moved_shape):
    fmt = side.fmt
    codes = side.codes.reshape(*moved_shape[:-1], moved_shape[-1] // 2)
    b = fmt.block
    if fmt.block_2d:  # tiles over the last two dims of the moved shape
        scales = side.scales.reshape(*moved_shape[:-2], moved_shape[-2] // b, moved_shape[-1] // b)
    else:
        scales = side.scales.reshape(*moved_shape[:-1], moved_shape[-1] // b)
    return fp4.QTensor(codes, scales, side.s_enc, fmt, tuple(x.shape), x.dtype, dim, side.rht)


def _result(side, x, dim):
    """What a side gives back for x quantized along dim: its QTensor (packed), its FP8 values of
    x's shape (a transposed view for the column side) and scale (fp8), else the fake-quantized
    values in x's layout."""
    if side.packed:
        return _qtensor(x, side, dim, x.movedim(dim, -1).shape)
    if side.fp8:
        return side.fake.view(x.movedim(dim, -1).shape).movedim(-1, dim), side.s_enc
    return side.fake.view(x.shape)


def _quantize_one(x, fmt, dim, rounding, rht, seed, out_dtype, cfg, packed=False, fp8=None,
                  fp8_scale=None):
    """x quantized along dim in one orientation (blocks along N, or along M of _as3's view)."""
    fmt, dim = _prep(x, fmt, dim, rht)
    x3, is_col = _as3(x, dim)
    side = _Side(fmt, rounding, rht, seed, x.device, packed, fp8, fp8_scale)
    _run(x3, None if is_col else side, side if is_col else None, out_dtype, cfg)
    return _result(side, x, dim)


def quantize(x, fmt, dim=-1, rounding="rtne", rht=None, seed=None, _cfg=None):
    """fp4.quantize on the GPU (or under TRITON_INTERPRET): -> fp4.QTensor."""
    return _quantize_one(x, fmt, dim, rounding, rht, seed, None, _cfg, packed=True)


def fake_quant(x, fmt, dim=-1, rounding="rtne", rht=None, seed=None, dtype=None, _cfg=None):
    """fp4.fake_quant: the dequantized values (in the RHT basis if rht), in dtype or x.dtype,
    in x's layout (contiguous)."""
    fp4.check_out_dtype(dtype)
    return _quantize_one(x, fmt, dim, rounding, rht, seed, dtype or x.dtype, _cfg)


def to_fp8(x, fmt, dim=-1, rounding="rtne", rht=None, seed=None, fp8=fp4.E4M3, scale=None, _cfg=None):
    """fp4.to_fp8: (FP8 values of x's shape with `dim` contiguous, fp32 tensor scale), from the
    tensor-amax pass and one quantize pass; with a given scale, the quantize pass alone."""
    fp4.check_fp8(fmt, fp8)
    fp4.check_fp8_given_scale(scale, fp8, rht)
    return _quantize_one(x, fmt, dim, rounding, rht, seed, None, _cfg, fp8=fp8, fp8_scale=scale)


def quantize_both(x, fmt, fmt_col=None, rounding="rtne", rounding_col=None, rht=None,
                  rht_col="same", seed=None, seed_col=None, packed=False, dtype=None, fp8=None,
                  fp8_scale=None, _cfg=None):
    """fp4.quantize_both: a 2D tensor [M, K] quantized row-wise (blocks along dim 1) and
    column-wise (blocks along dim 0) from one read. Returns (row, col), each what fake_quant,
    quantize (if packed) or to_fp8 (if fp8) returns for dim=1 and dim=0 with that side's format,
    rounding, RHT and seed, the same bits as those two calls. packed: a bool, or one per side
    (row, col); fp8: None, an FP8 dtype for both sides, or one dtype (or None) per side;
    fp8_scale: to_fp8's scale, for both sides or one per side."""
    fmt_r, fmt_c, rr, rc, pr, pc = fp4.quantize_both_args(x, fmt, fmt_col, rht, rht_col, packed, dtype)
    f8r, f8c, s_row, s_col = fp4.check_fp8_sides(fmt_r, fmt_c, pr, pc, fp8, fp8_scale, (rr, rc))
    row = _Side(fmt_r, rounding, rr, seed, x.device, pr, f8r, s_row)
    col = _Side(fmt_c, rounding_col or rounding, rc, seed_col, x.device, pc, f8c, s_col)
    _run(x.contiguous().view(1, *x.shape), row, col, dtype or x.dtype, _cfg)
    return _result(row, x, 1), _result(col, x, 0)


# -----------------------------------------------------------------------------
# 4. Dequantize (fp4.dequantize)

@triton.jit
def _dequant_kernel(codes_ptr, scales_ptr, ts_ptr, top_ptr, fp8_scale_ptr, out_ptr, NR, NK, stride_or,
                    stride_ok, BR: tl.constexpr, BK: tl.constexpr, BLOCK: tl.constexpr, B2D: tl.constexpr,
                    HAS_TS: tl.constexpr, TRANS: tl.constexpr, TO_FP8: tl.constexpr, FP8_ROOM: tl.constexpr,
                    E2M1: tl.constexpr, NSEG: tl.constexpr,
                    S1: tl.constexpr, S2: tl.constexpr, ST0: tl.constexpr, ST1: tl.constexpr,
                    ST2: tl.constexpr, I1: tl.constexpr, I2: tl.constexpr):
    """codes [A, NR, NK/2] + scales -> values in the original layout (batch a, strides). TO_FP8
    (fp8_from_packed): top_ptr holds the largest block scale's bits; the values are divided by the
    FP8 scale it gives (a power of two: a multiply of each block scale; the same FP8 bytes, as
    _quant_tile's FP8 sides argue), which the first program stores."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    a = tl.program_id(2).to(tl.int64)
    sign_bit = 8
    if TO_FP8:
        first = (pid_r == 0) & (pid_k == 0) & (a == 0)
        inv = _fp8_inv(top_ptr, fp8_scale_ptr, 0, FP8_ROOM, first)
        sign_bit = tl.where(inv == inv, 8, 0)  # a NaN scale makes every value +NaN, as fp4's
    rr = pid_r * BR + tl.arange(0, BR)
    kh = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    m2 = (rr[:, None] < NR) & (kh[None, :] < NK // 2)
    c = tl.load(codes_ptr + (a * NR + rr[:, None].to(tl.int64)) * (NK // 2) + kh[None, :], mask=m2, other=0)
    c = c.to(tl.int32)
    code = tl.reshape(tl.join(c & 15, c >> 4), [BR, BK])
    NB: tl.constexpr = BK // BLOCK
    kb = pid_k * NB + tl.arange(0, NB)
    if B2D:
        rb = rr // BLOCK
        soff = (a * (NR // BLOCK) + rb[:, None]) * (NK // BLOCK) + kb[None, :]
    else:
        soff = (a * NR + rr[:, None].to(tl.int64)) * (NK // BLOCK) + kb[None, :]
    sc = tl.load(scales_ptr + soff, mask=(rr[:, None] < NR) & (kb[None, :] < NK // BLOCK), other=0.0)
    sc = sc.to(tl.float32)
    if HAS_TS:  # / s_enc on magnitudes (see _div), kept normal for huge s_enc by a power of two
        ts = tl.load(ts_ptr)  # (in the block scale: one multiply per block, not per element)
        ft = tl.where(ts > 1.8446744073709552e19, 5.421010862427522e-20, 1.0)
        st = ts * ft
        sc = sc * ft
    if TO_FP8:  # a power of two, folded into the block scales (as _quant_tile's FP8 sides)
        sc = sc * inv
    mag = _grid_mag(code & 7, E2M1, NSEG, S1, S2, ST0, ST1, ST2, I1, I2)
    v = tl.reshape(tl.reshape(mag, [BR, NB, BLOCK]) * sc[:, :, None], [BR, BK])
    if HAS_TS:
        v = _div(v, tl.broadcast_to(tl.div_rn(tl.zeros_like(st) + 1.0, st), [BR, BK]),
                 tl.broadcast_to(-st, [BR, BK]))
    out = (v.to(tl.int32, bitcast=True) | ((code & sign_bit) << 28)).to(tl.float32, bitcast=True)
    kk = pid_k * BK + tl.arange(0, BK)
    if TRANS:
        o = tl.trans(out)
        off = a * NR * NK + rr[None, :].to(tl.int64) * stride_or + kk[:, None].to(tl.int64) * stride_ok
        m = (rr[None, :] < NR) & (kk[:, None] < NK)
    else:
        o = out
        off = a * NR * NK + rr[:, None].to(tl.int64) * stride_or + kk[None, :].to(tl.int64) * stride_ok
        m = (rr[:, None] < NR) & (kk[None, :] < NK)
    tl.store(out_ptr + off, o.to(out_ptr.dtype.element_ty), mask=m)


def _dequantize(q, dtype, fp8_top=None):
    """dequantize; fp8_top (fp8_from_packed): (the largest block scale's bits, the FP8 scale's
    output) for FP8 values divided by that scale, stored by the kernel (rounding to nearest even;
    in range by construction, where plain dequantize's torch cast would give inf on overflow)."""
    fmt = q.fmt
    shape, dim = q.shape, q.dim
    A = math.prod(shape[:dim])
    B = math.prod(shape[dim + 1:])
    K = shape[dim]
    out_dtype = dtype or q.dtype
    direct = (torch.bfloat16, torch.float16) + ((fp4.E4M3, fp4.E5M2) if fp8_top else ())
    kdtype = out_dtype if out_dtype in direct and not INTERPRET else torch.float32
    out = torch.empty(shape, device=q.codes.device, dtype=kdtype)
    trans = B > 1
    NR, Ab = (B, A) if trans else (A, 1)
    BR = 64 if trans else min(32, _pow2_at_least(NR, 16))
    BK = 64 if trans else 128
    if fmt.block_2d:
        BR = max(BR, fmt.block)
    BK = max(BK, fmt.block)
    codes = q.codes.contiguous()
    scales = _kernel_scales(q)
    ts = q.tensor_scale if q.tensor_scale is not None else scales
    top, fp8_scale = fp8_top or (scales, scales)  # (unused pointers when not to FP8)
    grid = (_cdiv(NR, BR), _cdiv(K, BK), Ab)
    if out.numel():
        _launch(_dequant_kernel, grid, (codes, scales, ts, top, fp8_scale, out, NR, K, 1 if trans else K,
                                        B if trans else 1),
                dict(BR=BR, BK=BK, BLOCK=fmt.block, B2D=bool(fmt.block_2d),
                     HAS_TS=q.tensor_scale is not None, TRANS=trans, TO_FP8=bool(fp8_top),
                     FP8_ROOM=fp4.FP8_ROOM[out_dtype] if fp8_top else 0,
                     num_warps=4, enable_fp_fusion=False, **_grid_meta(fmt.grid)))
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _kernel_scales(q):
    """q's block scales as the kernels read them: as stored, or fp32 under the interpreter."""
    return (q.scales.float() if INTERPRET else q.scales).contiguous()


def dequantize(q, dtype=None):
    """fp4.dequantize: QTensor -> tensor of the original shape (contiguous), in dtype or q.dtype."""
    fp4.check_qtensor(q)
    fp4.check_out_dtype(dtype, fp8_ok=True)
    return _dequantize(q, dtype)


def fp8_from_packed(q, fp8=fp4.E4M3, top=None):
    """fp4.fp8_from_packed: one pass over the block scales for the largest (_flat_amax) unless
    top gives it, then the dequantize kernel writes the FP8 values and the scale (two launches:
    this runs once per layer in every backward, where a chain of small torch ops cost more than
    the conversion)."""
    fp4.check_qtensor(q)
    fp4.check_fp8(q.fmt, fp8)
    top = _flat_amax(_kernel_scales(q)) if top is None else top.float().reshape(1).view(torch.int32)
    scale = torch.empty((), device=q.codes.device, dtype=torch.float32)  # the dequantize kernel writes it
    if not q.scales.numel():
        scale.fill_(1.0)  # an empty tensor: no program runs to write it
    values = _dequantize(fp4.in_codes_layout(q), fp8, fp8_top=(top, scale))
    return values.movedim(-1, q.dim), scale


# -----------------------------------------------------------------------------
# 5. GEMM over packed operands (fp4_matmul): not on the training path, see the header

@triton.jit
def _load_operand(codes, scales, r0, R, K, k0, BR: tl.constexpr, BK: tl.constexpr,
                  BLOCK: tl.constexpr, B2D: tl.constexpr, TMA: tl.constexpr):
    """The packed [BR, BK] tile of a K-blocked operand at rows r0.., k0..: code bytes [BR, BK / 2]
    and block scales [BR, BK / BLOCK] (zeros past R and K). TMA: codes and scales are tensor
    descriptors (the pipeliner then prefetches the tiles into shared memory); else pointers."""
    NB: tl.constexpr = BK // BLOCK
    if TMA:
        c = codes.load([r0, k0 // 2])
        if B2D:  # one scale per BLOCK x BLOCK tile, repeated over its rows
            sc = scales.load([r0 // BLOCK, k0 // BLOCK])
            sc = tl.reshape(tl.broadcast_to(sc[:, None, :], [BR // BLOCK, BLOCK, NB]), [BR, NB])
        else:
            sc = scales.load([r0, k0 // BLOCK])
    else:
        rows = r0 + tl.arange(0, BR)
        kh = k0 // 2 + tl.arange(0, BK // 2)
        rmask = rows[:, None] < R
        c = tl.load(codes + rows[:, None].to(tl.int64) * (K // 2) + kh[None, :],
                    mask=rmask & (kh[None, :] < K // 2), other=0)
        kb = k0 // BLOCK + tl.arange(0, NB)
        if B2D:
            soff = (rows // BLOCK)[:, None] * (K // BLOCK) + kb[None, :]
        else:
            soff = rows[:, None].to(tl.int64) * (K // BLOCK) + kb[None, :]
        sc = tl.load(scales + soff, mask=rmask & (kb[None, :] < K // BLOCK), other=0.0)
    return c, sc


# The GEMM's dequantize on the GPU, one code byte (two elements) -> two bf16 per call, with the
# two signs placed straight into the packed bf16 pair: c * 0x01001000 puts bit 3 at 15 and bit 7
# at 31. The interpreter runs no PTX: there _dequant_operand takes the plain path, and
# tests/ptx_emu.py runs these strings instruction by instruction (test_kernels.py).
#   E2M1 codes with e4m3 / e8m0 scales (NVFP4, MXFP4): c * 0x00040040 puts each nibble's e e m
#   at a bf16's lowest exponent bits and top mantissa bit, which is E2M1 * 2^-126 (0.5 a
#   subnormal); * 2^126, then * the block scale, in bf16x2: both products exact (E2M1 has two
#   significant bits, e4m3 four, e8m0 one), so these are the fp32 product's bf16 rounding. As
#   fma with a -0 addend: sm_80 has fma.rn.bf16x2 (mul.rn.bf16x2 is sm_90's), and ptxas makes
#   the same HMUL2 of it on sm_90.
_DEQ_E2M1_BF16 = """{
.reg .b32 t, u, z;
mul.lo.u32 t, $2, 0x00040040;
and.b32 t, t, 0x01C001C0;
mul.lo.u32 u, $2, 0x01001000;
and.b32 u, u, 0x80008000;
or.b32 t, t, u;
mov.b32 u, 0x7E807E80;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 t, t, u, z;
fma.rn.bf16x2 t, t, $3, z;
mov.b32 {$0, $1}, t;
}"""
#   int4 codes (UFP4's grid, any scale): the low nibble's magnitude m as 2^23 + m by its bits,
#   minus 2^23; the high one's in place as 2^19 + 16 m / 16 (no shift), minus 2^19; times the
#   fp32 scale, rounded to bf16 in pairs (no int -> float conversion). Each nibble's mask and
#   exponent in one lop3 ((a & b) | c: lut 0xEA), which ptxas does not fuse from and + or.
_DEQ_INT4_F32 = """{
.reg .b32 m0, m1, u, t;
.reg .f32 f0, f1;
lop3.b32 m0, $2, 0x07, 0x4B000000, 0xEA;
lop3.b32 m1, $2, 0x70, 0x49000000, 0xEA;
mov.b32 f0, m0;
mov.b32 f1, m1;
sub.f32 f0, f0, 0f4B000000;
sub.f32 f1, f1, 0f49000000;
mul.rn.f32 f0, f0, $3;
mul.rn.f32 f1, f1, $3;
cvt.rn.bf16x2.f32 t, f1, f0;
mul.lo.u32 u, $2, 0x01001000;
and.b32 u, u, 0x80008000;
or.b32 t, t, u;
mov.b32 {$0, $1}, t;
}"""
if HAVE_TRITON:  # (jit functions read globals as constexprs only)
    _DEQ_E2M1_BF16, _DEQ_INT4_F32 = tl.constexpr(_DEQ_E2M1_BF16), tl.constexpr(_DEQ_INT4_F32)


@triton.jit
def _dequant_operand(c, sc, BR: tl.constexpr, BK: tl.constexpr, BLOCK: tl.constexpr,
                     SCALE: tl.constexpr, E2M1: tl.constexpr, NSEG: tl.constexpr, S1: tl.constexpr,
                     S2: tl.constexpr,
                     ST0: tl.constexpr, ST1: tl.constexpr, ST2: tl.constexpr, I1: tl.constexpr,
                     I2: tl.constexpr, DOT_FP32: tl.constexpr):
    """_load_operand's tile -> grid value * block scale, rounded to bf16 (returned as bf16, or as
    bf16-valued fp32 when DOT_FP32 for the interpreter)."""
    NB: tl.constexpr = BK // BLOCK
    if not DOT_FP32 and ((E2M1 and SCALE != 0) or (NSEG == 1 and ST0 == 1.0)):
        if E2M1:  # the block scale as a bf16 pair (exact: e4m3 / e8m0 values)
            sb = sc.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            s = sb | (sb << 16)
        else:
            s = sc
        s = tl.reshape(tl.broadcast_to(s[:, :, None], [BR, NB, BLOCK // 2]), [BR, BK // 2])
        lo, hi = tl.inline_asm_elementwise(_DEQ_E2M1_BF16 if E2M1 else _DEQ_INT4_F32, "=h,=h,r,r",
                                           [c.to(tl.int32), s], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=1)
        return tl.reshape(tl.join(lo, hi), [BR, BK])
    c = c.to(tl.int32)
    code = tl.reshape(tl.join(c & 15, c >> 4), [BR, BK])
    mag = _grid_mag(code & 7, E2M1, NSEG, S1, S2, ST0, ST1, ST2, I1, I2)
    val = (mag.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)
    v = tl.reshape(tl.reshape(val, [BR, NB, BLOCK]) * sc[:, :, None], [BR, BK])
    if DOT_FP32:  # RNE to bf16 by bits (the interpreter's cast truncates), kept in fp32
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return tl.where(v != v, v, b.to(tl.float32, bitcast=True))
    else:
        return v.to(tl.bfloat16)


@triton.jit
def _fp4_mm_kernel(a_codes, a_scales, a_ts, b_codes, b_scales, b_ts, c_ptr, M, N, K,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   A_BLOCK: tl.constexpr, A_B2D: tl.constexpr, A_TS: tl.constexpr, A_SCALE: tl.constexpr,
                   A_E2M1: tl.constexpr,
                   A_NSEG: tl.constexpr, A_S1: tl.constexpr,
                   A_S2: tl.constexpr, A_ST0: tl.constexpr, A_ST1: tl.constexpr,
                   A_ST2: tl.constexpr, A_I1: tl.constexpr, A_I2: tl.constexpr,
                   B_BLOCK: tl.constexpr, B_B2D: tl.constexpr, B_TS: tl.constexpr, B_SCALE: tl.constexpr,
                   B_E2M1: tl.constexpr,
                   B_NSEG: tl.constexpr, B_S1: tl.constexpr,
                   B_S2: tl.constexpr, B_ST0: tl.constexpr, B_ST1: tl.constexpr,
                   B_ST2: tl.constexpr, B_I1: tl.constexpr, B_I2: tl.constexpr,
                   DOT_FP32: tl.constexpr, TMA: tl.constexpr):
    """C[M, N] = A B^T from packed operands quantized along K: dequantized to bf16 in the main
    loop, fp32 accumulation, 1 / (tensor scales) in the epilogue. With TMA (sm_90, 16-byte
    aligned rows) each step's code and scale tiles come through tensor descriptors, which Triton
    prefetches num_stages steps ahead into shared memory, so no thread waits on a global load
    before its dequantize (docs/kernels.md, the packed GEMM)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gm = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gm
    pid_n = (pid % group) // gm
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        # both operands' loads before either dequantize
        ca, sa = _load_operand(a_codes, a_scales, pid_m * BM, M, K, k0, BM, BK, A_BLOCK, A_B2D, TMA)
        cb, sb = _load_operand(b_codes, b_scales, pid_n * BN, N, K, k0, BN, BK, B_BLOCK, B_B2D, TMA)
        a = _dequant_operand(ca, sa, BM, BK, A_BLOCK, A_SCALE, A_E2M1, A_NSEG, A_S1, A_S2, A_ST0, A_ST1, A_ST2, A_I1, A_I2, DOT_FP32)
        b = _dequant_operand(cb, sb, BN, BK, B_BLOCK, B_SCALE, B_E2M1, B_NSEG, B_S1, B_S2, B_ST0, B_ST1, B_ST2, B_I1, B_I2, DOT_FP32)
        acc = tl.dot(a, tl.trans(b), acc)
    if A_TS:
        acc = acc * (1.0 / tl.load(a_ts))
    if B_TS:
        acc = acc * (1.0 / tl.load(b_ts))
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    off = rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(c_ptr + off, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _mm_config(fa, fb):
    """(BM, BN, BK, GROUP_M, num_warps, num_stages) for operands of formats fa and fb: 128 x 128
    x 128 tiles of one warpgroup; 2 pipeline stages with an int4 operand, 3 for E2M1 (the fastest
    measured, docs/kernels.md, the packed GEMM)."""
    if INTERPRET:
        return 32, 32, 64, 4, 4, 1
    int4 = not all(_grid_meta_cached(f.grid)["E2M1"] for f in (fa, fb))
    return 128, 128, 128, 8, 4, 2 if int4 else 3


def _mm_tiles(fa, fb, BM, BN, BK):
    """The [rows, columns] tiles one K step reads of A's codes and scales, then B's (the TMA
    boxes)."""
    def scales(R, f):
        return (R // f.block, BK // f.block) if f.block_2d else (R, BK // _mm_block(f))
    return [(BM, BK // 2), scales(BM, fa), (BN, BK // 2), scales(BN, fb)]


def _mm_block(fmt):
    """The elements per scale that the GEMM reads: 16 for 1D 32-blocks, whose scales _mm_scales
    repeats (their [R, K / 32] tile needs a trip through shared memory to meet the codes' layout,
    which costs more than the repeated bytes); else the format's block."""
    return 16 if fmt.block == 32 and not fmt.block_2d else fmt.block


def _mm_scales(q):
    """q's block scales as the GEMM reads them (_mm_block): 1D 32-blocks' repeated, [R, K / 16]."""
    s, per = q.scales.float().contiguous(), _mm_block(q.fmt)
    return s if per == q.fmt.block else s.repeat_interleave(q.fmt.block // per, dim=-1)


def _mm_meta(fa, fb, a_ts, b_ts):
    """All of _fp4_mm_kernel's constexprs but the tile's, for operands of formats fa (A) and fb
    (B), with (a_ts, b_ts) or without tensor scales."""
    meta = {}
    for p, f, ts in (("A_", fa, a_ts), ("B_", fb, b_ts)):
        meta.update({p + k: v for k, v in _grid_meta(f.grid).items()})
        meta.update({p + "BLOCK": _mm_block(f), p + "B2D": bool(f.block_2d), p + "TS": ts,
                     p + "SCALE": _SCALE_ID[f.scale]})
    return meta


def _tma_descriptors(tensors, boxes):
    """TMA descriptors of these 2D tensors with these tile shapes, or None where TMA cannot read
    them: before sm_90; bases, rows or tile rows not 16-byte aligned; tiles over 256 a side;
    empty tensors."""
    dev = tensors[0].device
    if not INTERPRET and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 9):
        return None
    for t, box in zip(tensors, boxes):
        nbytes = t.element_size()
        if (t.stride(1) != 1 or t.data_ptr() % 16 or t.stride(0) * nbytes % 16
                or box[1] * nbytes % 16 or max(box) > 256 or min(t.shape) == 0):
            return None
    return [TensorDescriptor.from_tensor(t, list(box)) for t, box in zip(tensors, boxes)]


def fp4_matmul(qa, qb, dtype=None, _cfg=None):
    """a @ b^T for QTensors quantized along their last dim (qa: [M, K], qb: [N, K], both 2D):
    packed codes + block scales are dequantized to bf16 inside the GEMM's main loop, products
    accumulate in fp32, the tensor scales (NVFP4) divide the result. Returns [M, N] in dtype
    (default qa.dtype). Equals dequantize(qa) @ dequantize(qb).T up to fp32 summation order and
    the bf16 rounding of value x block scale (exact for e4m3 and e8m0 scales)."""
    for q, nm in ((qa, "qa"), (qb, "qb")):
        fp4.check_qtensor(q)   # (codes or scales cut short would be read past their ends)
        if len(q.shape) != 2 or q.dim != 1:
            raise ValueError(f"{nm}: fp4_matmul needs 2D QTensors quantized along dim 1 "
                             f"(got shape {q.shape}, dim {q.dim})")
    if (qa.rht or None) != (qb.rht or None):
        raise ValueError(f"operands need the same RHT, got {qa.rht} and {qb.rht}")
    M, K = qa.shape
    N, K2 = qb.shape
    if K != K2:
        raise ValueError(f"inner dims differ: {qa.shape} @ {qb.shape}^T")
    out_dtype = dtype or qa.dtype
    kdtype = out_dtype if out_dtype in (torch.float32, torch.bfloat16, torch.float16) and not INTERPRET \
        else torch.float32
    c = torch.empty((M, N), device=qa.codes.device, dtype=kdtype)
    if not c.numel():
        return c if c.dtype == out_dtype else c.to(out_dtype)
    meta = _mm_meta(qa.fmt, qb.fmt, qa.tensor_scale is not None, qb.tensor_scale is not None)
    BM, BN, BK, GM, nw, ns = _cfg or _mm_config(qa.fmt, qb.fmt)
    BK = max(BK, qa.fmt.block, qb.fmt.block)
    # (both paths read codes with rows of K / 2 bytes: a view of padded or transposed codes is copied)
    operands = [qa.codes.contiguous(), _mm_scales(qa), qb.codes.contiguous(), _mm_scales(qb)]
    descs = _tma_descriptors(operands, _mm_tiles(qa.fmt, qb.fmt, BM, BN, BK))
    ac, asc, bc, bsc = descs or operands
    dummy = qa.scales
    grid = (_cdiv(M, BM) * _cdiv(N, BN),)
    _fp4_mm_kernel[grid](ac, asc, qa.tensor_scale if qa.tensor_scale is not None else dummy,
                         bc, bsc, qb.tensor_scale if qb.tensor_scale is not None else dummy,
                         c, M, N, K, BM=BM, BN=BN, BK=BK, GROUP_M=GM, DOT_FP32=INTERPRET,
                         TMA=descs is not None, num_warps=nw, num_stages=ns, **meta)
    return c if c.dtype == out_dtype else c.to(out_dtype)


# -----------------------------------------------------------------------------
# 6. Grouped FP8 GEMM (fp4.fp8_grouped_mm): the MoE experts' three GEMMs on FP8 operands

@triton.jit
def _row_tile_group(offs_ptr, t, E: tl.constexpr, BM: tl.constexpr):
    """Row tile t of rows sorted into E groups (group g ends at offs[g]), counted group by group,
    each group's tiles from its first row: (g, the tile's first row, the group's end row); g is
    E for a tile past the last group's."""
    g_t, r0, end, start, first = E, 0, 0, 0, 0
    for g in tl.static_range(E):
        stop = tl.load(offs_ptr + g)
        tiles = (stop - start + BM - 1) // BM
        hit = (t >= first) & (t < first + tiles)
        g_t = tl.where(hit, g, g_t)
        r0 = tl.where(hit, start + (t - first) * BM, r0)
        end = tl.where(hit, stop, end)
        first += tiles
        start = stop
    return g_t, r0, end


@triton.jit
def _fp8_dot(a, b, acc, PROMOTE: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + a @ b^T: in the tensor cores' own accumulation (PROMOTE 0: fast), else promoted to
    fp32 every PROMOTE elements of K; DOT_FP32: fp32 inputs for the interpreter (FP8 values are
    exact in fp32)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
    if PROMOTE == 0:
        return tl.dot(a, tl.trans(b), acc)
    return tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE)


@triton.jit
def _grouped_fp8_rows_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, offs_ptr, c_ptr, M, K,
                             E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             PROMOTE: tl.constexpr, DOT_FP32: tl.constexpr):
    """Row groups (Fprop, Dgrad): c[rows of g] = a[rows of g] @ b[g]^T * sa * sb, a [N, K] and
    b [E, M, K] with K contiguous, c [N, M]. One program per (row tile of a group, column tile);
    rows past a group's end are masked (they belong to the next group)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(M, BN)
    g, r0, end = _row_tile_group(offs_ptr, pid // num_n, E, BM)
    if g >= E:
        return
    rows = r0 + tl.arange(0, BM)
    cols = (pid % num_n) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    rok, cok = rows < end, cols < M
    a_p = a_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    b_p = b_ptr + g.to(tl.int64) * M * K + cols[:, None].to(tl.int64) * K + ks[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kok = (k0 + ks) < K
        a = tl.load(a_p + k0, mask=rok[:, None] & kok[None, :], other=0.0)
        b = tl.load(b_p + k0, mask=cok[:, None] & kok[None, :], other=0.0)
        acc = _fp8_dot(a, b, acc, PROMOTE, DOT_FP32)
    acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    off = rows[:, None].to(tl.int64) * M + cols[None, :]
    tl.store(c_ptr + off, acc.to(c_ptr.dtype.element_ty), mask=rok[:, None] & cok[None, :])


@triton.jit
def _grouped_fp8_k_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, offs_ptr, c_ptr, M, N, T,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          PROMOTE: tl.constexpr, DOT_FP32: tl.constexpr):
    """Groups along K (Wgrad): c[g] = a[:, K of g] @ b[:, K of g]^T * sa * sb, a [M, T] and
    b [N, T] with T contiguous, c [E, M, N]. One program per (output tile, group); a group's
    last K step masks the next group's columns; an empty group writes zeros."""
    pid, g = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BN)
    rows = (pid // num_n) * BM + tl.arange(0, BM)
    cols = (pid % num_n) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    # group ends are multiples of 16: said so, the masked loads stay 16-byte vectors
    start = tl.multiple_of(tl.load(offs_ptr + g - 1, mask=g > 0, other=0), 16)
    end = tl.multiple_of(tl.load(offs_ptr + g), 16)
    rok, cok = rows < M, cols < N
    a_p = a_ptr + rows[:, None].to(tl.int64) * T + ks[None, :]
    b_p = b_ptr + cols[:, None].to(tl.int64) * T + ks[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(start, end, BK):
        kok = (k0 + ks) < end
        a = tl.load(a_p + k0, mask=rok[:, None] & kok[None, :], other=0.0)
        b = tl.load(b_p + k0, mask=cok[:, None] & kok[None, :], other=0.0)
        acc = _fp8_dot(a, b, acc, PROMOTE, DOT_FP32)
    acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    off = g.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(c_ptr + off, acc.to(c_ptr.dtype.element_ty), mask=rok[:, None] & cok[None, :])


def _grouped_fp8_config(rows_mode, fast):
    """(BM, BN, BK, num_warps, num_stages, the promotion interval along K): one tile for every
    shape, within 4 % of the fastest of a sweep at the MoE experts' shapes (docs/kernels.md,
    the grouped FP8 GEMM)."""
    if INTERPRET:
        return 16, 16, 32, 4, 1, 32
    return (128, 128, 128, 8, 3, 128) if rows_mode and fast else (128, 128, 128, 4, 3, 128)


def _check_groups(av, bv, offs, rows_mode):
    """fp8_grouped_mm's shapes and group ends (ValueError): the kernels read what the shapes
    say, so a narrower view or short offs would be read past, silently. The ends' values are
    checked where they are on the host (the interpreter); on the GPU they stay there unread (no
    sync: the layer makes them)."""
    E = bv.shape[0] if rows_mode else offs.shape[0]
    reduced = (av.shape[1], bv.shape[1]) if rows_mode else (av.shape[1], bv.shape[0])
    if av.dim() != 2 or bv.dim() != (3 if rows_mode else 2) or reduced[0] != reduced[1]:
        raise ValueError(f"fp8_grouped_mm: shapes {tuple(av.shape)} and {tuple(bv.shape)} do not "
                         f"multiply (a [N, K] by b [E, K, M], or a [M, T] by b [T, N])")
    if offs.dim() != 1 or offs.shape[0] != E or offs.device != av.device:
        raise ValueError(f"fp8_grouped_mm: offs must be {E} group ends on {av.device}, got "
                         f"shape {tuple(offs.shape)} on {offs.device}")
    total = av.shape[0] if rows_mode else av.shape[1]
    if offs.device.type == "cpu":
        ends = offs.tolist()
        last = ends[-1] if ends else 0
        # row groups cover every row (each output row is one group's); Wgrad's padded tokens
        # may lie past the last group
        if ends != sorted(ends) or (ends and ends[0] < 0) or last > total or \
                (rows_mode and last != total) or (not rows_mode and any(e % 16 for e in ends)):
            raise ValueError(f"fp8_grouped_mm: group ends {ends} must rise from 0 "
                             + (f"to {total}" if rows_mode else f"to at most {total} in multiples of 16"))


def fp8_grouped_mm(a, b, offs, out_dtype, fast=False, _cfg=None):
    """fp4.fp8_grouped_mm: per-group products of FP8 operands (values, fp32 scale). a [N, K]
    (K contiguous) with row groups ending at offs, b [E, K, M] (each group's K contiguous) ->
    [N, M]; or a [M, T] (T contiguous), b [T, N] (T contiguous) with groups along T -> [E, M, N],
    whose group ends must be multiples of 16 (the kernel loads 16 tokens at a time;
    fp4.group_multiple makes them so). Products accumulate in the tensor cores' fast
    accumulation where fast, else promoted to fp32 every 128 along K. The offsets stay on the
    device: no host sync, a fixed grid (CUDA graphs)."""
    (av, sa), (bv, sb) = a, b
    rows_mode = bv.dim() == 3
    _check_groups(av, bv, offs, rows_mode)
    BM, BN, BK, nw, ns, promote = _cfg or _grouped_fp8_config(rows_mode, fast)
    kdtype = torch.float32 if INTERPRET else out_dtype
    offs = offs.to(torch.int32)
    meta = dict(BM=BM, BN=BN, BK=BK, PROMOTE=0 if fast else promote, DOT_FP32=INTERPRET,
                num_warps=nw, num_stages=ns)
    if rows_mode:
        E, K, M = bv.shape
        N = av.shape[0]
        bt = bv.transpose(1, 2)
        c = torch.empty(N, M, device=av.device, dtype=kdtype)
        if not (c.numel() and E):  # (nothing to compute: torch gives empty tensors any strides)
            return c.to(out_dtype)
        if av.stride() != (K, 1) or not bt.is_contiguous():
            raise ValueError("fp8_grouped_mm: a [N, K] and each group of b [E, K, M] need K contiguous")
        grid = ((_cdiv(N, BM) + E) * _cdiv(M, BN), 1, 1)
        _launch(_grouped_fp8_rows_kernel, grid, (av, bt, sa, sb, offs, c, M, K), dict(E=E, **meta))
    else:
        M, T = av.shape
        N = bv.shape[1]
        bt, E = bv.t(), offs.shape[0]
        if T == 0:  # (no tokens: torch gives an empty tensor any strides)
            return torch.zeros(E, M, N, device=av.device, dtype=out_dtype)
        if av.stride() != (T, 1) or bt.stride() != (T, 1):
            raise ValueError("fp8_grouped_mm: a [M, T] and b [T, N] need T contiguous")
        c = torch.empty(E, M, N, device=av.device, dtype=kdtype)
        if c.numel():
            grid = (_cdiv(M, BM) * _cdiv(N, BN), E, 1)
            _launch(_grouped_fp8_k_kernel, grid, (av, bt, sa, sb, offs, c, M, N, T), meta)
    return c.to(out_dtype)

# -----------------------------------------------------------------------------
# 7. Cross-entropy's gradient (model.softmax_grad_): the training loss's chunks of logits

if HAVE_TRITON:
    @triton.jit
    def _softmax_grad_kernel(z_ptr, t_ptr, scale_ptr, loss_ptr, V: tl.constexpr, BV: tl.constexpr):
        """One row of logits: its logsumexp in one read (a running max and sum per lane), then
        (softmax - one_hot(target)) * scale over it in a second (which finds the row in L2)."""
        row = tl.program_id(0).to(tl.int64)
        p = z_ptr + row * V
        cols = tl.arange(0, BV)
        m = tl.full([BV], -1e30, tl.float32)  # (finite: a lane that sees no logit adds exp(-inf) = 0)
        s = tl.zeros([BV], tl.float32)
        for k in range(0, V, BV):
            z = tl.load(p + k + cols, mask=k + cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, z)
            s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
            m = m_new
        top = tl.max(m, axis=0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
        t = tl.load(t_ptr + row)
        valid = t != -1
        outside = (t < -1) | (t >= V)   # (no such class: NaN, as the reference)
        zt = tl.load(p + tl.minimum(tl.maximum(t, 0), V - 1)).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(outside, float("nan"), tl.where(valid, lse - zt, 0.0)))
        scale = tl.where(outside, float("nan"), tl.where(valid, tl.load(scale_ptr), 0.0))
        for k in range(0, V, BV):
            c = k + cols
            z = tl.load(p + c, mask=c < V).to(tl.float32)
            g = (tl.exp(z - lse) - tl.where(c == t, 1.0, 0.0)) * scale
            tl.store(p + c, g.to(z_ptr.dtype.element_ty), mask=c < V)


def softmax_grad_(logits, targets, scale):
    """model.softmax_grad_: cross-entropy's gradient over the logits [R, V] (contiguous) in place,
    one program a row; -> each row's loss, fp32 [R]. The same math in another order (an online
    logsumexp): equal to the reference within fp32 rounding, not bit for bit. A target outside
    [-1, V) gives its row a NaN loss and gradient, as in the reference."""
    if not logits.is_contiguous() or logits.dim() != 2:
        raise ValueError(f"softmax_grad_ takes contiguous 2-D logits, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    R, V = logits.shape
    loss = torch.empty(R, dtype=torch.float32, device=logits.device)
    z = logits.float() if INTERPRET else logits   # (the interpreter's bf16 stores truncate)
    if R:
        _softmax_grad_kernel[(R,)](z, targets.contiguous(), scale, loss, V=V, BV=2048, num_warps=8)
    if z is not logits:
        logits.copy_(z)
    return loss
