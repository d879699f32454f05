"""Why the same kernel's time moves between runs: one process times four launches (device copy,
UFP4 and MXFP4 packed row quantize, UFP4 RHT16 fake quant; 8192^2 bf16) by three methods, eight
rounds each, while nvidia-smi logs clocks and power beside it; then the UFP4 packed quantize eight
more times on a fresh copy of x after a spacer allocation (meant to move x; the caching allocator
gave the copy the same block every time, so these are eight repeats at one address; their do_bench
figures are means, the default return mode).
  methods: dobench = triton do_bench median (bench_kernels.py's: L2 flushed, one Python call per
  timed launch); graph10 = a CUDA graph of 10 back-to-back calls, replayed 20 times, per call
  (no host, no flush); dobench_graph = do_bench of a one-call graph (flush, no host).
Run from the repo root: python results/perf/session9/spread.py [OUT_DIR]"""
import datetime, json, os, subprocess, sys, time
import torch, triton
from triton.testing import do_bench
sys.path[:0] = ["."]
import kernels
from bench_kernels import graphed

out = sys.argv[1] if len(sys.argv) > 1 else "."
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                        "clocks_throttle_reasons.active", "--format=csv", "-lms", "50"],
                       stdout=open(os.path.join(out, "smi.csv"), "w"), stderr=subprocess.STDOUT)
print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC {torch.cuda.get_device_name()} "
      f"torch {torch.__version__} triton {triton.__version__}", flush=True)
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
launches = {"copy": lambda: x.clone(),
            "ufp4 packed row": lambda: kernels.quantize(x, "ufp4"),
            "mxfp4 packed row": lambda: kernels.quantize(x, "mxfp4"),
            "ufp4 fake RHT16": lambda: kernels.fake_quant(x, "ufp4", rht=16)}


def graph(f, n):
    """n back-to-back calls of f in one CUDA graph: its replay (at the run, this file had its own
    copy of bench_kernels.graphed's capture)."""
    return graphed(lambda: [f() for _ in range(n)])


def graph10(g):
    g()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        g()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 200


graphs = {k: (graph(f, 10), graph(f, 1)) for k, f in launches.items()}
rows = []
t0 = time.time()
for rnd in range(8):
    for name, f in launches.items():
        g10, g1 = graphs[name]
        r = dict(round=rnd, name=name, t=round(time.time() - t0, 2),
                 dobench=do_bench(f, warmup=25, rep=200, return_mode="median"),
                 graph10=graph10(g10),
                 dobench_graph=do_bench(g1, warmup=25, rep=200, return_mode="median"))
        rows.append(r)
        print(rnd, f"{name:18s} t={r['t']:6.1f}s dobench {r['dobench']:.4f}  graph10 {r['graph10']:.4f}  "
              f"dobench_graph {r['dobench_graph']:.4f} ms", flush=True)
# placement: x at eight addresses (spacers of 0..7 x 2 MiB + 64 KiB ahead of it)
del graphs
place = []
for k in range(8):
    spacer = torch.empty(k * (2 << 20) + (64 << 10), dtype=torch.uint8, device="cuda")
    xk = x.clone()
    f = lambda: kernels.quantize(xk, "ufp4")
    g10 = graph(f, 10)
    ts = [graph10(g10) for _ in range(3)]
    place.append(dict(k=k, x_ptr=hex(xk.data_ptr()), ms=ts, dobench=do_bench(f, warmup=25, rep=200)))
    print("place", k, hex(xk.data_ptr()), " ".join(f"{t:.4f}" for t in ts), f"dobench {place[-1]['dobench']:.4f}", flush=True)
    del g10, xk, spacer
smi.terminate()
json.dump(dict(rows=rows, place=place), open(os.path.join(out, "spread.json"), "w"), indent=1)
print("| launch | method | min ms | median ms | max ms | max/min |")
print("|---|---|---|---|---|---|")
for name in launches:
    for m in ("dobench", "graph10", "dobench_graph"):
        v = sorted(r[m] for r in rows if r["name"] == name)
        print(f"| {name} | {m} | {v[0]:.4f} | {v[len(v) // 2]:.4f} | {v[-1]:.4f} | {v[-1] / v[0]:.2f} |")
