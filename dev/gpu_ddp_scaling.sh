#!/usr/bin/env bash
# DDP scaling on the GPUs of one host (docs/performance.md): the GPT-2-small-sized dense model on 1 and on N
# processes with the same global batch (gradient_accumulation_steps is global), same seed.
# Usage: [EXTRA='--key=value ...'] OUT=results/ddp bash dev/gpu_ddp_scaling.sh RECIPE COMPILE [N] [ITERS]
#   e.g. bash dev/gpu_ddp_scaling.sh bf16 True 2 40     (needs data/literature prepared)
# Writes OUT/ddp_<recipe>_compile<True|False>[_<compile_mode from EXTRA>].json and prints tokens/s on 1 and N GPUs, their ratio, and the mean loss
# of the last 10 steps of each (each rank draws its own batches, so the curves agree statistically,
# not step for step). python dev/ddp_figure.py OUT/ddp_*.json draws them (no GPU needed).
set -uo pipefail
recipe=${1:?recipe}; compile=${2:?True or False}; n=${3:-2}; iters=${4:-40}
OUT=${OUT:-results/ddp}
mkdir -p "$OUT" out
export PYTHONUNBUFFERED=1
mode=$(sed -n 's/.*--compile_mode=["'"'"']*\([a-z-]*\).*/\1/p' <<< "${EXTRA:-}" | head -1)   # e.g. EXTRA='--compile_mode=reduce-overhead'
name=${recipe}_compile$compile${mode:+_$mode}
for p in 1 "$n"; do
    rm -rf "out/ddp_${name}_$p"   # log.jsonl is appended to: start clean
    if ! torchrun --standalone --nproc_per_node="$p" train.py configs/gpu/gpt2_small_$recipe.py \
        --compile="$compile" --max_iters="$iters" --eval_interval=1000000 --eval_iters=1 \
        --log_interval=1 --warmup_iters=5 --always_save_checkpoint=False --final_sample_tokens=0 \
        --out_dir="out/ddp_${name}_$p" ${EXTRA:-} > "out/ddp_${name}_$p.log" 2>&1; then
        tail -20 "out/ddp_${name}_$p.log"; echo "the $p-process run failed"; exit 1
    fi
done
python3 - "$recipe" "$compile" "$n" "$OUT" "$name" "${mode:-config}" "${EXTRA:-}" <<'PY'
import datetime, json, statistics, sys, torch
recipe, compile_, n, out, name, mode, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7]
def load(p):
    recs = [json.loads(l) for l in open(f"out/ddp_{name}_{p}/log.jsonl")]
    return {r["iter"]: r for r in recs if r["type"] == "train"}
one, many = load(1), load(n)
steady = lambda runs: statistics.median(r["tok_per_s"] for i, r in runs.items() if i >= 10)
t1, tn = steady(one), steady(many)
tail = lambda runs: statistics.mean(runs[i]["loss"] for i in sorted(runs)[-10:])
l1, ln = tail(one), tail(many)
res = dict(recipe=recipe, compile=compile_ == "True", compile_mode=mode, extra=extra, gpus=n, tok_per_s_1=t1, tok_per_s_n=tn,
           scaling=tn / t1, tail_loss_1=l1, tail_loss_n=ln, iters=len(one),
           losses_1=[one[i]["loss"] for i in sorted(one)], losses_n=[many[i]["loss"] for i in sorted(many)],
           date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__)
json.dump(res, open(f"{out}/ddp_{name}.json", "w"), indent=1)
print(f"{recipe} compile={compile_} ({mode}): 1 GPU {t1:,.0f} tok/s | {n} GPUs {tn:,.0f} tok/s | "
      f"scaling {tn / t1:.2f}x | loss of the last 10 steps {l1:.4f} vs {ln:.4f}")
PY
