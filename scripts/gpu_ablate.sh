#!/usr/bin/env bash
# The recipe ablation of issue 7 on the GPUs of one host, one model per sitting.
# Usage: OUT=results/ablate_gpt bash scripts/gpu_ablate.sh gpt [seconds]
#        MORE_SEEDS=2,3 OUT=... bash scripts/gpu_ablate.sh gpt   (a later sitting: bf16, e2m1, ufp4 only)
#        OUT=results/ablate_moe bash scripts/gpu_ablate.sh moe [seconds]
# gpt: the 8 dense arms (paper_gpt) + a second seed of bf16, e2m1, ufp4: 11 runs.
# moe: the 4 MoE arms (paper_moe) + a second seed of bf16, e2m1, ufp4: 7 runs.
# All runs of a sitting train side by side, spread over every visible GPU (needs data/literature
# prepared: the GPU machine has no network). After `seconds` (default 540) unfinished runs are
# stopped; the summary then covers what was logged. Results: OUT/summary.md, summary.json,
# loss_curves.png, env.txt and runs.tar.gz (each run's log.jsonl and stdout).
set -uo pipefail
which=${1:?gpt or moe}; limit=${2:-540}
OUT=${OUT:-results/ablate_$which}
mkdir -p "$OUT" out
export PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$OUT/env.txt"
import datetime, torch, triton
print(f"date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
print(f"gpus {torch.cuda.device_count()} x {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
PY
gpus=$(python3 -c "import torch; print(','.join(map(str, range(torch.cuda.device_count()))))")
case $which in
    gpt) arms=paper_gpt; extra=bf16,e2m1,ufp4 ;;
    moe) arms=paper_moe; extra=bf16,e2m1,ufp4 ;;
    *) echo "unknown sweep $which: gpt or moe"; exit 2 ;;
esac
sweep=out/ablate_$which
cmd="python3 ablate.py configs/gpu/ablate_$which.py --out=$sweep --gpus=$gpus"
echo "$cmd --arms=$arms --seeds=0 --parallel=99 ; $cmd --arms=$extra --seeds=1 ..." | tee -a "$OUT/env.txt"
t0=$(date +%s)
# seed 0 of every arm and seed 1 of the three main arms, all at once
if [ -n "${MORE_SEEDS:-}" ]; then  # a later sitting: more seeds of the three main arms only
    timeout -s INT "$limit" $cmd --arms=$extra --seeds="$MORE_SEEDS" --parallel=99
else
    timeout -s INT "$limit" bash -c "$cmd --arms=$arms --seeds=0 --parallel=99 & $cmd --arms=$extra --seeds=1 --parallel=99 & wait"
fi
echo "sweep rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/env.txt"
pkill -f "ablate.py configs/gpu/ablate_$which" 2>/dev/null; pkill -f "train.py configs/gpu/ablate_$which" 2>/dev/null; sleep 2
python3 ablate.py configs/gpu/ablate_$which.py --out=$sweep --arms=$arms --seeds=0,1${MORE_SEEDS:+,$MORE_SEEDS} --report_only \
    > "$OUT/report.txt" 2>&1
cp $sweep/summary.md $sweep/summary.json $sweep/loss_curves.png "$OUT/" 2>/dev/null
tar czf "$OUT/runs.tar.gz" $(cd . && ls -d $sweep/*/log.jsonl $sweep/*/stdout.txt $sweep/*/done.json 2>/dev/null)
cat "$OUT/summary.md"
