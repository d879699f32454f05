"""Machine instructions per element of kernels.py's quantize and dequantize launches and of the
packed GEMM's main loop, without a GPU: each launch is compiled for sm_90 (H100/H200) by Triton's
own ptxas, the SASS is disassembled, and its instructions are counted per element a thread
handles. The quantize kernels have no loops, so this is close to what each thread runs; for the
GEMM, the loop body's count per element it dequantizes in one K step. It shows where a
quantizer's time goes once it is bound by instruction issue, not bandwidth (docs/kernels.md,
instruction counts). The last column counts the int <-> float conversions and
roundings (I2F, I2FP, F2I, FRND; not the bf16 packing F2FP, nor the per-block F2F): the H200 runs
them at 16 per clock per SM, an eighth of the rate of an fp32 add, so one per element costs about
as much issue time as eight other instructions.

    python dev/sass_count.py [--mix]      # --mix: the top opcodes of each launch

Launch arguments are specialized the way the GPU launch specializes them (16-byte aligned
pointers, sizes divisible by 16): without that, Triton cannot vectorize, and the counts mean
nothing. The SASS comes from the local Triton, which may differ from the GPU machine's: for
the GPU's exact compiler, run it in a venv with that Triton (`pip install triton==3.6.0` beside
the CPU torch).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp4  # noqa: E402
import kernels  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# (name, row side, column side, (BM, BN, num_warps, row load mode)); a side: (format, rounding,
# RHT, packed[, FP8 dtype]). The tiles are kernels._tile's defaults at GPT-2 shapes (16384 x 768 / 2304 / 3072;
# the row-only ones at 3072 wide, 4 x 1024; 8 x 512 counts the same per element).
LAUNCHES = [
    ("x row-wise, RTNE (Fprop)", ("ufp4", "rtne", 16, False), None, (4, 1024, 4, 0)),
    ("dy row-wise, SR (Dgrad)", ("ufp4", "sr", 16, False), None, (4, 1024, 4, 0)),
    ("dy column-wise, SR (Wgrad)", None, ("ufp4", "sr", 16, False), (32, 128, 4, 1)),
    ("x column-wise, packed (Wgrad)", None, ("ufp4", "rtne", 16, True), (128, 64, 4, 1)),
    ("x pair: row fake + column packed", ("ufp4", "rtne", 16, False), ("ufp4", "rtne", 16, True), (64, 64, 4, 1)),
    ("dy pair, SR both", ("ufp4", "sr", 16, False), ("ufp4", "sr", 16, False), (16, 256, 4, 0)),
    ("e2m1 dy column-wise, SR", None, ("e2m1", "sr", 16, False), (16, 128, 4, 1)),
    ("nvfp4 dy column-wise, SR", None, ("nvfp4", "sr", 16, False), (32, 128, 4, 1)),
    ("nvfp4 x column-wise, packed", None, ("nvfp4", "rtne", 16, True), (128, 64, 4, 1)),
    ("mxfp4 x row-wise, packed", ("mxfp4", "rtne", 16, True), None, (4, 1024, 4, 2)),
    ("mxfp4 dy row-wise, SR", ("mxfp4", "sr", 16, False), None, (4, 1024, 4, 2)),
    # the FP8-GEMM path (recipe_fp8_gemm): mxfp4's pairs as the layer launches them
    ("mxfp4 x pair, FP8 path: row e4m3 + column packed RHT16", ("mxfp4", "rtne", None, False, fp4.E4M3),
     ("mxfp4", "rtne", 16, True), (64, 64, 4, 1)),
    ("mxfp4 dy pair, FP8 path: e5m2 both, SR, column RHT16", ("mxfp4", "sr", None, False, fp4.E5M2),
     ("mxfp4", "sr", 16, False, fp4.E5M2), (64, 128, 8, 1)),
    ("mxfp4 x pair, FP8 path, x at unit scale: row e5m2 + column packed RHT16",
     ("mxfp4", "rtne", None, False, fp4.E5M2, 1.0), ("mxfp4", "rtne", 16, True), (64, 64, 4, 1)),
]


def compile_sm(fn, meta, types, options, aligned_except=(), cap=90):
    """fn compiled for sm_<cap> (the H200: 90) with the constexprs in meta; types: each
    non-constexpr argument's Triton type; every other argument is 16-byte aligned / divisible by
    16 (as Triton specializes the GPU launch), except those named in aligned_except."""
    signature = {n: "constexpr" if n in meta else types[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if signature[n] != "constexpr" and n not in aligned_except}
    src = ASTSource(fn, signature, {n: meta[n] for n in fn.arg_names if n in meta}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", cap, 32), options=options)


def _scales_type(fmt):
    """The pointer type of a format's stored block scales (fp4.SCALE_DTYPES)."""
    return "*bf16" if fp4.SCALE_DTYPES[fmt.scale] == torch.bfloat16 else "*fp32"


