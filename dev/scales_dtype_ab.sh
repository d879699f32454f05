#!/usr/bin/env bash
# One-off A/B (GPU): block scales of e8m0 formats stored as bf16 (this tree) against fp32 (tree
# 5cc59e9, its fp4.py and kernels.py copied beside as tmp_old_fp4.py / tmp_old_kernels.py), on
# the dense FP8 path: profile_step once per tree, then bench.py one round per process, trees
# alternating old, new, old, new. Needs data/literature prepared. Output under $OUT.
#   git show 5cc59e9:fp4.py > tmp_old_fp4.py; git show 5cc59e9:kernels.py > tmp_old_kernels.py
#   OUT=out/ab bash dev/scales_dtype_ab.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" out /tmp/old
cp -r $(ls -A | grep -v '^out$\|^.git$') /tmp/old/ && cp tmp_old_fp4.py /tmp/old/fp4.py && cp tmp_old_kernels.py /tmp/old/kernels.py
F=recipe_fp8_gemm=True
here=$(pwd)
tree_dir() { [ "$1" = old ] && echo /tmp/old || echo "$here"; }
for tree in old new; do
    d=$(tree_dir $tree)
    (cd "$d" && PYTHONPATH="$d" timeout 120 python3 scripts/profile_step.py configs/gpu/gpt2_small_bf16.py \
        --recipes=mxfp4+$F --compile --compile_mode=reduce-overhead > "$here/out/prof_$tree.txt" 2>&1)
done
for tree in old new old new; do
    d=$(tree_dir $tree)
    (cd "$d" && PYTHONPATH="$d" timeout 150 python3 bench.py configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 \
        --rounds=1 --compile=True --compile_mode=reduce-overhead --recipes=bf16,mxfp4+$F,mxint4+$F \
        --out=out/ab_$tree > /dev/null 2>&1)
    grep "^| " "$d/out/ab_$tree/bench.md" | tail -3 | sed "s/^/$tree /" >> "$OUT/scales_ab.txt"
done
{ cat out/prof_old.txt; echo "===== new"; cat out/prof_new.txt; } > "$OUT/profile_ab.txt"
cat "$OUT/scales_ab.txt"
