#!/bin/bash
# Issue 6's throughput and memory table on a 2-GPU machine (about 7 minutes): every recipe against
# bf16 under CUDA graphs (compile_mode=reduce-overhead), dense and MoE, plus a kernel-time profile,
# the per-operand quantize times and the quick kernel check (bit-exactness at real sizes).
# Each GPU runs its own bench.py with its own bf16 baseline (ratios are within one process).
#   bash scripts/gpu_perf.sh OUT_DIR
set -u
OUT=${1:?usage: gpu_perf.sh OUT_DIR}
mkdir -p "$OUT"
G="--compile=True --compile_mode=reduce-overhead --warmup=6 --iters=10"
(
  CUDA_VISIBLE_DEVICES=0 python bench.py configs/gpu/gpt2_small_bf16.py --recipes=bf16,ufp4,nvfp4 $G \
    --out="$OUT/dense_a" > "$OUT/dense_a.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 python scripts/profile_step.py configs/gpu/gpt2_small_bf16.py \
    --recipes=bf16,ufp4,nvfp4 --compile --compile_mode=reduce-overhead > "$OUT/profile_graphs.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 python scripts/quant_breakdown.py --recipe=ufp4 > "$OUT/quant_breakdown_ufp4.txt" 2>&1
) &
(
  CUDA_VISIBLE_DEVICES=1 python bench.py configs/gpu/gpt2_small_bf16.py --recipes=bf16,e2m1,mxfp4 $G \
    --out="$OUT/dense_b" > "$OUT/dense_b.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 python bench.py configs/gpu/moe_gpt2_small_bf16.py --recipes=bf16,ufp4 $G \
    --out="$OUT/moe" > "$OUT/moe.log" 2>&1
  CUDA_VISIBLE_DEVICES=1 python tests/gpu_check_kernels.py --quick > "$OUT/gpu_check_kernels_quick.txt" 2>&1
) &
wait
# flat, few files (the device tool brings back at most 8): each bench's json + md, one log, drop
# bench.py's run folders (checkpoints of hundreds of MB, per-recipe logs)
: > "$OUT/bench.md"
: > "$OUT/bench_logs.txt"
for f in dense_a dense_b moe; do
  cp "$OUT/$f/bench.json" "$OUT/bench_$f.json" 2>/dev/null
  { cat "$OUT/$f/bench.md" 2>/dev/null || tail -5 "$OUT/$f.log"; echo; } >> "$OUT/bench.md"
  { echo "=== $f"; cat "$OUT/$f.log"; } >> "$OUT/bench_logs.txt"
  rm -rf "$OUT/$f" "$OUT/$f.log"
done
cat "$OUT/bench.md"
tail -5 "$OUT/profile_graphs.txt"
tail -1 "$OUT/quant_breakdown_ufp4.txt"
tail -1 "$OUT/gpu_check_kernels_quick.txt"
