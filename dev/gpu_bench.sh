#!/usr/bin/env bash
# Training throughput and peak memory per recipe on one H200 (docs/performance.md): GPT-2-small-sized dense
# model (eager, and torch.compile without CUDA graphs for bf16/ufp4) and its MoE of similar active
# size. The CUDA-graph table (the configs' default compile_mode) is dev/gpu_perf.sh.
# Usage: OUT=results/bench bash dev/gpu_bench.sh   (needs data/shakespeare prepared)
set -uo pipefail
OUT=${OUT:-results/bench}
mkdir -p "$OUT" out
export PYTHONUNBUFFERED=1
B="--dataset=shakespeare --warmup=5 --iters=10"
one() {  # name, seconds, then bench.py arguments
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 bench.py "$@" --out="out/bench_$name" $B > "out/bench_$name.log" 2>&1
    echo "== $name rc=$?" >> "$OUT/bench.log"; tail -15 "out/bench_$name.log" >> "$OUT/bench.log"
    cp "out/bench_$name/bench.md" "$OUT/$name.md" 2>/dev/null
    cp "out/bench_$name/bench.json" "$OUT/$name.json" 2>/dev/null
}
one dense_eager 170 configs/gpu/gpt2_small_bf16.py --recipes=bf16,ufp4,e2m1,nvfp4,mxfp4 --compile=False
one dense_compile 170 configs/gpu/gpt2_small_bf16.py --recipes=bf16,ufp4 --compile=True --compile_mode=default
one moe_eager 140 configs/gpu/moe_gpt2_small_bf16.py --recipes=bf16,ufp4,nvfp4 --compile=False
cat "$OUT"/*.md
