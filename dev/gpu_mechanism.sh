#!/usr/bin/env bash
# The mechanism at fixed weights (`analyze.py mechanism`, docs/reproduction.md) on several
# checkpoints at once on one GPU, one process each under MPS; for checkpoints a forked sitting
# kept (`KEEP_CKPTS=1 bash dev/gpu_fork.sh ...`, then this in the next call on the still-warm
# machine: its out/ is still there). Alone on an H200 one checkpoint of configs/gpu/ablate_gpt.py
# at 2 batches x 2 SR draws took 29 s with start-up; beside 6 training runs 8 x 8 did not finish
# in 8 minutes: run it after the forks, not beside them.
# Usage: OUT=dir [STOP=500] [BATCHES=8] [DRAWS=8] bash dev/gpu_mechanism.sh NAME CKPT...
#   bash dev/gpu_mechanism.sh mechanism_gpt out/fork_gpt/bases/bf16_s12_at500/ckpt.pt \
#       out/fork_gpt/forks/bf16_s12_at1000_to1500/e2m1/ckpt.pt ...
# then, in the repo: tar xzf mechanism_gpt.tgz -C results/ablation &&
#   python analyze.py mechanism_summary --out results/ablation/mechanism_gpt
set -uo pipefail
name=${1:?NAME}; shift
OUT=${OUT:-out}; STOP=${STOP:-500}; BATCHES=${BATCHES:-8}; DRAWS=${DRAWS:-8}
mkdir -p "$OUT" "out/$name"
export PYTHONUNBUFFERED=1
(nvidia-cuda-mps-control -d && timeout 60 python3 -c "import torch; torch.ones(1, device='cuda')") \
    || { echo quit | nvidia-cuda-mps-control 2>/dev/null; echo "MPS off: the processes time-slice the GPU"; }
t0=$(date +%s)
for ckpt in "$@"; do
    (timeout "$STOP" python3 analyze.py mechanism --ckpt "$ckpt" --batches "$BATCHES" --draws "$DRAWS" \
        --device "${DEVICE:-cuda}" --out "out/$name" > "out/$name/$(echo "$ckpt" | tr / _).log" 2>&1
     echo "$ckpt rc=$? at $(( $(date +%s) - t0 )) s") &
done
wait
python3 analyze.py mechanism_summary --out "out/$name" && tail -n 12 "out/$name/summary.md"
tar czf "$OUT/$name.tgz" -C out --exclude='*.log' "$name"
echo quit | nvidia-cuda-mps-control 2>/dev/null
true