def _types(fn, ints, ptrs, default):
    return {n: "i32" if n in ints else ptrs.get(n, default) for n in fn.arg_names}


def compile_quant(row, col, BM, BN, nw, mode, N=3072):
    """_quant_kernel compiled for sm_90 as kernels._run would launch it on a bf16 tensor N wide
    (a constant of the kernel) whose tiles fit (EVEN), with seeds in device memory."""
    def side(s):
        if s is None:
            return None
        fmt, rounding, rht, packed, *fp8 = s
        return kernels._Side(fp4.get_format(fmt), rounding, rht, 0, torch.device("cpu"), packed, *fp8)
    sides = side(row), side(col)
    sig = lambda s: s and (s.fmt, s.rounding, s.rht, True, s.packed, s.fp8, s.fp8_scale)  # noqa: E731
    meta, _ = kernels._quant_meta(sig(sides[0]), sig(sides[1]), N, BM, BN, True, mode,
                                  kernels.PHILOX_ROUNDS, nw, kernels.SR_BITS)
    fn = kernels._quant_kernel
    fake = [{fp4.E4M3: "*fp8e4nv", fp4.E5M2: "*fp8e5"}.get(s and s.fp8, "*bf16") for s in sides]
    scales = [_scales_type(s.fmt) if s else "*fp32" for s in sides]
    ptr = {"x_ptr": "*bf16", "r_fake": fake[0], "c_fake": fake[1], "r_codes": "*u8",
           "c_codes": "*u8", "r_scales": scales[0], "c_scales": scales[1], "r_seed": "*i64",
           "c_seed": "*i64", "r_amax": "*i32", "c_amax": "*i32"}
    return compile_sm(fn, meta, _types(fn, ("M",), ptr, "*fp32"),
                        dict(num_warps=meta["num_warps"], enable_fp_fusion=False),
                        aligned_except=("r_seed", "c_seed"))


# (format, column-wise codes, BR, BK, FP8 output: fp8_from_packed's e4m3, else bf16)
DEQUANT = [("ufp4", False, 32, 128, False), ("ufp4", True, 64, 64, False), ("nvfp4", False, 32, 128, False),
           ("nvfp4", True, 64, 64, False), ("mxfp4", False, 32, 128, False), ("mxfp4", True, 64, 64, False),
           ("mxfp4", False, 32, 128, True)]


def compile_dequant(fmt_name, trans, BR, BK, fp8=False):
    """_dequant_kernel compiled for sm_90 as kernels.dequantize launches it on bf16 output (or as
    fp8_from_packed does, to e4m3), row-wise codes (unit stride along K) or column-wise (TRANS:
    unit stride along the rows)."""
    fmt = fp4.get_format(fmt_name)
    meta = dict(BR=BR, BK=BK, BLOCK=fmt.block, B2D=bool(fmt.block_2d), HAS_TS=fmt.scale == "e4m3",
                TRANS=trans, TO_FP8=fp8, FP8_ROOM=fp4.FP8_ROOM[fp4.E4M3] if fp8 else 0,
                **kernels._grid_meta(fmt.grid))
    meta["stride_or" if trans else "stride_ok"] = 1   # Triton specializes an int argument of 1
    fn = kernels._dequant_kernel
    ptr = {"codes_ptr": "*u8", "scales_ptr": _scales_type(fmt), "ts_ptr": "*fp32", "top_ptr": "*i32",
           "fp8_scale_ptr": "*fp32", "out_ptr": "*fp8e4nv" if fp8 else "*bf16"}
    return compile_sm(fn, meta, _types(fn, (), ptr, "i32"), dict(num_warps=4, enable_fp_fusion=False))


def compile_mm(fmt_name, BM, BN, BK, group_m, nw, stages, cap=90):
    """_fp4_mm_kernel compiled for sm_90 (or sm_<cap>) as kernels.fp4_matmul launches it on two
    packed operands of one format (bf16 out): through TMA descriptors on sm_90, else pointers."""
    fmt = fp4.get_format(fmt_name)
    BK = max(BK, fmt.block)
    tma = cap >= 90
    meta = dict(BM=BM, BN=BN, BK=BK, GROUP_M=group_m, DOT_FP32=False, TMA=tma)
    meta.update(kernels._mm_meta(fmt, fmt, fmt.scale == "e4m3", fmt.scale == "e4m3"))
    fn = kernels._fp4_mm_kernel
    ptr = {"a_codes": "*u8", "b_codes": "*u8", "c_ptr": "*bf16"}
    if tma:
        names = ("a_codes", "a_scales", "b_codes", "b_scales")
        for name, (r, c) in zip(names, kernels._mm_tiles(fmt, fmt, BM, BN, BK)):
            ptr[name] = f"tensordesc<{'u8' if name.endswith('codes') else 'fp32'}[{r}, {c}]>"
    return compile_sm(fn, meta, _types(fn, ("M", "N", "K"), ptr, "*fp32"),  # fusion: fp4_matmul's default
                        dict(num_warps=nw, num_stages=stages, enable_fp_fusion=True), cap=cap)


