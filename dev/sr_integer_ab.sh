#!/usr/bin/env bash
# One-off A/B: SR on the E2M1 grid as integer arithmetic (kernels.py) against the float add it
# replaced (kernels_old.py, from `git show c483938:kernels.py`), in one device call:
#   OUT=$OUT bash dev/sr_integer_ab.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" out
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
for k in 0 1 2 3; do timeout 150 python3 tests/gpu/check_kernels.py --quick --part=$k/4 > "out/check_$k.log" 2>&1 & done; wait
cat out/check_[0-3].log > "$OUT/check_quick.log"; grep -h "^\[part\|^FAIL" "$OUT/check_quick.log" | tee -a "$OUT/summary.txt"
cp kernels.py kernels_new.py
swap() { cp "kernels_$1.py" kernels.py; }
for vr in "old:mxfp4 --fp8" "new:mxfp4 --fp8" "old:mxfp4 --fp8" "new:mxfp4 --fp8"; do
  v=${vr%%:*}; swap $v
  for r in "${vr#*:}"; do
    n=$(echo "$r" | tr -d ' -'); f="$OUT/quant_${n}_${v}_$SECONDS.txt"; timeout 90 python3 dev/quant_breakdown.py --recipe=$r > "$f" 2>&1
    echo "quant $r $v: $(tail -3 "$f" | tr "\n" " ")" | tee -a "$OUT/summary.txt"
  done
done
G="--compile=True --compile_mode=reduce-overhead"
for v in new old; do
  swap $v
  timeout 140 python3 bench.py configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=1 $G \
     --recipes=bf16,mxfp4+recipe_fp8_gemm=True --out=out/bench_$v > "$OUT/bench_$v.log" 2>&1
  echo "bench $v rc=$?" | tee -a "$OUT/summary.txt"; tail -8 "$OUT/bench_$v.log" | tee -a "$OUT/summary.txt"
  cp out/bench_$v/bench.md "$OUT/bench_$v.md" 2>/dev/null; cp out/bench_$v/bench.json "$OUT/bench_$v.json" 2>/dev/null
done
swap new
echo ===; cat "$OUT/summary.txt"
