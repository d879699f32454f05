#!/bin/bash
# FSDP2 against the flat-buffer data-parallel path: the same config, seed and global batch,
# N processes each (default 1), eager (FSDP2 does not run under CUDA graphs); prints the losses of
# the first steps side by side and the median tokens/s of each.
#   bash dev/fsdp_vs_flat.sh [NPROC] [CONFIG] [ITERS] [OUT]
set -eu
N=${1:-1}; CFG=${2:-configs/gpu/gpt2_small_ufp4.py}; ITERS=${3:-12}; OUT=${4:-out/fsdp_vs_flat}
mkdir -p "$(dirname "$OUT")"
ARGS="--compile=False --max_iters=$ITERS --eval_interval=100000 --eval_iters=1 --log_interval=1
      --warmup_iters=1 --always_save_checkpoint=False --final_sample_tokens=0 --plot=False --overwrite=True"
for mode in flat fsdp; do
  extra=""; [ $mode = fsdp ] && extra="--fsdp=True"
  torchrun --standalone --nproc_per_node=$N train.py $CFG $ARGS $extra --out_dir=$OUT/$mode \
    > $OUT.$mode.txt 2>&1 || { echo "$mode run failed:"; tail -5 $OUT.$mode.txt; exit 1; }
done
python - "$OUT" "$N" "$CFG" <<'PY'
import json, statistics, sys
out, n, cfg = sys.argv[1:]
runs = {}
for mode in ("flat", "fsdp"):
    recs = [json.loads(l) for l in open(f"{out}/{mode}/log.jsonl")]
    runs[mode] = {r["iter"]: r for r in recs if r.get("type") == "train"}
its = sorted(set(runs["flat"]) & set(runs["fsdp"]))
print(f"{cfg}, {n} process(es), eager; train loss per iteration")
print("| iter | flat | fsdp | fsdp - flat |\n|---|---|---|---|")
for i in its:
    a, b = runs["flat"][i]["loss"], runs["fsdp"][i]["loss"]
    print(f"| {i} | {a:.5f} | {b:.5f} | {b - a:+.2e} |")
tps = {m: statistics.median(r["tok_per_s"] for i, r in runs[m].items() if i >= 2) for m in runs}
print(f"\nmedian tokens/s from iter 2: flat {tps['flat']:,.0f}, fsdp {tps['fsdp']:,.0f} "
      f"(fsdp / flat {tps['fsdp'] / tps['flat']:.3f})")
PY
