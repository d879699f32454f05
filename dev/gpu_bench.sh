#!/usr/bin/env bash
# Training throughput and peak memory per recipe on one H200 (docs/performance.md), by set:
#   recipes  the GPT-2-small-sized dense model (eager, and torch.compile without CUDA graphs for
#            bf16/ufp4) and its MoE of similar active size; the CUDA-graph table is dev/gpu_perf.sh
#   fp8      the FP8-GEMM checks of tests/gpu/check_kernels.py, then the CUDA-graph table of
#            mxfp4 and mxint4 on FP8 GEMMs (opt-in: recipe_fp8_gemm=True), Wgrad's x kept packed
#            and as FP8 (recipe_fp8_wgrad_x=fp8), dense GPT-2 small (about 310 s)
#   fp8_unit_x  the checks of the given FP8 scale (to_fp8, the layer), then dense GPT-2 small's
#            mxfp4 with Fprop's x scaled by its amax (the default) and at unit scale, no amax pass
#            (recipe_fp8_x_scale=unit), the same for the MoE, then the checks set's 300-step
#            telemetry run at unit scale (234 s without the MoE table on a fresh H100, which took
#            172 s more)
#   fp8_unit_x_wide, fp8_unit_x_mxint4  the same table (no checks) for the wide 24 x 2048 model,
#            and for dense GPT-2 small's mxint4 (its Fprop has the RHT)
#   fp8_combo  the fastest combinations measured one by one, together: dense GPT-2 small's mxfp4
#            and mxint4 with x at unit scale, each with Wgrad's x kept packed and as FP8; then a
#            second table of bf16, ufp4, and mxfp4 on FP8 GEMMs with x scaled by its amax (the
#            default) and at unit scale (187 + 129 s on a fresh H200)
#   fp8_combo_moe_wide  the same combination for the MoE (mxfp4 at unit scale with all three
#            GEMMs in fast accumulation, and ufp4) and for the wide 24 x 2048 model (mxfp4 at unit
#            scale) against bf16 (198 + 190 s on a warm H200)
#   fp8_weight_cache  the GPU check of the cached weight (FP8 and packed, recipe_fp8_weight_cache),
#            then the wide 24 x 2048 model's bf16 and mxfp4 at unit scale with its weights cached as
#            FP8 (the default) and packed (356 s on a fresh H100)
#   fp8_dy_step  the check of dy's FP8 scale kept for the optimizer step (recipe_fp8_dy_scale=step),
#            then the MoE's bf16 and mxfp4 (x at unit scale, all three GEMMs fast) with dy's scale
#            found in every call and kept per step, then dense GPT-2 small's mxint4 and mxfp4 (x at
#            unit scale) the same two ways (about 430 s on a warm H100)
#   fp8_dy_step_window  dy's blocks out of the FP8 window in 21 steps of dense GPT-2 small (mxfp4,
#            x at unit scale, telemetry at steps 0, 10 and 20), dy's scale per call and per step
#   bars_dense, bars_moe, bars_wide  the speed bars (docs/performance.md) in one run per model:
#            bf16, ufp4 (dense and MoE), and the fastest opt-in combinations on FP8 GEMMs (x at
#            unit scale, dy's scale kept per step; the dense mxint4 also with Wgrad's x as FP8, the
#            MoE with all three GEMMs fast, the wide model also with its weights cached packed);
#            bars_dense first runs the GPU check of the step scale
#   fp8_dy_step_long  dy's blocks out of the FP8 window over the 300-step small run at 4096 tokens
#            a micro-step (4 micro-steps a step), dy's scale per call and per step, at once on one
#            GPU (each cut at CUT seconds, default 280; SEED, default train.py's), and the steps
#            each skipped (about 145 s on a warm H100)
#   fp8_dy_step_rooms  the same run with dy's scale per step at each room of ROOMS (default "4 6
#            8"; recipe_fp8_step_room) at once, and the steps each skipped (SEED and CUT as above;
#            about 140 s for 4 rooms on a warm H100)
#   loss_chunk  the check of the training loss in chunks (model.linear_cross_entropy), then dense
#            GPT-2 small's bf16 and mxfp4 on FP8 GEMMs with lm_head's logits whole (loss_chunk=0)
#            and in chunks (the default), and bf16 in chunks of 2048
#   loss_chunk_recipes  dense GPT-2 small in chunks: bf16 and the recipes on bf16 GEMMs
#   loss_chunk_moe  the MoE's bf16 whole and in chunks, ufp4 and mxfp4 on FP8 GEMMs in chunks
#   loss_chunk_pairs  paired 300-step runs of configs/gpu/ablate_gpt.py, seeds 1-4, bf16 and mxfp4
#            on FP8 GEMMs, each with whole logits, chunks of 4096 and of 2048 (the last pair
#            differs in the order of the sums alone: the noise the first pair is read against);
#            six runs at once (each cut at 140 s; about 70 s a batch on an H100), then a table of
#            the val losses at iter 300 (empty where a run did not get there)
#   fp8_window_unit  blocks out of the FP8 window with x at unit scale for mxfp4 (whose window's
#            bottom is twice mxint4's): the 300-step run of the checks set, and up to 250 steps of dense
#            GPT-2 small (compile_mode=default, which telemetry needs), at once on one GPU, each cut
#            at CUT seconds (default 240; log.jsonl keeps the telemetry steps reached)
#   quant_bound  dev/quant_breakdown.py's quantize calls of a GPT-2-small block against the same
#            bytes at copy speed, for ufp4 and for mxfp4 (x scaled by its amax and at unit
#            scale) and mxint4 on FP8 GEMMs (68 s on a warm H100)
#   quant_bound_bench  the dense bench.py table that goes with it: bf16, ufp4, mxfp4 and mxint4
#            on FP8 GEMMs, two rounds
#   quant_bound_moe  the same two for the MoE (its experts' grouped layers): ufp4 and mxfp4 on
#            FP8 GEMMs against bf16 (about 6 minutes on an H100)
#   fp8_e8m0 the same for UFP4's recipe on 1x16 power-of-two scales (int4/16/e8m0) and mxint4
#   fp8_wide the table (no check) of the wide 24 x 2048 model where the GEMMs dominate: bf16 and
#            mxfp4 on FP8 GEMMs, x packed and as FP8 (331 s on a fresh H100; each recipe compiles
#            for about 40 s a round, so a fourth, mxint4, passed the 560 s limit on a fresh
#            machine: it ran at mxfp4's speed, results/bench/fp8_gemm_wide.md)
#   fp8_moe  the table of the MoE: ufp4, mxfp4 and mxint4 on FP8 GEMMs, and mxfp4 with all three
#            GEMMs in fast accumulation (five recipes in two rounds: close to the 10-minute limit)
#   fp8_medium, fp8_large  bf16 against mxfp4 on FP8 GEMMs at GPT-2 medium (24 x 1024) and large
#            (36 x 1280) sizes: between GPT-2 small and the wide model, where FP8 GEMMs start to pay
#   fp8_moe_large, fp8_moe_wide  the same for the MoE at GPT-2 large's size and at the wide
#            model's (8 experts of hidden 2560 and 4096, top-2); the wide one needs an H200's
#            memory (on an H100 bf16 ran out at its first AdamW step)
#   checks   the torch.compile check (tests/gpu/check_compile.py, the wide model's repeatability
#            included), then blocks out of the FP8 window in a 300-step mxint4 run (telemetry,
#            eager; results/kernels/fp8_window.md): about 6 minutes
#   memory   scripts/memory_breakdown.py's peaks (what is alive there, by allocating line): bf16
#            and ufp4 for the MoE and the dense GPT-2 small, bf16 and mxfp4 on FP8 GEMMs for the
#            wide model (results/profile/memory_moe_ufp4.txt, memory_dense.txt, memory_wide.txt;
#            131, 85 and 171 s on a warm H100)
#   kernels  tests/gpu/check_kernels.py, --quick then at full size, each split over 4 processes
#            that compile at once (--part=k/4; the quick check took 55 s so, 200+ s in one)
# The FP8 tables run their recipe list forward and back (--rounds=2: a recipe that runs after
# another in one process ran up to 4.7 % slower, results/bench/order_effect.md); each set is
# meant for one device call (at most 10 minutes; in two rounds, a call with three dense recipes
# and a short probe took 164 s, one with the wide pair at --iters=4 and a probe 325 s).
# Usage: OUT=results/bench bash dev/gpu_bench.sh [recipes|fp8|fp8_unit_x|fp8_unit_x_wide|fp8_unit_x_mxint4|fp8_combo|fp8_combo_moe_wide|fp8_weight_cache|fp8_dy_step|fp8_dy_step_window|bars_dense|bars_moe|bars_wide|fp8_dy_step_long|fp8_dy_step_rooms|loss_chunk|loss_chunk_recipes|loss_chunk_moe|loss_chunk_pairs|quant_bound|quant_bound_bench|quant_bound_moe|fp8_window_unit|fp8_e8m0|fp8_wide|fp8_medium|fp8_large|fp8_moe_large|fp8_moe_wide|fp8_moe|checks|memory|kernels]
#   (needs data/shakespeare (recipes) or data/literature (fp8) prepared: no network there)
set -uo pipefail
set_name=${1:-recipes}
OUT=${OUT:-results/bench}
mkdir -p "$OUT" out
export PYTHONUNBUFFERED=1
one() {  # name, seconds, then bench.py arguments
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 bench.py "$@" --out="out/bench_$name" > "out/bench_$name.log" 2>&1
    echo "== $name rc=$?" >> "$OUT/bench.log"; tail -15 "out/bench_$name.log" >> "$OUT/bench.log"
    cp "out/bench_$name.log" "$OUT/$name.log"   # whole: a run cut by its limit keeps its finished recipes
    cp "out/bench_$name/bench.md" "$OUT/$name.md" 2>/dev/null
    cp "out/bench_$name/bench.json" "$OUT/$name.json" 2>/dev/null
}
train_run() {  # name, seconds, config, then train.py flags: its log, and log.jsonl (telemetry)
    local name=$1 limit=$2 config=$3; shift 3
    rm -f "out/$name/log.jsonl"   # (a kept machine's earlier run)
    timeout "$limit" python3 train.py "$config" "$@" --out_dir="out/$name" --overwrite=True > "$OUT/$name.log" 2>&1
    echo "== $name rc=$? (124: cut at $limit s): $(tail -1 "$OUT/$name.log")" >> "$OUT/bench.log"
    cp "out/$name/log.jsonl" "$OUT/${name}_log.jsonl" 2>/dev/null
}
quant_calls() {  # dev/quant_breakdown.py once per argument (its recipe and flags): each table, and its last line
    local args name
    for args in "$@"; do
        name=quant_$(echo "$args" | sed 's/ --fp8_x_scale=unit/_unit_x/; s/ --fp8/_fp8/; s/ --moe/_moe/')
        timeout 90 python3 dev/quant_breakdown.py --recipe=$args > "$OUT/$name.txt" 2>&1
        echo "== $name rc=$?: $(tail -1 "$OUT/$name.txt")" | tee -a "$OUT/bench.log"
    done
}
G="--compile=True --compile_mode=reduce-overhead"; F=recipe_fp8_gemm=True; X=recipe_fp8_wgrad_x=fp8
U=recipe_fp8_x_scale=unit; A=recipe_fp8_fast_accum=all; S=recipe_fp8_dy_scale=step
# the 300-step eager telemetry run of the small model (blocks out of the FP8 window)
SMALL="configs/gpu/ablate_gpt.py --max_iters=300 --telemetry_interval=100 --eval_interval=300 --eval_iters=2"
# that run at 4096 tokens a micro-step (4 micro-steps a step), mxfp4 on FP8 GEMMs with x at unit scale
LONG="$SMALL --batch_size=8 --gradient_accumulation_steps=4 ${SEED:+--seed=$SEED} --recipe=mxfp4 --$F --$U"
skipped() {  # a train_run log -> how many steps it skipped, and at which iters
    echo "$(grep -c 'step skipped' "$1") steps skipped $(grep -o '^iter [0-9]*: non-finite' "$1" | cut -d: -f1 | tr '\n' ' ')"
}
case $set_name in
recipes)
    B="--dataset=shakespeare --warmup=5 --iters=10"
    one dense_eager 170 configs/gpu/gpt2_small_bf16.py --recipes=bf16,ufp4,e2m1,nvfp4,mxfp4 --compile=False $B
    one dense_compile 170 configs/gpu/gpt2_small_bf16.py --recipes=bf16,ufp4 --compile=True --compile_mode=default $B
    one moe_eager 140 configs/gpu/moe_gpt2_small_bf16.py --recipes=bf16,ufp4,nvfp4 --compile=False $B ;;
