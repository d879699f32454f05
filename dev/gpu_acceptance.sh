#!/usr/bin/env bash
# The GPU acceptance runs on one H200, in one go (with the shrinkage analysis of docs/reproduction.md):
#   1. nanoGPT's shakespeare_char budget in bf16 (6x384, context 256, batch 64, 5000 iters)
#   2. the flagship, python train.py configs/moe_ufp4.py
#   3. analyze.py tensors on the bf16 checkpoint of 1
#   4. a smoke-size paired ablation (bf16, e2m1, ufp4 x 2 seeds, 6 runs at once on the GPU)
# Usage: OUT=results/gpu bash dev/gpu_acceptance.sh   (needs data/shakespeare_char and
# data/tinyshakespeare_char prepared: the GPU machine has no network)
set -uo pipefail
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$OUT/summary.txt"
import datetime, torch, triton
print(f"date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
print(f"gpu {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
PY
run() {  # name, then the command; wall time in $OUT/<name>.time
    local name=$1; shift
    local t0=$(date +%s.%N)
    "$@" > "out/$name.log" 2>&1
    local rc=$?
    [ $rc -ne 0 ] && tail -30 "out/$name.log" >> "$OUT/summary.txt"
    local t1=$(date +%s.%N)
    echo "$name rc=$rc wall_s=$(python3 -c "print(round($t1 - $t0, 1))")" | tee -a "$OUT/summary.txt"
}
# at most 8 files come back: summary.txt, 2 jsonl, 3 shrinkage files, 2 ablation files
mkdir -p out
run flagship_moe_ufp4 python3 train.py configs/moe_ufp4.py --out_dir=out/gpu_moe_ufp4
cp out/gpu_moe_ufp4/log.jsonl "$OUT/flagship_moe_ufp4.jsonl" 2>/dev/null
run shakespeare_char_bf16 python3 train.py configs/shakespeare_char_gpt.py --compile=True \
    --out_dir=out/gpu_shakespeare_char_bf16
cp out/gpu_shakespeare_char_bf16/log.jsonl "$OUT/shakespeare_char_bf16.jsonl" 2>/dev/null
run analyze python3 analyze.py tensors --ckpt out/gpu_shakespeare_char_bf16/ckpt.pt \
    --out out/gpu_shrinkage
tail -8 out/analyze.log >> "$OUT/summary.txt"
cp out/gpu_shrinkage_tensors.md out/gpu_shrinkage_depth.json out/gpu_shrinkage_depth.png "$OUT/" 2>/dev/null
run ablate_smoke timeout 240 python3 ablate.py configs/gpt_ablate.py --arms=bf16,e2m1,ufp4 --seeds=0,1 \
    --parallel=6 --out=out/gpu_ablate_smoke
cat out/ablate_smoke.log | tail -8 >> "$OUT/summary.txt"
cp out/gpu_ablate_smoke/summary.md "$OUT/ablate_smoke.md" 2>/dev/null
cp out/gpu_ablate_smoke/loss_curves.png "$OUT/ablate_smoke_curves.png" 2>/dev/null
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys, os
out = sys.argv[1]
for name in ("shakespeare_char_bf16", "flagship_moe_ufp4"):
    p = os.path.join(out, name + ".jsonl")
    if not os.path.exists(p):
        print(name, "no log"); continue
    recs = [json.loads(l) for l in open(p)]
    ev = [r for r in recs if r.get("type") == "eval"]
    tr = [r for r in recs if r.get("type") == "train"]
    best = min(ev, key=lambda r: r["val_loss"]) if ev else None
    tok = sorted(r["tok_per_s"] for r in tr[len(tr) // 10:])
    print(f"{name}: best val {best['val_loss']:.4f} at iter {best['iter']}, last val {ev[-1]['val_loss']:.4f}, "
          f"median tok/s {tok[len(tok) // 2]:,.0f}, elapsed {tr[-1].get('elapsed_s', 0):.0f} s")
PY
ls "$OUT"
