"""A tiny emulator for the few PTX instructions in kernels.py's inline assembly (the packed
GEMM's dequantize), so that CI, which has no GPU, runs the very strings the GPU runs.

    outs = run(asm, inputs)   # inputs: {"$2": uint32 array, ...}; outs: {"$0": uint16 array, ...}

Registers hold uint32 numpy arrays (one lane per element). fp32 arithmetic rounds to nearest even
(numpy float32); bf16x2 fma computes in float64 (a bf16 product is exact there) and rounds to
bf16 through fp32. Anything else raises, so a new instruction needs a line here first."""
import re

import numpy as np

M32 = np.uint64(0xFFFFFFFF)


def _f32(u):
    return np.asarray(u, np.uint32).view(np.float32)


def _u32(f):
    return np.asarray(f, np.float32).view(np.uint32)


def bf16_rne(f):
    """fp32 -> bf16 bits (uint32 holding 16 bits), round to nearest even, NaN kept a NaN."""
    b = _u32(f).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    nan = np.isnan(_f32(_u32(f)))
    return np.where(nan, 0x7FC0 | ((b >> 16) & 0x8000), r).astype(np.uint32)


def _bf16_value(h):
    return _f32(h.astype(np.uint32) << 16).astype(np.float64)


def run(asm, inputs):
    regs = {k: np.asarray(v, np.uint32) for k, v in inputs.items()}
    n = len(next(iter(regs.values())))

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):  # PTX fp32 immediate: 0f + 8 hex digits of its bits
            return np.full(n, int(tok[2:], 16), np.uint32)
        return np.full(n, int(tok, 0), np.uint32)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # unpack: first gets the low half
            lo, hi, src = re.match(r"\{(\S+),\s*(\S+)\},\s*(\S+)", rest).groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        d, *a = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            r = val(a[0])
        elif op == "mul.lo.u32":
            r = ((val(a[0]).astype(np.uint64) * val(a[1]).astype(np.uint64)) & M32).astype(np.uint32)
        elif op == "and.b32":
            r = val(a[0]) & val(a[1])
        elif op == "or.b32":
            r = val(a[0]) | val(a[1])
        elif op == "lop3.b32":  # any function of three inputs: bit i of the lut for (a, b, c) = i's bits
            x, y, z, lut = val(a[0]), val(a[1]), val(a[2]), int(a[3], 0)
            r = np.zeros(n, np.uint32)
            for i in range(8):
                if lut >> i & 1:
                    r |= (x if i & 4 else ~x) & (y if i & 2 else ~y) & (z if i & 1 else ~z)
        elif op == "shr.u32":
            r = val(a[0]) >> val(a[1])
        elif op in ("sub.f32", "mul.rn.f32"):
            with np.errstate(all="ignore"):  # inf and NaN are values here
                x, y = _f32(val(a[0])), _f32(val(a[1]))
                r = _u32(x - y if op == "sub.f32" else x * y)
        elif op == "cvt.rn.bf16x2.f32":  # d = {a: upper half, b: lower half}
            r = (bf16_rne(_f32(val(a[0]))) << 16) | bf16_rne(_f32(val(a[1])))
        elif op == "fma.rn.bf16x2":
            halves = []
            for sh in (0, 16):
                x, y, z = (_bf16_value((val(t) >> sh) & 0xFFFF) for t in a)
                with np.errstate(all="ignore"):
                    halves.append(bf16_rne((x * y + z).astype(np.float32)) << sh)
            r = halves[0] | halves[1]
        else:
            raise NotImplementedError(f"ptx_emu: no emulation for {op!r}")
        regs[d] = np.asarray(r, np.uint32)
    return {k: v for k, v in regs.items() if k.startswith("$")}