fp8)
    timeout 150 python3 tests/gpu/check_kernels.py --quick --only=fp8 > "$OUT/check_fp8.log" 2>&1
    tail -16 "$OUT/check_fp8.log"
    one fp8_gemm_dense 420 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F,mxfp4+$F+$X,mxint4+$F,mxint4+$F+$X ;;
fp8_unit_x)
    for only in "given scale" "unit scale"; do
        timeout 150 python3 tests/gpu/check_kernels.py --quick --only="$only" >> "$OUT/check_unit_x.log" 2>&1
    done
    grep -h "^ok \|FAIL\|checks passed" "$OUT/check_unit_x.log"
    one fp8_gemm_unit_x 300 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F,mxfp4+$F+$U
    one fp8_gemm_unit_x_moe 300 configs/gpu/moe_gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F,mxfp4+$F+$U
    # x's blocks out of the unit scale's window in a real run (telemetry; as the checks set's)
    train_run fp8_window_unit 240 $SMALL --recipe=mxint4 --$F --$U ;;
fp8_unit_x_wide)
    one fp8_gemm_unit_x_wide 560 configs/gpu/wide_gpt_bf16.py --warmup=3 --iters=4 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F,mxfp4+$F+$U ;;
fp8_combo)
    one fp8_gemm_combo 400 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F+$U,mxfp4+$F+$U+$X,mxint4+$F+$U,mxint4+$F+$U+$X
    one fp8_gemm_combo_defaults 190 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,ufp4,mxfp4+$F,mxfp4+$F+$U ;;
