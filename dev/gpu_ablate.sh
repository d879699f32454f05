#!/usr/bin/env bash
# The recipe ablation (docs/reproduction.md) on the GPUs of one host, one model per sitting.
# Usage: OUT=results/ablate_gpt bash dev/gpu_ablate.sh gpt [seconds]
#        MORE_SEEDS=2,3 OUT=... bash dev/gpu_ablate.sh gpt   (a later sitting: bf16, e2m1, ufp4 only)
#        OUT=results/ablate_moe bash dev/gpu_ablate.sh moe [seconds]
# gpt: the 8 dense arms (paper_gpt) + a second seed of bf16, e2m1, ufp4: 11 runs.
# moe: the 4 MoE arms (paper_moe) + a second seed of bf16, e2m1, ufp4: 7 runs.
# All runs of a sitting train side by side, spread over every visible GPU (needs data/literature
# prepared: the GPU machine has no network). After `seconds` (default 540) unfinished runs are
# stopped; the summary then covers what was logged. Results: OUT/summary.md, summary.json,
# loss_curves.png, env.txt and runs.tar.gz (each run's log.jsonl and stdout); a MORE_SEEDS
# sitting writes env_seeds<N>.txt and runs_seeds<N>.tar.gz beside them and redoes the summary.
set -uo pipefail
sweep_name=${1:?gpt or moe}; limit=${2:-540}
case $sweep_name in
    gpt) arms=paper_gpt; extra=bf16,e2m1,ufp4 ;;
    moe) arms=paper_moe; extra=bf16,e2m1,ufp4 ;;
    *) echo "unknown sweep $sweep_name: gpt or moe"; exit 2 ;;
esac
OUT=${OUT:-results/ablate_$sweep_name}
sitting=${MORE_SEEDS:+_seeds${MORE_SEEDS//,/}}   # a later sitting writes beside the first one's files
mkdir -p "$OUT" out
export PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$OUT/env$sitting.txt"
import datetime, torch, triton
print(f"date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
print(f"gpus {torch.cuda.device_count()} x {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
PY
gpus=$(python3 -c "import torch; print(','.join(map(str, range(torch.cuda.device_count()))))")
sweep=out/ablate_$sweep_name
cmd="python3 ablate.py configs/gpu/ablate_$sweep_name.py --out=$sweep --gpus=$gpus"
t0=$(date +%s)
if [ -n "${MORE_SEEDS:-}" ]; then  # a later sitting: more seeds of the three main arms only
    echo "$cmd --arms=$extra --seeds=$MORE_SEEDS --parallel=99" | tee -a "$OUT/env$sitting.txt"
    timeout --kill-after=30 "$limit" $cmd --arms=$extra --seeds="$MORE_SEEDS" --parallel=99
else  # seed 0 of every arm and seed 1 of the three main arms, all at once
    echo "$cmd --arms=$arms --seeds=0 --parallel=99 & $cmd --arms=$extra --seeds=1 --parallel=99" | tee -a "$OUT/env.txt"
    timeout --kill-after=30 "$limit" $cmd --arms=$arms --seeds=0 --parallel=99 & a=$!
    timeout --kill-after=30 "$limit" $cmd --arms=$extra --seeds=1 --parallel=99 & b=$!
    wait $a $b
fi
echo "sweep rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/env$sitting.txt"
pkill -f "train.py configs/gpu/ablate_$sweep_name.py --out_dir=$sweep/" 2>/dev/null; sleep 2  # runs a stopped sweep left
python3 ablate.py configs/gpu/ablate_$sweep_name.py --out=$sweep --arms=$arms --seeds=0,1${MORE_SEEDS:+,$MORE_SEEDS} --report_only \
    > "$OUT/report$sitting.txt" 2>&1
cp $sweep/summary.md $sweep/summary.json $sweep/loss_curves.png "$OUT/" 2>/dev/null
tar czf "$OUT/runs$sitting.tar.gz" $(ls -d $sweep/*/log.jsonl $sweep/*/stdout.txt $sweep/*/done.json 2>/dev/null)
cat "$OUT/summary.md"
