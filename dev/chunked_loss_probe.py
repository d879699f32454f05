"""One-off probe (not kept): lm_head's loss computed in token chunks with both gradients in the
forward (an autograd.Function), against F.cross_entropy of the whole logits, compiled, at GPT-2
small's 16k tokens x 50304 vocab: extra peak memory above the inputs, and time per forward +
backward. `python dev/chunked_loss_probe.py [variant ...]` on a GPU.
"""
import sys, torch, torch.nn.functional as F

def mm_acc(acc, a, b, use_addmm):
    if use_addmm:
        return torch.addmm(acc, a, b, out_dtype=torch.float32)
    return acc + (a @ b).float()

def make_inplace(rows):
    """The first version: softmax in place over an fp32 copy, the one-hot by scatter_add_."""
    class LCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, targets):
            dtype = torch.bfloat16
            xs, w, t = x.reshape(-1, x.size(-1)).to(dtype), weight.to(dtype), targets.reshape(-1)
            count = (t != -1).sum()
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            dx = torch.empty_like(xs)
            dw = torch.zeros_like(weight, dtype=torch.float32)
            for i in range(0, t.numel(), rows):
                xc, tc = xs[i:i + rows], t[i:i + rows]
                logits = (xc @ w.t()).float()
                lse = logits.logsumexp(-1)
                picked = logits.gather(1, tc.clamp(min=0).unsqueeze(1)).squeeze(1)
                loss = loss + ((lse - picked) * (tc != -1)).sum()
                g = logits.sub_(lse.unsqueeze(1)).exp_()
                g.scatter_add_(1, tc.clamp(min=0).unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
                g = g.mul_(((tc != -1) / count).unsqueeze(1)).to(dtype)
                dx[i:i + rows] = g @ w
                dw += (g.t() @ xc).float()
            ctx.save_for_backward(dx, dw)
            ctx.shape = x.shape
            return loss / count
        @staticmethod
        def backward(ctx, grad):
            dx, dw = ctx.saved_tensors
            return (dx.float() * grad).view(ctx.shape), dw * grad, None
    return lambda x, w, t: LCE.apply(x, w, t)

def make(rows, use_addmm):
    """Softmax minus a one-hot by comparison with the vocab ids: one pointwise expression."""
    class LCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, targets):
            dtype = torch.bfloat16
            xs, w, t = x.reshape(-1, x.size(-1)).to(dtype), weight.to(dtype), targets.reshape(-1)
            count = (t != -1).sum()
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            dx = torch.empty_like(xs)
            dw = torch.zeros_like(weight, dtype=torch.float32)
            vocab = torch.arange(w.size(0), device=x.device)
            for i in range(0, t.numel(), rows):
                xc, tc = xs[i:i + rows], t[i:i + rows]
                logits = (xc @ w.t()).float()
                lse = logits.logsumexp(-1)
                picked = logits.gather(1, tc.clamp(min=0).unsqueeze(1)).squeeze(1)
                loss = loss + ((lse - picked) * (tc != -1)).sum()
                g = ((logits - lse.unsqueeze(1)).exp() - (vocab == tc.unsqueeze(1)).float()) \
                    * ((tc != -1) / count).unsqueeze(1)
                g = g.to(dtype)
                dx[i:i + rows] = g @ w
                dw = mm_acc(dw, g.t(), xc, use_addmm)
            ctx.save_for_backward(dx, dw)
            ctx.shape = x.shape
            return loss / count
        @staticmethod
        def backward(ctx, grad):
            dx, dw = ctx.saved_tensors
            return (dx.float() * grad).view(ctx.shape), dw * grad, None
    return lambda x, w, t: LCE.apply(x, w, t)

N, d, V = 16384, 768, 50304
variants = {
    "old": lambda x, w, t: F.cross_entropy(F.linear(x, w).float().view(-1, V), t.view(-1), ignore_index=-1),
    "inplace2048": make_inplace(2048),
    "pw2048": make(2048, False), "pw4096": make(4096, False),
    "addmm2048": make(2048, True), "addmm4096": make(4096, True), "addmm1024": make(1024, True),
}
only = sys.argv[1:] or list(variants)
torch.manual_seed(0)
x0 = torch.randn(16, 1024, d, device="cuda")
w = (torch.randn(V, d, device="cuda") * 0.02).requires_grad_()
t = torch.randint(0, V, (16, 1024), device="cuda")
ref = None
print(f"{'variant':<10} {'extra peak MiB':>14} {'ms fwd+bwd':>10} {'loss diff':>10} {'dx diff':>9} {'dw rel':>9}")
for name in only:
    f = torch.compile(variants[name])
    x = x0.clone().requires_grad_()
    for _ in range(3):
        x.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(x, w, t)
        loss.backward()
    torch.cuda.synchronize()
    x.grad = w.grad = None
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(10):
        x.grad = w.grad = None
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(x, w, t)
        loss.backward()
        e.record(); torch.cuda.synchronize(); times.append(s.elapsed_time(e))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    out = (loss.item(), x.grad.clone(), w.grad.clone())
    if ref is None:
        ref = out
    dl = abs(out[0] - ref[0]); dx = (out[1] - ref[1]).abs().max().item(); dw = ((out[2] - ref[2]).abs().max() / ref[2].abs().max()).item()
    print(f"{name:<10} {peak:>14.0f} {sorted(times)[5]:>10.2f} {dl:>10.2e} {dx:>9.1e} {dw:>9.1e}", flush=True)
