#!/usr/bin/env bash
# The FP8-GEMM measurements of docs/performance.md on one H200, in one go (about 8 minutes):
#   1. the FP8 checks of tests/gpu/check_kernels.py (operands bit for bit, GEMM exactness, layer)
#   2. dense GPT-2-small: bf16, the power-of-two-scaled recipes on FP8 GEMMs, mxfp4 on bf16 GEMMs, ufp4
#   3. the wide model (configs/gpu/wide_gpt_bf16.py), where the GEMMs dominate
#   4. the MoE (its experts stay on bf16 GEMMs; attention's linears take FP8)
# Usage: OUT=results/bench bash dev/gpu_fp8.sh   (needs data/literature prepared: no network there)
set -uo pipefail
OUT=${OUT:-results/bench}
mkdir -p "$OUT" out
export PYTHONUNBUFFERED=1
G="--compile=True --compile_mode=reduce-overhead"
one() {  # name, seconds, then bench.py arguments
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 bench.py "$@" $G --out="out/bench_$name" > "out/bench_$name.log" 2>&1
    echo "== $name rc=$?"; grep -E "Error|error" "out/bench_$name.log" | tail -3
    cp "out/bench_$name/bench.md" "$OUT/$name.md" 2>/dev/null
    cp "out/bench_$name/bench.json" "$OUT/$name.json" 2>/dev/null
}
timeout 120 python3 tests/gpu/check_kernels.py --quick --only=fp8 2>&1 | tail -8
one fp8_gemm_dense 200 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 \
    --recipes=bf16,mxfp4,mxint4,ufp4+recipe_format=int4/16/e8m0,mxfp4+recipe_fp8_gemm=False,ufp4
one fp8_gemm_wide 160 configs/gpu/wide_gpt_bf16.py --warmup=3 --iters=6 --recipes=bf16,mxfp4,mxint4,ufp4
one fp8_gemm_moe 120 configs/gpu/moe_gpt2_small_bf16.py --warmup=5 --iters=8 --recipes=bf16,mxfp4,ufp4
cat "$OUT"/fp8_gemm_*.md
