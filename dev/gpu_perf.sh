#!/bin/bash
# The throughput and memory table of docs/performance.md on a 2-GPU machine (about 7 minutes): every recipe against
# bf16 under CUDA graphs (compile_mode=reduce-overhead), dense and MoE, plus a kernel-time profile,
# the per-operand quantize times, what is alive at the dense model's memory peak and the quick
# kernel check (bit-exactness at real sizes).
# Each GPU runs its own bench.py with its own bf16 baseline (ratios are within one process).
#   bash dev/gpu_perf.sh OUT_DIR
set -u
OUT=${1:?usage: gpu_perf.sh OUT_DIR}
mkdir -p "$OUT"
G="--compile=True --compile_mode=reduce-overhead --warmup=6 --iters=10"
(
  CUDA_VISIBLE_DEVICES=0 python bench.py configs/gpu/gpt2_small_bf16.py --recipes=bf16,ufp4,nvfp4 $G \
    --out="$OUT/dense_a" > "$OUT/dense_a.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 python scripts/profile_step.py configs/gpu/gpt2_small_bf16.py \
    --recipes=bf16,ufp4,nvfp4 --compile --compile_mode=reduce-overhead > "$OUT/profile_graphs.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 python dev/quant_breakdown.py --recipe=ufp4 > "$OUT/quant_breakdown_ufp4.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 python scripts/memory_breakdown.py configs/gpu/gpt2_small_bf16.py \
    --recipes=bf16,ufp4 --top=15 > "$OUT/memory_dense.txt" 2>&1
) &
(
  CUDA_VISIBLE_DEVICES=1 python bench.py configs/gpu/gpt2_small_bf16.py --recipes=bf16,e2m1,mxfp4 $G \
    --out="$OUT/dense_b" > "$OUT/dense_b.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 python bench.py configs/gpu/moe_gpt2_small_bf16.py --recipes=bf16,ufp4 $G \
    --out="$OUT/moe" > "$OUT/moe.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 python tests/gpu/check_kernels.py --quick > "$OUT/gpu_check_kernels_quick.txt" 2>&1
) &
wait
# flat, few files (the device tool brings back at most 8): the benches' json in one file, their md
# tables in one, their logs in one; bench.py's run folders go (checkpoints of hundreds of MB)
python - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
runs = {f: json.load(open(os.path.join(out, f, "bench.json"))) for f in ("dense_a", "dense_b", "moe")
        if os.path.exists(os.path.join(out, f, "bench.json"))}
json.dump(runs, open(os.path.join(out, "bench.json"), "w"), indent=1)
PY
: > "$OUT/bench.md"
: > "$OUT/bench_logs.txt"
for f in dense_a dense_b moe; do
  { cat "$OUT/$f/bench.md" 2>/dev/null || tail -5 "$OUT/$f.log"; echo; } >> "$OUT/bench.md"
  { echo "=== $f"; cat "$OUT/$f.log"; } >> "$OUT/bench_logs.txt"
  rm -rf "$OUT/$f" "$OUT/$f.log"
done
cat "$OUT/bench.md"
tail -5 "$OUT/profile_graphs.txt"
tail -1 "$OUT/quant_breakdown_ufp4.txt"
tail -4 "$OUT/memory_dense.txt"
tail -1 "$OUT/gpu_check_kernels_quick.txt"
