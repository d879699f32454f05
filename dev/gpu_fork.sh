#!/usr/bin/env bash
# One slice of a forked-ablation sitting on one H200 (docs/reproduction.md), sized for one device
# call: starts the CUDA MPS daemon (8 runs share the GPU instead of time-slicing), runs
# `ablate.py fork` with the given arms and bases until STOP seconds, then packs the logs (no
# checkpoints) to $OUT/NAME.tgz and prints the report. Every arm of a base must run in the same
# slice (a base trained again on the GPU is a different base). About 3 bases of headline + noise
# arms, or 24 forks of bases already trained in the same --out, fit in 520 s.
# Usage: OUT=dir [STOP=520] [PARALLEL=8] [KEEP_CKPTS=1] bash dev/gpu_fork.sh NAME CONFIG [ablate.py fork options]
#   bash dev/gpu_fork.sh fork_gpt configs/gpu/ablate_gpt.py --bases=3-5 --arms=headline,bf16_again
# KEEP_CKPTS=1 keeps finished forks' checkpoints in out/NAME/forks (for `analyze.py mechanism` after
# the forks, in the same call or the next one on the still-warm machine: beside 6 training runs it
# is too slow to finish in a call).
# then, in the repo (docs/reproduction.md):
#   tar xzf fork_gpt.tgz -C out && python ablate.py pack --out=out/fork_gpt \
#       --to=results/ablation/fork_gpt_runs.tgz --merge=results/ablation/fork_gpt_runs.tgz
#   python ablate.py report --runs=results/ablation/fork_gpt_runs.tgz --out=results/ablation/fork_gpt
set -uo pipefail
name=${1:?NAME}; config=${2:?CONFIG}; shift 2
OUT=${OUT:-out}; STOP=${STOP:-520}; PARALLEL=${PARALLEL:-8}
drop=--drop_fork_ckpts; [ -n "${KEEP_CKPTS:-}" ] && drop=
mkdir -p "$OUT" out
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
(nvidia-cuda-mps-control -d && timeout 60 python3 -c "import torch; torch.ones(1, device='cuda'); print('MPS on')") \
    || { echo quit | nvidia-cuda-mps-control 2>/dev/null; echo "MPS off: the runs time-slice the GPU"; }
nvidia-smi --query-gpu=memory.used --format=csv,noheader -l 5 > "$OUT/${name}_gpu_mem.csv" & smi=$!
t0=$(date +%s)
timeout $((STOP + 60)) python3 ablate.py fork "$config" --fork_at=1000 --eval_iters=100 --parallel="$PARALLEL" \
    --gpus=0 $drop --stop_after="$STOP" --out="out/$name" "$@" 2>&1 | grep -v '^started'
echo "wall_s=$(( $(date +%s) - t0 )) peak $(sort -n "$OUT/${name}_gpu_mem.csv" | tail -1)"
kill $smi 2>/dev/null
python3 ablate.py pack --out="out/$name" --to="$OUT/$name.tgz"
echo quit | nvidia-cuda-mps-control 2>/dev/null
true
