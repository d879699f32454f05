"""Inductor's generated code for one dense GPT-2-small block (16 x 1024 tokens) under bf16 and
ufp4, written to OUT/code_<recipe>.py, to compare the kernels around attention's backward.
Run from the repo root: python results/perf/session12/inductor_code.py OUT"""
import os, sys
import torch
sys.path.insert(0, ".")
import fp4, train
from model import GPT
out = sys.argv[1]
cfg = train.get_config(["configs/gpu/gpt2_small_bf16.py"])
cfg["n_layer"] = 1
for r in ("bf16", "ufp4"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fp4.convert(GPT(train.model_config(cfg, 50304)), r).cuda()
    x = torch.randint(0, 50257, (16, 1024), device="cuda")
    from torch._inductor import config as ic
    ic.debug = False
    codes = []
    from torch._inductor.graph import GraphLowering
    orig = GraphLowering.compile_to_module
    def grab(self, *a, **k):
        mod = orig(self, *a, **k)
        codes.append(open(mod.__file__).read())
        return mod
    GraphLowering.compile_to_module = grab
    run = torch.compile(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = run(x, x)
    loss.backward()
    GraphLowering.compile_to_module = orig
    with open(os.path.join(out, f"code_{r}.py"), "w") as f:
        f.write("\n\n# ======== next graph ========\n\n".join(codes))
    print(r, len(codes), "graphs")