fp8_combo_moe_wide)
    one fp8_gemm_combo_moe 280 configs/gpu/moe_gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F+$U+$A,ufp4
    one fp8_gemm_combo_wide 280 configs/gpu/wide_gpt_bf16.py --warmup=3 --iters=4 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F+$U ;;
fp8_weight_cache)
    timeout 100 python3 tests/gpu/check_kernels.py --quick --only="cached weight" > "$OUT/check_cached.log" 2>&1
    grep -h "^ok \|FAIL\|checks passed" "$OUT/check_cached.log"
    one fp8_weight_cache_wide 340 configs/gpu/wide_gpt_bf16.py --warmup=3 --iters=4 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F+$U,mxfp4+$F+$U+recipe_fp8_weight_cache=packed ;;
fp8_dy_step)
    timeout 100 python3 tests/gpu/check_kernels.py --quick --only="kept for the step" > "$OUT/check_dy_step.log" 2>&1
    grep -h "^ok \|FAIL\|checks passed" "$OUT/check_dy_step.log"
    one fp8_dy_step_moe 260 configs/gpu/moe_gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F+$U+$A,mxfp4+$F+$U+$A+$S
    one fp8_dy_step_dense 300 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,mxint4+$F+$U,mxint4+$F+$U+$S,mxfp4+$F+$U,mxfp4+$F+$U+$S ;;
