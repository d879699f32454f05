# one-off probe (GPU): max |dy| of every quantized layer's backward call in a short eager run of
# dense GPT-2 small, mxfp4 on FP8 GEMMs (dy scaled by its amax), with the learning rate at its
# peak from iter 1 as in bench.py: what fixed FP8 scale for dy (Recipe.fp8_dy_exp) would hold it.
# Run: PYTHONPATH=. python dev/dy_amax_probe.py [iters]
import math, sys, torch
import fp4, train
amax, real = [], fp4._backward
def recording(dy, *args, **kwargs):
    amax.append(dy.detach().abs().amax().float())
    return real(dy, *args, **kwargs)
fp4._backward = recording
iters = int(sys.argv[1]) if len(sys.argv) > 1 else 20
train.main(["configs/gpu/gpt2_small_bf16.py", "--recipe=mxfp4", "--recipe_fp8_gemm=True",
            "--recipe_fp8_x_scale=unit", f"--max_iters={iters}", "--warmup_iters=1", "--compile=False",
            "--eval_interval=100000", "--eval_iters=1", "--log_interval=5", "--plot=False",
            "--out_dir=out/dy_probe", "--overwrite=True", *sys.argv[2:]])
a = torch.stack(amax).log2().cpu()
per_step = a.reshape(iters, -1)  # calls in step order: micro-steps x layers
print(f"{a.numel()} backward calls; log2 max |dy| per call: min {a.min():.2f}, median {a.median():.2f}, max {a.max():.2f}")
print("per optimizer step, max over its calls:", " ".join(f"{v:.1f}" for v in per_step.max(1).values))
top = math.ceil(a.max().item())
# e5m2's largest finite is 57344 < 2^16 times the decode scale; leave 4 binades above the run's top
print(f"SUGGEST_EXP {top - 16 + 4}")
