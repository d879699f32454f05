"""Benchmarks of kernels.py on the GPU, in one run (triton.testing.do_bench, median, of each op's
CUDA-graph replay: GPU time, without the Python of the call):

  copy bandwidth (torch clone), fused RHT16 + fake quant 8192^2 bf16 per format, RHT on/off,
  SR vs RTNE, column-wise and both orientations, packed quantize, dequantize, the packed FP4
  GEMM vs cuBLAS bf16 (and dequantize + cuBLAS), a quantized linear fwd+bwd vs a bf16 linear,
  GPT-2-small shapes.

    python bench_kernels.py [--out out/kernels] [--quick]

Writes <out>/kernels_h200.json and <out>/kernels_h200.md (command, date, GPU, versions)."""
import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp4  # noqa: E402
import kernels  # noqa: E402

DEV = "cuda"


def graphed(f):
    """f captured in a CUDA graph (its replay: GPU time without Python launch overhead)."""
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3):
            f()
    torch.cuda.current_stream().wait_stream(st)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        f()
    return gr.replay


def eff(ms, nbytes):
    """Effective bandwidth in TB/s of an op that must move nbytes in ms."""
    return nbytes / ms / 1e9


def packed_bytes(n, name):
    """bf16 in, 4-bit codes and block scales (fp4.SCALE_DTYPES) out."""
    fmt = fp4.FORMATS[name]
    return 2 * n + n // 2 + fp4.SCALE_DTYPES[fmt.scale].itemsize * n // fmt.block


def gemm_operands(a, b, name):
    """a and b packed as the GEMM rows take them (NVFP4's weight in 16 x 16 blocks)."""
    return (kernels.quantize(a, name),
            kernels.quantize(b, dataclasses.replace(fp4.FORMATS[name], block_2d=name == "nvfp4")))