fp8_dy_step_window)
    for how in amax step; do
        train_run fp8_dy_window_$how 200 configs/gpu/gpt2_small_bf16.py --recipe=mxfp4 --$F \
            --$U --recipe_fp8_dy_scale=$how --max_iters=21 --warmup_iters=1 \
            --telemetry_interval=10 --compile_mode=default --eval_interval=100000 --eval_iters=1
    done ;;
bars_dense)
    timeout 100 python3 tests/gpu/check_kernels.py --quick --only="kept for the step" > "$OUT/check_dy_step.log" 2>&1
    grep -h "^ok \|FAIL\|checks passed" "$OUT/check_dy_step.log"
    one bars_dense 460 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,ufp4,mxfp4+$F+$U+$S,mxint4+$F+$U+$S,mxint4+$F+$U+$S+$X ;;
bars_moe)
    one bars_moe 560 configs/gpu/moe_gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,ufp4,mxfp4+$F+$U+$A+$S ;;
bars_wide)
    one bars_wide 560 configs/gpu/wide_gpt_bf16.py --warmup=3 --iters=4 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F+$U+$S,mxfp4+$F+$U+$S+recipe_fp8_weight_cache=packed ;;
fp8_dy_step_long)
    for how in amax step; do
        train_run fp8_dy_long_$how "${CUT:-280}" $LONG --recipe_fp8_dy_scale=$how &
    done
    wait
    for how in amax step; do
        echo "$how: $(skipped "$OUT/fp8_dy_long_$how.log")" | tee -a "$OUT/bench.log"
    done ;;
