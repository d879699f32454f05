"""Benchmarks of kernels.py on the GPU, in one run (triton.testing.do_bench, median, of each op's
CUDA-graph replay: GPU time, without the Python of the call):

  copy bandwidth (torch clone), fused RHT16 + fake quant 8192^2 bf16 per format, RHT on/off,
  SR vs RTNE, column-wise and both orientations, packed quantize, dequantize, the packed FP4
  GEMM vs cuBLAS bf16 (and dequantize + cuBLAS), a quantized linear fwd+bwd vs a bf16 linear,
  GPT-2-small shapes.

    python bench_kernels.py [--out results] [--quick]

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds; later sections are skipped")
    ap.add_argument("--warm", default=None, help="k/n: compile only (each timed call runs once), "
                    "sections k, k + n, ...; run n of these in parallel first to fill Triton's cache")
    args = ap.parse_args()
    warm = tuple(int(v) for v in args.warm.split("/")) if args.warm else None
    if not torch.cuda.is_available():
        print("skip: no CUDA device")
        return
    import triton
    from triton.testing import do_bench

    import fp4
    import kernels

    t_start = time.time()
    dev = "cuda"
    rows = []   # (section, name, ms, metric, value, target, note)

    def bench(fn, rep=200, graph=True):
        """Median ms of fn's GPU work: by default the replay of fn captured in a CUDA graph, so the
        Python of each call (tens of microseconds for a quantize call) cannot leave the GPU idle
        inside the timed span; timed with a Python call per launch, the same kernel varied by up
        to 1.7x within one process (docs/kernels.md, timing). graph=False: fn itself."""
        if warm:
            fn()
            torch.cuda.synchronize()
            return 1.0
        return do_bench(graphed(fn) if graph else fn, warmup=25, rep=rep, return_mode="median")

    def add(section, name, ms, metric="", value=None, target="", note=""):
        rows.append(dict(section=section, name=name, ms=round(ms, 4), metric=metric,
                         value=None if value is None else round(value, 4), target=target, note=note))
        v = "" if value is None else f"{value:.3f}"
        print(f"{section:10s} {name:58s} {ms:9.4f} ms  {metric} {v} {target} {note}", flush=True)

    def left():
        return args.budget - (time.time() - t_start)

    n_section = [0]

    def section(name, fn, need=20):
        n_section[0] += 1
        if warm and (n_section[0] - 1) % warm[1] != warm[0]:
            return
        if left() < need:
            print(f"-- skipped {name}: {left():.0f}s left of the budget", flush=True)
            rows.append(dict(section=name, name="skipped (time budget)", ms=None, metric="",
                             value=None, target="", note=""))
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- keep the other sections
            import traceback
            traceback.print_exc(limit=4)
            rows.append(dict(section=name, name=f"ERROR {type(e).__name__}: {str(e)[:200]}", ms=None,
                             metric="", value=None, target="", note=""))
        torch.cuda.empty_cache()

    S = 4096 if args.quick else 8192
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(S, S, device=dev, generator=g).bfloat16()
    n = x.numel()
    copy_bw = {}

    def s_copy():
        ms = bench(lambda: x.clone())
        copy_bw["v"] = 4 * n / ms / 1e9
        add("copy", f"torch clone bf16 {S}x{S}", ms, "TB/s", copy_bw["v"])
    section("copy", s_copy)
    cbw = copy_bw.get("v", 4.0)

    def eff(ms, nbytes):
        return nbytes / ms / 1e9

    def packed_bytes(n, name):
        """bf16 in, 4-bit codes and fp32 block scales out."""
        return 2 * n + n // 2 + 4 * n // fp4.FORMATS[name].block

    def gemm_operands(a, b, name):
        """a and b packed as the GEMM rows take them (NVFP4's weight in 16 x 16 blocks)."""
        return (kernels.quantize(a, name),
                kernels.quantize(b, dataclasses.replace(fp4.FORMATS[name], block_2d=name == "nvfp4")))

    # --- row tiles: load mode x tile shape (the defaults in kernels._tile come from this table)
    def s_cfg():
        for mode in (0, 1):
            for cfg in ((32, 128, 4), (16, 256, 4), (8, 512, 4), (4, 1024, 4), (2, 2048, 4),
                        (64, 128, 8), (16, 512, 8)):
                ms = bench(lambda: kernels.fake_quant(x, "ufp4", rht=16, _cfg=cfg + (mode,)))
                add("tile", f"row fake ufp4 RHT16 load mode {mode} cfg {cfg}", ms, "xcopy", eff(ms, 4 * n) / cbw)
        d = kernels._amax_tile(S, S, 16, None, 2)
        ms = bench(lambda: kernels._tensor_amax(x.view(1, S, S), fp4.FORMATS["nvfp4"], 16, False))
        add("tile", f"nvfp4 tensor amax pass alone (reads x), RHT16, default tile {d}", ms, "xcopy",
            eff(ms, 2 * n) / cbw)
        xt = x.t().contiguous()
        for cfg in ((32, 128, 4), (32, 256, 8), (64, 128, 8)):
            ms = bench(lambda: kernels.fake_quant(xt, "ufp4", dim=0, rht=16, _cfg=cfg))
            add("tile", f"col fake ufp4 RHT16 cfg {cfg}", ms, "xcopy", eff(ms, 4 * n) / cbw)
        xs = torch.randn(1024, 1024, device=dev).bfloat16()
        for name in ("ufp4", "nvfp4"):
            kernels.fake_quant(xs, name, rht=16)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                kernels.fake_quant(xs, name, rht=16)
            host = (time.perf_counter() - t) / 200 * 1e3
            torch.cuda.synchronize()
            add("host", f"{name} fake_quant 1024x1024: host time per call (launch-bound)", host, "", None)
    section("tile", s_cfg, 60)

    def s_fake():
        for name in ("ufp4", "e2m1", "nvfp4", "mxfp4", "nvint4"):
            ms_on = bench(lambda: kernels.fake_quant(x, name, rht=16))
            ms_off = bench(lambda: kernels.fake_quant(x, name))
            add("fake", f"{name} RHT16 row fake bf16->bf16", ms_on, "xcopy", eff(ms_on, 4 * n) / cbw,
                ">=0.80", "incl. amax pass" if fp4.FORMATS[name].scale == "e4m3" else "")
            add("fake", f"{name} no RHT", ms_off, "xcopy", eff(ms_off, 4 * n) / cbw)
            add("fake", f"{name} RHT on/off", ms_on, "ratio", ms_on / ms_off, "<=1.05")
    section("fake", s_fake)

    def s_sr():
        for name, dim in (("ufp4", 1), ("nvfp4", 1), ("ufp4", 0), ("nvfp4", 0)):
            ms_r = bench(lambda: kernels.fake_quant(x, name, dim=dim, rht=16))
            ms_s = bench(lambda: kernels.fake_quant(x, name, dim=dim, rht=16, rounding="sr", seed=1))
            add("sr", f"{name} dim={dim} RHT16 SR / RTNE", ms_s, "ratio", ms_s / ms_r, "<=1.20")
    section("sr", s_sr)

    def s_orient():
        for name in ("ufp4", "nvfp4", "mxfp4"):
            ms_row = bench(lambda: kernels.fake_quant(x, name, rht=16 if name != "mxfp4" else 32))
            ms_col = bench(lambda: kernels.fake_quant(x, name, dim=0, rht=16 if name != "mxfp4" else 32))
            add("orient", f"{name} col-wise (dim 0) fake", ms_col, "xcopy", eff(ms_col, 4 * n) / cbw, "",
                f"row {ms_row:.4f} ms")
            ms_tr = bench(lambda: kernels.fake_quant(x.t().contiguous(), name, rht=16 if name != "mxfp4" else 32))
            add("orient", f"{name} transpose copy + row-wise", ms_tr, "xcopy", eff(ms_tr, 4 * n) / cbw)
        for name, rr, rc in (("nvfp4", None, 16), ("ufp4", 16, 16)):
            ms_b = bench(lambda: kernels.quantize_both(x, name, rht=rr, rht_col=rc))
            ms_2 = bench(lambda: (kernels.fake_quant(x, name, rht=rr), kernels.fake_quant(x, name, dim=0, rht=rc)))
            add("orient", f"{name} both orientations, one kernel (rht {rr}/{rc})", ms_b, "xcopy",
                eff(ms_b, 6 * n) / cbw, "", f"two calls {ms_2:.4f} ms")
    section("orient", s_orient)

    def s_packed():
        for name in ("ufp4", "nvfp4", "mxfp4"):
            nbytes = packed_bytes(n, name)
            ms = bench(lambda: kernels.quantize(x, name))
            add("packed", f"{name} quantize -> codes+scales", ms, "xcopy", eff(ms, nbytes) / cbw, ">=0.70",
                "incl. amax pass" if fp4.FORMATS[name].scale == "e4m3" else "")
            ms = bench(lambda: kernels.quantize(x, name, dim=0))
            add("packed", f"{name} quantize col-wise", ms, "xcopy", eff(ms, nbytes) / cbw)
            q = kernels.quantize(x, name)
            ms = bench(lambda: kernels.dequantize(q, torch.bfloat16))
            add("packed", f"{name} dequantize -> bf16", ms, "xcopy", eff(ms, nbytes) / cbw)
    section("packed", s_packed)

    def s_gemm():
        M = N = K = S
        a = torch.randn(M, K, device=dev, generator=g).bfloat16()
        b = torch.randn(N, K, device=dev, generator=g).bfloat16()
        fl = 2 * M * N * K
        ms_bf = bench(lambda: torch.mm(a, b.t()))
        add("gemm", f"cuBLAS bf16 {M}x{N}x{K}", ms_bf, "TFLOP/s", fl / ms_bf / 1e9)
        best = {}
        for name in ("ufp4", "nvfp4", "mxfp4"):
            qa, qb = gemm_operands(a, b, name)
            cfgs = [None] if name != "ufp4" else [None, (128, 128, 128, 8, 4, 2), (128, 128, 64, 8, 4, 4),
                                                  (128, 256, 128, 8, 8, 3), (256, 128, 128, 8, 8, 3)]
            for cfg in cfgs:
                ms = bench(lambda: kernels.fp4_matmul(qa, qb, torch.bfloat16, _cfg=cfg), rep=300)
                add("gemm", f"fp4_matmul {name} packed cfg {cfg or 'default'}", ms, "x bf16", ms_bf / ms,
                    ">=0.50", f"{fl / ms / 1e9:.0f} TFLOP/s")
                best[name] = min(best.get(name, 1e9), ms)
            ms = bench(lambda: torch.mm(kernels.dequantize(qa, torch.bfloat16),
                                        kernels.dequantize(qb, torch.bfloat16).t()))
            add("gemm", f"dequantize + cuBLAS {name}", ms, "x bf16", ms_bf / ms, "", f"{fl / ms / 1e9:.0f} TFLOP/s")
            ms = bench(lambda: torch.mm(kernels.fake_quant(a, name), kernels.fake_quant(b, name).t()))
            add("gemm", f"fake quant (bf16) + cuBLAS {name}", ms, "x bf16", ms_bf / ms, "", "quantize both operands each call")
    section("gemm", s_gemm, 40)

    def both_ways(f):
        """(eager ms, CUDA-graph replay ms or None)."""
        ms = bench(f, rep=300, graph=False)
        try:
            mg = bench(f, rep=300)
        except Exception as e:  # noqa: BLE001
            print(f"   graph capture failed: {type(e).__name__}: {str(e)[:120]}")
            mg = None
        return ms, mg

    def linear_bench(T, IN, OUT, tag):
        torch.manual_seed(0)
        xin = torch.randn(T, IN, device=dev).bfloat16().requires_grad_(True)
        dy = torch.randn(T, OUT, device=dev).bfloat16()
        ref = torch.nn.Linear(IN, OUT, bias=False, device=dev)

        def step(mod):
            def f():
                xin.grad = None
                mod.weight.grad = None
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = mod(xin)
                y.backward(dy)
            return f
        ms_bf, mg_bf = both_ways(step(ref))
        add("linear", f"{tag} bf16 nn.Linear fwd+bwd {T}x{IN}->{OUT}", ms_bf, "TFLOP/s", 6 * T * IN * OUT / ms_bf / 1e9,
            "", f"graph replay {mg_bf:.4f} ms" if mg_bf else "")
        for rname in ("ufp4", "nvfp4", "mxfp4"):
            lin = fp4.FP4Linear(IN, OUT, bias=False, recipe=rname, device=dev)
            fp4.set_backend("triton")
            ms, mg = both_ways(step(lin))
            add("linear", f"{tag} FP4Linear {rname} (triton fake quant) fwd+bwd, eager", ms, "x bf16", ms_bf / ms,
                ">=0.85", "fp4.py as is (6 quantize calls, 3 cuBLAS GEMMs)")
            if mg and mg_bf:
                add("linear", f"{tag} FP4Linear {rname} fwd+bwd, CUDA graph replay", mg, "x bf16", mg_bf / mg,
                    ">=0.85", "vs bf16 replayed the same way")
            fp4.set_backend("auto")
        # what the same recipe costs with the Wgrad operands in bf16 (fp32 accumulation in cuBLAS)
        for rname in ("ufp4", "nvfp4"):
            lin = fp4.FP4Linear(IN, OUT, bias=False, recipe=rname, device=dev)
            r = lin.recipe
            fw = dataclasses.replace(fp4.get_format(r.fprop.fmt), block_2d=r.weight_2d)

            def lean():
                w = lin.weight
                rf = r.rht_size if r.fprop.rht else None
                rd = r.rht_size if r.dgrad.rht else None
                rw = r.rht_size if r.wgrad.rht else None
                wq_row, wq_col = kernels.quantize_both(w, fw, rht=rf, rht_col=rd, dtype=torch.bfloat16)
                xq = kernels.fake_quant(xin, r.fprop.fmt, rht=rf, dtype=torch.bfloat16)
                y = xq @ wq_row.t()
                dyq = kernels.fake_quant(dy, r.dgrad.fmt, rht=rd, rounding="sr", seed=1)
                dx = dyq @ wq_col
                dyc = kernels.fake_quant(dy, r.wgrad.fmt, dim=0, rht=rw, rounding="sr", seed=2)
                xc = kernels.fake_quant(xin, r.wgrad.fmt, dim=0, rht=rw, dtype=torch.bfloat16)
                dw = torch.mm(dyc.t(), xc)
                return y, dx, dw
            ms, mg = both_ways(lean)
            add("linear", f"{tag} {rname}: W both orientations in one kernel (sketch), eager", ms, "x bf16",
                ms_bf / ms, ">=0.85", f"graph replay x bf16 {mg_bf / mg:.3f}" if mg and mg_bf else "")

    section("linear", lambda: linear_bench(4096 if args.quick else 16384, 4096, 4096, "16k tok"), 40)

    def s_gpt2():
        T = 8192  # 8 x 1024 tokens
        xs = torch.randn(T, 768, device=dev).bfloat16()
        for name in ("ufp4", "nvfp4"):
            ms = bench(lambda: kernels.fake_quant(xs, name, rht=16))
            add("gpt2", f"{name} fake quant RHT16 {T}x768", ms, "xcopy", eff(ms, 4 * xs.numel()) / cbw)
        linear_bench(T, 768, 3072, "gpt2 fc")
        linear_bench(T, 3072, 768, "gpt2 proj")
        # the 8192^2 rows' targets at a GPT-2-small micro-step's activations (16k tokens)
        for width in (768, 3072):
            xg = torch.randn(16384, width, device=dev, generator=g).bfloat16()
            ng, tag = xg.numel(), f"16384x{width}"
            for name in ("ufp4", "e2m1", "nvfp4", "mxfp4"):
                ms_on = bench(lambda: kernels.fake_quant(xg, name, rht=16))
                ms_off = bench(lambda: kernels.fake_quant(xg, name))
                add("gpt2", f"{name} RHT16 row fake {tag}", ms_on, "xcopy", eff(ms_on, 4 * ng) / cbw, ">=0.80")
                add("gpt2", f"{name} RHT on/off {tag}", ms_on, "ratio", ms_on / ms_off, "<=1.05")
            for name in ("ufp4", "nvfp4"):
                ms_s = bench(lambda: kernels.fake_quant(xg, name, rht=16, rounding="sr", seed=1))
                ms_r = bench(lambda: kernels.fake_quant(xg, name, rht=16))
                add("gpt2", f"{name} SR / RTNE {tag}", ms_s, "ratio", ms_s / ms_r, "<=1.20")
            for name in ("ufp4", "nvfp4", "mxfp4"):
                ms = bench(lambda: kernels.quantize(xg, name))
                add("gpt2", f"{name} quantize -> codes+scales {tag}", ms, "xcopy",
                    eff(ms, packed_bytes(ng, name)) / cbw, ">=0.70")
        for M, N, K, tag in ((16384, 3072, 768, "fc"), (16384, 768, 3072, "proj")):
            a = torch.randn(M, K, device=dev, generator=g).bfloat16()
            b = torch.randn(N, K, device=dev, generator=g).bfloat16()
            ms_bf = bench(lambda: torch.mm(a, b.t()))
            add("gpt2", f"{tag} cuBLAS bf16 {M}x{N}x{K}", ms_bf, "TFLOP/s", 2 * M * N * K / ms_bf / 1e9)
            for name in ("ufp4", "nvfp4", "mxfp4"):
                qa, qb = gemm_operands(a, b, name)
                ms = bench(lambda: kernels.fp4_matmul(qa, qb, torch.bfloat16))
                add("gpt2", f"{tag} fp4_matmul {name} packed {M}x{N}x{K}", ms, "x bf16", ms_bf / ms, ">=0.50")
    section("gpt2", s_gpt2, 60)

    if warm:
        print(f"warm {args.warm} done in {time.time() - t_start:.0f}s")
        return
    props = torch.cuda.get_device_properties(0)
    meta = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                triton=triton.__version__, copy_tb_s=round(cbw, 3), seconds=round(time.time() - t_start, 1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernels_h200.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# kernels.py on {meta['gpu']}", "",
             f"`{meta['command']}` on {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['sms']} SMs; device copy {cbw:.2f} TB/s (bytes read + written). "
             "Each op is timed as the replay of a CUDA graph of one call (do_bench median, L2 flushed), "
             "except the linear rows' eager column. "
             "xcopy = effective bandwidth (bytes the op must read + write) / copy bandwidth.", "",
             "| section | what | ms (median) | metric | value | target | note |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = "" if r["ms"] is None else f"{r['ms']:.4f}"
        v = "" if r["value"] is None else f"{r['value']:.3f}"
        lines.append(f"| {r['section']} | {r['name']} | {ms} | {r['metric']} | {v} | {r['target']} | {r['note']} |")
    with open(os.path.join(args.out, "kernels_h200.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
