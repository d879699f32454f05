"""SASS of the packed GEMM's main loop (sm_90, the local triton) for the kernel variants of
session 9, rebuilt from git: instructions per dequantized element, barriers (BAR) and
shared-memory loads (LDS) per K step, registers. Variants:
  and+or     `git show afc1c98:kernels.py` (UFP4's nibble mask and exponent as and + or)
  lop3       `git show 7ccd0e9:kernels.py` (one lop3 per nibble)
  fma        lop3 with fma(2^23 + m, s, -2^23 s) for sub + mul (wrong for scales above 2^104)
  sb16       `git show 1d60d8e:kernels.py` reading 32-block scales per 16 elements inside the kernel
  repeated   this tree (32-block scales repeated before the call: _mm_scales)
python results/perf/session9/mm_sass.py [--write DIR]: DIR gets tmp_kernels_old.py (the and+or
kernel, for mm_lop3.py) and tmp_kernels_ffma.py. Run from the repo root."""
import argparse, importlib.util, os, subprocess, sys, tempfile
sys.path[:0] = ["scripts", "."]
import triton
import sass_count as sc

FMA = [(".reg .f32 f0, f1;", ".reg .f32 f0, f1, c0, c1;"),
       ("sub.f32 f0, f0, 0f4B000000;\nsub.f32 f1, f1, 0f49000000;\nmul.rn.f32 f0, f0, $3;\nmul.rn.f32 f1, f1, $3;",
        "mul.rn.f32 c0, $3, 0fCB000000;\nmul.rn.f32 c1, $3, 0fC9000000;\nfma.rn.f32 f0, f0, $3, c0;\nfma.rn.f32 f1, f1, $3, c1;")]
SB16 = [("""    NB: tl.constexpr = BK // BLOCK
    kb = k0 // BLOCK + tl.arange(0, NB)
    if B2D:""", """    SB: tl.constexpr = 16 if BLOCK > 16 else BLOCK
    kb = (k0 // SB + tl.arange(0, BK // SB)) // (BLOCK // SB)
    if B2D:"""),
        ("""    NB: tl.constexpr = BK // BLOCK
    if not DOT_FP32""", """    SB: tl.constexpr = 16 if BLOCK > 16 else BLOCK
    NB: tl.constexpr = BK // SB
    if not DOT_FP32"""),
        ("[BR, NB, BLOCK // 2]", "[BR, NB, SB // 2]"), ("tl.reshape(val, [BR, NB, BLOCK])", "tl.reshape(val, [BR, NB, SB])")]
VARIANTS = [("and+or", "afc1c98", []), ("lop3", "7ccd0e9", []), ("fma", "7ccd0e9", FMA),
            ("sb16", "1d60d8e", SB16), ("repeated", None, [])]


def source(commit, patches):
    s = open("kernels.py").read() if commit is None else \
        subprocess.run(["git", "show", f"{commit}:kernels.py"], capture_output=True, text=True, check=True).stdout
    for a, b in patches:
        assert a in s, a[:50]
        s = s.replace(a, b)
    return s


def load(name, text, folder):
    path = os.path.join(folder, name + ".py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", default=None)
    args = ap.parse_args()
    if args.write:
        for name, (commit, patches) in (("tmp_kernels_old", ("afc1c98", [])), ("tmp_kernels_ffma", ("7ccd0e9", FMA))):
            with open(os.path.join(args.write, name + ".py"), "w") as f:
                f.write(source(commit, patches))
    print(f"`python {' '.join(sys.argv)}`, triton {triton.__version__}, sm_90, 8192^3 tile")
    print("| variant | format | instructions / element | BAR / K step | LDS / K step | registers |\n|---|---|---|---|---|---|")
    folder = tempfile.mkdtemp()
    for label, commit, patches in VARIANTS:
        mod = load("k_" + label.replace("+", "_"), source(commit, patches), folder)
        sc.kernels = mod
        cfg = mod._mm_config(8192, 8192, 8192)
        for fmt in ("ufp4", "nvfp4", "mxfp4", "mxint4"):
            ops, regs = sc.sass(sc.compile_mm(fmt, *cfg), loop=True)
            print(f"| {label} | {fmt} | {sum(ops.values()) / 96:.2f} | {ops['BAR']} | {ops['LDS']} | {regs} |", flush=True)


if __name__ == "__main__":
    main()