fp8_dy_step_rooms)
    rooms=${ROOMS:-4 6 8}
    for room in $rooms; do
        train_run fp8_dy_room$room "${CUT:-280}" $LONG --$S --recipe_fp8_step_room=$room &
    done
    wait
    for room in $rooms; do
        echo "room $room: $(skipped "$OUT/fp8_dy_room$room.log")" | tee -a "$OUT/bench.log"
    done ;;
loss_chunk)
    timeout 150 python3 tests/gpu/check_kernels.py --only="loss in chunks" > "$OUT/check_loss.log" 2>&1
    tail -4 "$OUT/check_loss.log"
    L=loss_chunk=0
    one loss_chunk_dense 420 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16+$L,bf16,bf16+loss_chunk=2048,mxfp4+$F+$L,mxfp4+$F ;;
loss_chunk_recipes)
    one loss_chunk_recipes 500 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,ufp4,e2m1,nvfp4,mxfp4 ;;
loss_chunk_moe)
    one loss_chunk_moe 560 configs/gpu/moe_gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16+loss_chunk=0,bf16,ufp4,mxfp4+$F ;;
loss_chunk_pairs)
    P="configs/gpu/ablate_gpt.py --max_iters=300 --eval_interval=300 --eval_iters=20 --telemetry_interval=0"
    for seed in 1 2 3 4; do
        for lc in 0 4096 2048; do
            for r in bf16 mxfp4; do
                flag=$([ $r = mxfp4 ] && echo --$F)
                train_run pair_${r}_s${seed}_lc$lc 140 $P --recipe=$r $flag --loss_chunk=$lc --seed=$seed &
            done
        done
        wait
    done
    for r in bf16 mxfp4; do for seed in 1 2 3 4; do
        v=(); for lc in 0 4096 2048; do
            v+=("$(grep -o 'eval iter 300: .*val loss [0-9.]*' "$OUT/pair_${r}_s${seed}_lc$lc.log" | grep -o '[0-9.]*$')")
        done
        echo "$r seed $seed  whole ${v[0]}  chunks4096 ${v[1]}  chunks2048 ${v[2]}" | tee -a "$OUT/bench.log"
    done; done ;;
quant_bound)
    quant_calls "ufp4" "mxfp4 --fp8" "mxfp4 --fp8 --fp8_x_scale=unit" "mxint4 --fp8" ;;
quant_bound_bench)
    one quant_bound_dense 500 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,ufp4,mxfp4+$F,mxint4+$F ;;
quant_bound_moe)
    quant_calls "ufp4 --moe" "mxfp4 --fp8 --moe"
    one quant_bound_moe 400 configs/gpu/moe_gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,ufp4,mxfp4+$F ;;
fp8_window_unit)
    W="--recipe=mxfp4 --$F --$U"
    train_run fp8_window_unit_mxfp4 "${CUT:-240}" $SMALL $W &
    train_run fp8_window_unit_gpt2 "${CUT:-240}" configs/gpu/gpt2_small_bf16.py $W --compile_mode=default \
        --max_iters=250 --telemetry_interval=50 --eval_interval=250 --eval_iters=2
    wait ;;
fp8_unit_x_mxint4)
    one fp8_gemm_unit_x_mxint4 300 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,mxint4+$F,mxint4+$F+$U ;;
