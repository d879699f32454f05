# one-off probe (GPU): per layer and optimizer step, how many binades dy's largest block rises in a
# step's later micro-steps over its first (the room Recipe.fp8_dy_scale "step" must leave), eager
import math, sys, collections, torch
# Run: PYTHONPATH=. python dev/dy_room_probe.py CONFIG ITERS  (configs/gpu/gpt2_small_bf16.py or moe_gpt2_small_bf16.py, 12)
import fp4, train
amax, real = [], fp4._backward
def recording(dy, *args, **kwargs):
    amax.append(dy.detach().abs().amax().float())
    return real(dy, *args, **kwargs)
fp4._backward = recording
cfg, iters = sys.argv[1], int(sys.argv[2])
train.main([cfg, "--recipe=mxfp4", "--recipe_fp8_gemm=True", "--recipe_fp8_x_scale=unit",
            f"--max_iters={iters}", "--warmup_iters=1", "--compile=False", "--eval_interval=100000",
            "--eval_iters=1", "--log_interval=5", "--plot=False", "--out_dir=out/room_probe",
            "--overwrite=True", *sys.argv[3:]])
a = torch.stack(amax).cpu()
e = torch.floor(torch.log2(a))  # block-exponent proxy (floor log2 max |dy|)
acc = 8  # the configs' gradient_accumulation_steps
n = a.numel() // iters
layers = n // acc
per = e.reshape(iters, acc, layers)
rise = (per[:, 1:] - per[:, :1]).amax(1)  # [iters, layers]
print(f"{a.numel()} calls, {iters} steps x {acc} micro-steps x {layers} layer calls")
print("rise histogram (binades: count of step x layer):", sorted(collections.Counter(rise.flatten().tolist()).items()))
print("max rise per step:", rise.amax(1).tolist())
print(f"ROOM_NEEDED {int(rise.max().item())}")