class KernelBench:
    """The benchmark's state: its rows, its time budget, the shared 8192^2 (4096^2 with --quick)
    bf16 input and the copy bandwidth the xcopy columns divide by. Each section is one method."""

    def __init__(self, args):
        self.args, self.rows, self.t_start, self.n_section = args, [], time.time(), 0
        self.warm = tuple(int(v) for v in args.warm.split("/")) if args.warm else None
        self.S = 4096 if args.quick else 8192
        self.g = torch.Generator(device=DEV).manual_seed(0)
        self.x = torch.randn(self.S, self.S, device=DEV, generator=self.g).bfloat16()
        self.n = self.x.numel()
        self.cbw = 4.0   # TB/s until the copy section measures it

    def bench(self, fn, rep=200, graph=True):
        """Median ms of fn's GPU work: by default the replay of fn captured in a CUDA graph, so the
        Python of each call (tens of microseconds for a quantize call) cannot leave the GPU idle
        inside the timed span; timed with a Python call per launch, the same kernel varied by up
        to 1.7x within one process (docs/kernels.md, timing). graph=False: fn itself."""
        if self.warm:
            fn()
            torch.cuda.synchronize()
            return 1.0
        from triton.testing import do_bench
        return do_bench(graphed(fn) if graph else fn, warmup=25, rep=rep, return_mode="median")

    def add(self, section, name, ms, metric="", value=None, target="", note=""):
        self.rows.append(dict(section=section, name=name, ms=round(ms, 4), metric=metric,
                              value=None if value is None else round(value, 4), target=target, note=note))
        v = "" if value is None else f"{value:.3f}"
        print(f"{section:10s} {name:58s} {ms:9.4f} ms  {metric} {v} {target} {note}", flush=True)

    def xcopy(self, ms, nbytes):
        return eff(ms, nbytes) / self.cbw

    def left(self):
        return self.args.budget - (time.time() - self.t_start)

    def section(self, name, fn, need=20):
        """fn, unless --warm gives it to another process or less than `need` seconds are left; an
        error becomes a row and the other sections run."""
        self.n_section += 1
        if self.warm and (self.n_section - 1) % self.warm[1] != self.warm[0]:
            return
        if self.left() < need:
            print(f"-- skipped {name}: {self.left():.0f}s left of the budget", flush=True)
            self.rows.append(dict(section=name, name="skipped (time budget)", ms=None, metric="",
                                  value=None, target="", note=""))
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- keep the other sections
            import traceback
            traceback.print_exc(limit=4)
            self.rows.append(dict(section=name, name=f"ERROR {type(e).__name__}: {str(e)[:200]}",
                                  ms=None, metric="", value=None, target="", note=""))
        torch.cuda.empty_cache()

    def run(self):
        self.section("copy", self.copy)
        self.section("tile", self.tiles, 60)
        self.section("fake", self.fake)
        self.section("sr", self.sr)
        self.section("orient", self.orient)
        self.section("packed", self.packed)
        self.section("gemm", self.gemm, 40)
        self.section("linear", lambda: self.linear(4096 if self.args.quick else 16384, 4096, 4096,
                                                   "16k tok"), 40)
        self.section("gpt2", self.gpt2, 60)

    def copy(self):
        ms = self.bench(lambda: self.x.clone())
        self.cbw = eff(ms, 4 * self.n)
        self.add("copy", f"torch clone bf16 {self.S}x{self.S}", ms, "TB/s", self.cbw)

    def tiles(self):
        """Row tiles: load mode x tile shape (the defaults in kernels._tile come from this table)."""
        x, S, n = self.x, self.S, self.n
        for mode in (0, 1):
            for cfg in ((32, 128, 4), (16, 256, 4), (8, 512, 4), (4, 1024, 4), (2, 2048, 4),
                        (64, 128, 8), (16, 512, 8)):
                ms = self.bench(lambda: kernels.fake_quant(x, "ufp4", rht=16, _cfg=cfg + (mode,)))
                self.add("tile", f"row fake ufp4 RHT16 load mode {mode} cfg {cfg}", ms, "xcopy",
                         self.xcopy(ms, 4 * n))
        d = kernels._amax_tile(S, S, 16, None, 2)
        ms = self.bench(lambda: kernels._tensor_amax(x.view(1, S, S), fp4.FORMATS["nvfp4"], 16, False))
        self.add("tile", f"nvfp4 tensor amax pass alone (reads x), RHT16, default tile {d}", ms,
                 "xcopy", self.xcopy(ms, 2 * n))
        xt = x.t().contiguous()
        for cfg in ((32, 128, 4), (32, 256, 8), (64, 128, 8)):
            ms = self.bench(lambda: kernels.fake_quant(xt, "ufp4", dim=0, rht=16, _cfg=cfg))
            self.add("tile", f"col fake ufp4 RHT16 cfg {cfg}", ms, "xcopy", self.xcopy(ms, 4 * n))
        xs = torch.randn(1024, 1024, device=DEV).bfloat16()
        for name in ("ufp4", "nvfp4"):
            kernels.fake_quant(xs, name, rht=16)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                kernels.fake_quant(xs, name, rht=16)
            host = (time.perf_counter() - t) / 200 * 1e3
            torch.cuda.synchronize()
            self.add("host", f"{name} fake_quant 1024x1024: host time per call (launch-bound)", host)

    def fake(self):
        x, n = self.x, self.n
        for name in ("ufp4", "e2m1", "nvfp4", "mxfp4", "nvint4"):
            ms_on = self.bench(lambda: kernels.fake_quant(x, name, rht=16))
            ms_off = self.bench(lambda: kernels.fake_quant(x, name))
            self.add("fake", f"{name} RHT16 row fake bf16->bf16", ms_on, "xcopy", self.xcopy(ms_on, 4 * n),
                     ">=0.80", "incl. amax pass" if fp4.FORMATS[name].scale == "e4m3" else "")
            self.add("fake", f"{name} no RHT", ms_off, "xcopy", self.xcopy(ms_off, 4 * n))
            self.add("fake", f"{name} RHT on/off", ms_on, "ratio", ms_on / ms_off, "<=1.05")

    def sr(self):
        x = self.x
        for name, dim in (("ufp4", 1), ("nvfp4", 1), ("ufp4", 0), ("nvfp4", 0)):
            ms_r = self.bench(lambda: kernels.fake_quant(x, name, dim=dim, rht=16))
            ms_s = self.bench(lambda: kernels.fake_quant(x, name, dim=dim, rht=16, rounding="sr", seed=1))
            self.add("sr", f"{name} dim={dim} RHT16 SR / RTNE", ms_s, "ratio", ms_s / ms_r, "<=1.20")

    def orient(self):
        x, n = self.x, self.n
        for name in ("ufp4", "nvfp4", "mxfp4"):
            rht = 16 if name != "mxfp4" else 32
            ms_row = self.bench(lambda: kernels.fake_quant(x, name, rht=rht))
            ms_col = self.bench(lambda: kernels.fake_quant(x, name, dim=0, rht=rht))
            self.add("orient", f"{name} col-wise (dim 0) fake", ms_col, "xcopy", self.xcopy(ms_col, 4 * n),
                     "", f"row {ms_row:.4f} ms")
            ms_tr = self.bench(lambda: kernels.fake_quant(x.t().contiguous(), name, rht=rht))
            self.add("orient", f"{name} transpose copy + row-wise", ms_tr, "xcopy", self.xcopy(ms_tr, 4 * n))
        for name, rr, rc in (("nvfp4", None, 16), ("ufp4", 16, 16)):
            ms_b = self.bench(lambda: kernels.quantize_both(x, name, rht=rr, rht_col=rc))
            ms_2 = self.bench(lambda: (kernels.fake_quant(x, name, rht=rr),
                                       kernels.fake_quant(x, name, dim=0, rht=rc)))
            self.add("orient", f"{name} both orientations, one kernel (rht {rr}/{rc})", ms_b, "xcopy",
                     self.xcopy(ms_b, 6 * n), "", f"two calls {ms_2:.4f} ms")

    def packed(self):
        x = self.x
        for name in ("ufp4", "nvfp4", "mxfp4"):
            nbytes = packed_bytes(self.n, name)
            ms = self.bench(lambda: kernels.quantize(x, name))
            self.add("packed", f"{name} quantize -> codes+scales", ms, "xcopy", self.xcopy(ms, nbytes),
                     ">=0.70", "incl. amax pass" if fp4.FORMATS[name].scale == "e4m3" else "")
            ms = self.bench(lambda: kernels.quantize(x, name, dim=0))
            self.add("packed", f"{name} quantize col-wise", ms, "xcopy", self.xcopy(ms, nbytes))
            q = kernels.quantize(x, name)
            ms = self.bench(lambda: kernels.dequantize(q, torch.bfloat16))
            self.add("packed", f"{name} dequantize -> bf16", ms, "xcopy", self.xcopy(ms, nbytes))

    def gemm(self):
        M = N = K = self.S
        a = torch.randn(M, K, device=DEV, generator=self.g).bfloat16()
        b = torch.randn(N, K, device=DEV, generator=self.g).bfloat16()
        fl = 2 * M * N * K
        ms_bf = self.bench(lambda: torch.mm(a, b.t()))
        self.add("gemm", f"cuBLAS bf16 {M}x{N}x{K}", ms_bf, "TFLOP/s", fl / ms_bf / 1e9)
        for name in ("ufp4", "nvfp4", "mxfp4"):
            qa, qb = gemm_operands(a, b, name)
            cfgs = [None] if name != "ufp4" else [None, (128, 128, 128, 8, 4, 2), (128, 128, 64, 8, 4, 4),
                                                  (128, 256, 128, 8, 8, 3), (256, 128, 128, 8, 8, 3)]
            for cfg in cfgs:
                ms = self.bench(lambda: kernels.fp4_matmul(qa, qb, torch.bfloat16, _cfg=cfg), rep=300)
                self.add("gemm", f"fp4_matmul {name} packed cfg {cfg or 'default'}", ms, "x bf16",
                         ms_bf / ms, ">=0.50", f"{fl / ms / 1e9:.0f} TFLOP/s")
            ms = self.bench(lambda: torch.mm(kernels.dequantize(qa, torch.bfloat16),
                                             kernels.dequantize(qb, torch.bfloat16).t()))
            self.add("gemm", f"dequantize + cuBLAS {name}", ms, "x bf16", ms_bf / ms, "",
                     f"{fl / ms / 1e9:.0f} TFLOP/s")
            ms = self.bench(lambda: torch.mm(kernels.fake_quant(a, name), kernels.fake_quant(b, name).t()))
            self.add("gemm", f"fake quant (bf16) + cuBLAS {name}", ms, "x bf16", ms_bf / ms, "",
                     "quantize both operands each call")

    def both_ways(self, f):
        """(eager ms, CUDA-graph replay ms or None)."""
        ms = self.bench(f, rep=300, graph=False)
        try:
            mg = self.bench(f, rep=300)
        except Exception as e:  # noqa: BLE001
            print(f"   graph capture failed: {type(e).__name__}: {str(e)[:120]}")
            mg = None
        return ms, mg

    def linear(self, T, IN, OUT, tag):
        """FP4Linear fwd+bwd per recipe against a bf16 nn.Linear, eager and replayed."""
        torch.manual_seed(0)
        xin = torch.randn(T, IN, device=DEV).bfloat16().requires_grad_(True)
        dy = torch.randn(T, OUT, device=DEV).bfloat16()

        def step(mod):
            def f():
                xin.grad = None
                mod.weight.grad = None
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = mod(xin)
                y.backward(dy)
            return f
        ms_bf, mg_bf = self.both_ways(step(torch.nn.Linear(IN, OUT, bias=False, device=DEV)))
        self.add("linear", f"{tag} bf16 nn.Linear fwd+bwd {T}x{IN}->{OUT}", ms_bf, "TFLOP/s",
                 6 * T * IN * OUT / ms_bf / 1e9, "", f"graph replay {mg_bf:.4f} ms" if mg_bf else "")
        for rname in ("ufp4", "nvfp4", "mxfp4"):
            lin = fp4.FP4Linear(IN, OUT, bias=False, recipe=rname, device=DEV)
            fp4.set_backend("triton")
            ms, mg = self.both_ways(step(lin))
            self.add("linear", f"{tag} FP4Linear {rname} (triton fake quant) fwd+bwd, eager", ms, "x bf16",
                     ms_bf / ms, ">=0.85", "fp4.py as is (6 quantize calls, 3 cuBLAS GEMMs)")
            if mg and mg_bf:
                self.add("linear", f"{tag} FP4Linear {rname} fwd+bwd, CUDA graph replay", mg, "x bf16",
                         mg_bf / mg, ">=0.85", "vs bf16 replayed the same way")
            fp4.set_backend("auto")
        for rname in ("ufp4", "nvfp4"):
            lin = fp4.FP4Linear(IN, OUT, bias=False, recipe=rname, device=DEV)
            ms, mg = self.both_ways(lambda: lean_linear(xin, dy, lin))
            self.add("linear", f"{tag} {rname}: W both orientations in one kernel (sketch), eager", ms,
                     "x bf16", ms_bf / ms, ">=0.85",
                     f"graph replay x bf16 {mg_bf / mg:.3f}" if mg and mg_bf else "")

    def gpt2(self):
        """GPT-2-small shapes: 768- and 3072-wide activations, the MLP's linears and GEMMs."""
        T = 8192  # 8 x 1024 tokens
        xs = torch.randn(T, 768, device=DEV).bfloat16()
        for name in ("ufp4", "nvfp4"):
            ms = self.bench(lambda: kernels.fake_quant(xs, name, rht=16))
            self.add("gpt2", f"{name} fake quant RHT16 {T}x768", ms, "xcopy", self.xcopy(ms, 4 * xs.numel()))
        self.linear(T, 768, 3072, "gpt2 fc")
        self.linear(T, 3072, 768, "gpt2 proj")
        for width in (768, 3072):   # the 8192^2 rows' targets at a micro-step's activations (16k tokens)
            self.gpt2_activations(torch.randn(16384, width, device=DEV, generator=self.g).bfloat16())
        for M, N, K, tag in ((16384, 3072, 768, "fc"), (16384, 768, 3072, "proj")):
            a = torch.randn(M, K, device=DEV, generator=self.g).bfloat16()
            b = torch.randn(N, K, device=DEV, generator=self.g).bfloat16()
            ms_bf = self.bench(lambda: torch.mm(a, b.t()))
            self.add("gpt2", f"{tag} cuBLAS bf16 {M}x{N}x{K}", ms_bf, "TFLOP/s", 2 * M * N * K / ms_bf / 1e9)
            for name in ("ufp4", "nvfp4", "mxfp4"):
                qa, qb = gemm_operands(a, b, name)
                ms = self.bench(lambda: kernels.fp4_matmul(qa, qb, torch.bfloat16))
                self.add("gpt2", f"{tag} fp4_matmul {name} packed {M}x{N}x{K}", ms, "x bf16", ms_bf / ms,
                         ">=0.50")

    def gpt2_activations(self, xg):
        ng, tag = xg.numel(), f"{xg.shape[0]}x{xg.shape[1]}"
        for name in ("ufp4", "e2m1", "nvfp4", "mxfp4"):
            ms_on = self.bench(lambda: kernels.fake_quant(xg, name, rht=16))
            ms_off = self.bench(lambda: kernels.fake_quant(xg, name))
            self.add("gpt2", f"{name} RHT16 row fake {tag}", ms_on, "xcopy", self.xcopy(ms_on, 4 * ng), ">=0.80")
            self.add("gpt2", f"{name} RHT on/off {tag}", ms_on, "ratio", ms_on / ms_off, "<=1.05")
        for name in ("ufp4", "nvfp4"):
            ms_s = self.bench(lambda: kernels.fake_quant(xg, name, rht=16, rounding="sr", seed=1))
            ms_r = self.bench(lambda: kernels.fake_quant(xg, name, rht=16))
            self.add("gpt2", f"{name} SR / RTNE {tag}", ms_s, "ratio", ms_s / ms_r, "<=1.20")
        for name in ("ufp4", "nvfp4", "mxfp4"):
            ms = self.bench(lambda: kernels.quantize(xg, name))
            self.add("gpt2", f"{name} quantize -> codes+scales {tag}", ms, "xcopy",
                     self.xcopy(ms, packed_bytes(ng, name)), ">=0.70")

    def write(self):
        """<out>/kernels_h200.json and .md: the rows with command, date, GPU and versions."""
        import triton
        props = torch.cuda.get_device_properties(0)
        meta = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                    triton=triton.__version__, copy_tb_s=round(self.cbw, 3),
                    seconds=round(time.time() - self.t_start, 1))
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, "kernels_h200.json"), "w") as f:
            json.dump(dict(meta=meta, rows=self.rows), f, indent=1)
        lines = [f"# kernels.py on {meta['gpu']}", "",
                 f"`{meta['command']}` on {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, "
                 f"{meta['sms']} SMs; device copy {self.cbw:.2f} TB/s (bytes read + written). "
                 "Each op is timed as the replay of a CUDA graph of one call (do_bench median, L2 flushed), "
                 "except the linear rows' eager column. "
                 "xcopy = effective bandwidth (bytes the op must read + write) / copy bandwidth.", "",
                 "| section | what | ms (median) | metric | value | target | note |",
                 "|---|---|---|---|---|---|---|"]
        for r in self.rows:
            ms = "" if r["ms"] is None else f"{r['ms']:.4f}"
            v = "" if r["value"] is None else f"{r['value']:.3f}"
            lines.append(f"| {r['section']} | {r['name']} | {ms} | {r['metric']} | {v} | {r['target']} "
                         f"| {r['note']} |")
        with open(os.path.join(self.args.out, "kernels_h200.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))


def lean_linear(xin, dy, lin):
    """A sketch of the layer's six quantize calls and three GEMMs with W quantized both ways in
    one kernel (Wgrad's operands in bf16, fp32 accumulation in cuBLAS): what the recipe costs
    without the custom op around it."""
    r, w = lin.recipe, lin.weight
    fw = dataclasses.replace(fp4.get_format(r.fprop.fmt), block_2d=r.weight_2d)
    rf, rd, rw = (r.rht_size if gemm.rht else None for gemm in (r.fprop, r.dgrad, r.wgrad))
    wq_row, wq_col = kernels.quantize_both(w, fw, rht=rf, rht_col=rd, dtype=torch.bfloat16)
    y = kernels.fake_quant(xin, r.fprop.fmt, rht=rf, dtype=torch.bfloat16) @ wq_row.t()
    dx = kernels.fake_quant(dy, r.dgrad.fmt, rht=rd, rounding="sr", seed=1) @ wq_col
    dyc = kernels.fake_quant(dy, r.wgrad.fmt, dim=0, rht=rw, rounding="sr", seed=2)
    xc = kernels.fake_quant(xin, r.wgrad.fmt, dim=0, rht=rw, dtype=torch.bfloat16)
    return y, dx, torch.mm(dyc.t(), xc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/kernels")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds; later sections are skipped")
    ap.add_argument("--warm", default=None, help="k/n: compile only (each timed call runs once), "
                    "sections k, k + n, ...; run n of these in parallel first to fill Triton's cache")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skip: no CUDA device")
        return
    b = KernelBench(args)
    b.run()
    if b.warm:
        print(f"warm {args.warm} done in {time.time() - b.t_start:.0f}s")
        return
    b.write()


if __name__ == "__main__":
    main()