def mm_config(fmt_name):
    """kernels.fp4_matmul's tile at 8192^3 for two operands of this format."""
    fmt = fp4.get_format(fmt_name)
    return kernels._mm_config(fmt, fmt)


def disassemble(kernel):
    """(SASS lines, registers per thread) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        text = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True,
                              text=True, check=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return text.splitlines(), int(re.search(r"REG:(\d+)", usage).group(1))


def main_loop(lines):
    """The main loop's body: the longest span from a label to a later branch back to it that does
    not exit (a branch from the tail's barrier-wait retry back into the loop spans the epilogue)."""
    ends = [(i, m.group(1)) for i, l in enumerate(lines) if (m := re.search(r"BRA `\((\.L_x_\d+)\)", l))]
    back = [(lines.index(lab + ":"), i) for i, lab in ends if lab + ":" in lines and lines.index(lab + ":") < i]
    back = [(a, b) for a, b in back if not any(re.search(r"\bEXIT\b", l) for l in lines[a:b])]
    first, last = max(back, key=lambda b: b[1] - b[0], default=(0, 0))
    if last - first < 10:   # only the trap's self-branch: no loop
        raise SystemExit("sass_count: no main loop found in the kernel's SASS")
    return lines[first:last + 1]


INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def sass(kernel, loop=False):
    """(opcode counts, registers per thread) of a compiled kernel; loop: of its main loop's body
    alone."""
    lines, regs = disassemble(kernel)
    if loop:
        lines = main_loop(lines)
    ops = collections.Counter()
    for line in lines:
        m = INSTRUCTION.match(line)
        if m and m.group(1) != "NOP":
            ops[m.group(1)] += 1
    return ops, regs


def slow(ops):
    """int <-> float conversions and roundings among counted opcodes (the H200's 16-per-clock pipe)."""
    return sum(v for k, v in ops.items() if k.startswith(("I2F", "F2I", "FRND")))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mix", action="store_true", help="also print each launch's top opcodes")
    args = p.parse_args()
    print(f"`python {' '.join(sys.argv)}`: triton {triton.__version__}, target sm_90, "
          f"Philox rounds {kernels.PHILOX_ROUNDS}, SR bits {kernels.SR_BITS}")
    print("| launch | tile (BM, BN, warps, row load) | instructions / element | registers | slow conversions / element |")
    print("|---|---|---|---|---|")
    for name, row, col, (BM, BN, nw, mode) in LAUNCHES:
        ops, regs = sass(compile_quant(row, col, BM, BN, nw, mode))
        per = BM * BN / (nw * 32)  # elements per thread
        print(f"| {name} | {BM}, {BN}, {nw}, {mode} | {sum(ops.values()) / per:.1f} | {regs} | {slow(ops) / per:.2f} |")
        if args.mix:
            print("|  | " + ", ".join(f"{k} {v / per:.1f}" for k, v in ops.most_common(12)) + " | | | |")
    for fmt, trans, BR, BK, fp8 in DEQUANT:
        ops, regs = sass(compile_dequant(fmt, trans, BR, BK, fp8))
        per = BR * BK / (4 * 32)
        name = f"{fmt} dequantize, {'column-wise' if trans else 'row-wise'} codes{' to e4m3' if fp8 else ''}"
        print(f"| {name} | {BR}, {BK}, 4, - | {sum(ops.values()) / per:.1f} | {regs} | {slow(ops) / per:.2f} |")
        if args.mix:
            print("|  | " + ", ".join(f"{k} {v / per:.1f}" for k, v in ops.most_common(12)) + " | | | |")
    # the packed GEMM's main loop: per K step each thread dequantizes (BM + BN) BK / threads elements
    # (both stored to shared memory for the wgmma), then the warpgroups' wgmma
    for fmt in ("ufp4", "nvfp4"):
        cfg = mm_config(fmt)
        BM, BN, BK, _, nw, _ = cfg
        ops, regs = sass(compile_mm(fmt, *cfg), loop=True)
        per = (BM + BN) * BK / (nw * 32)
        print(f"| {fmt} fp4_matmul main loop, per dequantized element | "
              f"{BM}, {BN}, {nw}, BK {BK}, {ops['HGMMA']} wgmma | {sum(ops.values()) / per:.1f} | {regs} | {slow(ops) / per:.2f} |")
        if args.mix:
            print("|  | " + ", ".join(f"{k} {v / per:.1f}" for k, v in ops.most_common(12)) + " | | | |")


if __name__ == "__main__":
    main()