fp8_e8m0)
    one fp8_gemm_int4_16_e8m0 420 configs/gpu/gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,ufp4+recipe_format=int4/16/e8m0+$F,mxint4+$F ;;
fp8_wide)
    one fp8_gemm_wide 560 configs/gpu/wide_gpt_bf16.py --warmup=3 --iters=4 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F,mxfp4+$F+$X ;;
fp8_medium)
    one fp8_gemm_medium 560 configs/gpu/wide_gpt_bf16.py --n_layer=24 --n_embd=1024 --n_head=16 \
        --batch_size=16 --gradient_accumulation_steps=8 --warmup=3 --iters=6 --rounds=2 $G --recipes=bf16,mxfp4+$F ;;
fp8_large)
    one fp8_gemm_large 560 configs/gpu/wide_gpt_bf16.py --n_layer=36 --n_embd=1280 --n_head=20 \
        --warmup=3 --iters=4 --rounds=2 $G --recipes=bf16,mxfp4+$F ;;
fp8_moe_large)
    one fp8_gemm_moe_large 560 configs/gpu/moe_gpt2_small_bf16.py --n_layer=36 --n_embd=1280 --n_head=20 \
        --expert_hidden=2560 --batch_size=8 --gradient_accumulation_steps=16 --warmup=3 --iters=4 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F ;;
fp8_moe_wide)
    one fp8_gemm_moe_wide 560 configs/gpu/moe_gpt2_small_bf16.py --n_layer=24 --n_embd=2048 --n_head=16 \
        --expert_hidden=4096 --batch_size=8 --gradient_accumulation_steps=16 --warmup=2 --iters=3 --rounds=2 $G \
        --recipes=bf16,mxfp4+$F ;;
fp8_moe)
    one fp8_gemm_moe 580 configs/gpu/moe_gpt2_small_bf16.py --warmup=5 --iters=8 --rounds=2 $G \
        --recipes=bf16,ufp4,mxfp4+$F,mxint4+$F,mxfp4+$F+$A ;;
checks)
    timeout 300 python3 tests/gpu/check_compile.py > "$OUT/check_compile.log" 2>&1
    grep -h "FAIL\|ALL PASS\|FAILED" "$OUT/check_compile.log"
    train_run fp8_window 240 $SMALL --recipe=mxint4 --$F ;;
memory)
    for m in moe_gpt2_small:ufp4 gpt2_small:ufp4 wide_gpt:mxfp4+$F; do
        timeout 250 python3 scripts/memory_breakdown.py configs/gpu/${m%%:*}_bf16.py --recipes=bf16,${m#*:} \
            --compile_mode=reduce-overhead > "$OUT/memory_${m%%:*}.txt" 2>&1
        echo "== memory_${m%%:*} rc=$?: $(grep -m1 -F "| ${m#*:} |" "$OUT/memory_${m%%:*}.txt")" | tee -a "$OUT/bench.log"
    done ;;
kernels)
    for size in quick full; do
        flag=$([ $size = quick ] && echo --quick)
        for k in 0 1 2 3; do
            timeout 280 python3 tests/gpu/check_kernels.py $flag --part=$k/4 > "out/check_${size}_$k.log" 2>&1 &
        done
        wait
        cat out/check_${size}_[0-3].log > "$OUT/check_$size.log"
        grep -h "^\[part\|^FAIL" "$OUT/check_$size.log" | tee -a "$OUT/bench.log"
    done ;;
*) echo "unknown set $set_name: recipes, fp8, fp8_unit_x, fp8_unit_x_wide, fp8_unit_x_mxint4, fp8_combo, fp8_combo_moe_wide, fp8_weight_cache, fp8_dy_step, fp8_dy_step_window, bars_dense, bars_moe, bars_wide, fp8_dy_step_long, fp8_dy_step_rooms, loss_chunk, loss_chunk_recipes, loss_chunk_moe, loss_chunk_pairs, fp8_window_unit, fp8_e8m0, fp8_wide, fp8_medium, fp8_large, fp8_moe_large, fp8_moe_wide, fp8_moe, checks, memory or kernels"; exit 2 ;;
esac
cat "$OUT/bench.log"
