"""One-off (GPU), run at tree ed0db86: where the cached-weight and per-call runs of the FP8 model part ways (eager, compiled with CUDA graphs)."""
import sys
sys.path.insert(0, "tests/gpu")
import torch
import check_compile as cc
import fp4
import train

def run(cache, compiled, reset):
    torch._dynamo.reset()
    x, y = cc.batch()
    m = cc.gpt(fp4.make_recipe("mxfp4", fp8_gemm=True))
    if cache:
        fp4.cache_weights(m)
    comp = train.torch_compile(m, mode="reduce-overhead") if compiled else m
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses, gn = [], []
    for step in range(4):
        if reset:
            for mod in m.modules():
                if isinstance(mod, fp4.FP4Linear):
                    mod.fp8_hint_x.copy_(fp4.new_fp8_hint()), mod.fp8_hint_dy.copy_(fp4.new_fp8_hint())
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        loss = cc.loss_of(comp, x, y, 300 + step)
        losses.append(loss.item())
        loss.backward()
        gn.append(sum(p.grad.double().norm() ** 2 for p in m.parameters() if p.grad is not None).item() ** 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cache:
            fp4.cache_weights(m)
    return losses, gn

for compiled, reset in ((False, False), (True, True), (False, True)):
    a, b = run(True, compiled, reset), run(False, compiled, reset)
    print(f"compiled={compiled} hints reset each step={reset}: losses equal {a[0] == b[0]}, grad norms equal {a[1] == b[1]}")
    print("   cached  ", " ".join(f"{v:.7f}" for v in a[0]), "|", " ".join(f"{v:.6e}" for v in a[1]))
    print("   per call", " ".join(f"{v:.7f}" for v in b[0]), "|", " ".join(f"{v:.6e}" for v in b[1]))
