"""8 vs 16 random bits per SR draw, paired by seed: per seed, ufp4 (8 bits, the default) minus
ufp4_sr16 in the final val loss and in the mean train loss of the last 10 % of steps, from the
sweep's logs (sr_bits/runs.tar.gz). Run from the repo root:
python results/perf/session11/sr_bits_paired.py
"""
import io, json, statistics, tarfile

runs = {}
with tarfile.open("results/perf/session11/sr_bits/runs.tar.gz") as tar:
    for m in tar.getmembers():
        if m.name.endswith("log.jsonl"):
            lines = io.TextIOWrapper(tar.extractfile(m)).read().splitlines()
            runs[m.name.split("/")[-2]] = [json.loads(x) for x in lines if x.strip()]


def final_val(name):
    return [r for r in runs[name] if r["type"] == "eval"][-1]["val_loss"]


def train_tail(name):
    tr = [r["loss"] for r in runs[name] if r["type"] == "train"]
    return statistics.mean(tr[-len(tr) // 10:])


print("`python results/perf/session11/sr_bits_paired.py`, from the runs of sr_bits/ (sr_bits/env.txt: "
      + " | ".join(open("results/perf/session11/sr_bits/env.txt").read().splitlines()[:2]) + ")")
print("| seed | val 8 bits | val 16 bits | val bf16 | val 8 - 16 | train tail 8 - 16 |\n|---|---|---|---|---|---|")
dv, dt = [], []
for s in range(4):
    a, b = f"ufp4_s{s}", f"ufp4_sr16_s{s}"
    dv.append(final_val(a) - final_val(b))
    dt.append(train_tail(a) - train_tail(b))
    print(f"| {s} | {final_val(a):.4f} | {final_val(b):.4f} | {final_val(f'bf16_s{s}'):.4f} | {dv[-1]:+.4f} | {dt[-1]:+.4f} |")
for what, d in (("val", dv), ("train tail", dt)):
    m, sd = statistics.mean(d), statistics.stdev(d)
    print(f"{what}: 8 - 16 bits = {m:+.4f} +- {sd:.4f} (sd over seeds), standard error {sd / len(d) ** 0.5:.4f}")
