"""One-off (GPU): does a state buffer written by a custom op pair (forward: returned and copied
into a buffer; backward: saved, returned and copied) make a compiled model with weight copies
cached outside the graph diverge from quantizing them per call under CUDA graphs (as the
hinted FP8 scale did, results/profile/fp8_hinted_scale_ab.md)? A toy of 3 linears, no FP4.
    python dev/cudagraph_state_probe.py H [T]   # H: 0 no state, 1/2/3 state writes; T & 1: mark_static_address
Prints whether the cached and per-call runs match, where they part, and inductor's counters."""
import torch,sys,os
from torch import nn,Tensor
from torch._dynamo.utils import counters
D='cuda' if torch.cuda.is_available() else 'cpu'
def q(w):return (w*2).to(torch.float8_e4m3fn)
@torch.library.custom_op("t::f",mutates_args=())
def f(x:Tensor,w:Tensor,wq:list[Tensor],h:list[Tensor])->tuple[Tensor,Tensor]:
    W=wq[0] if wq else q(w)
    return x@(W.float()/2).t(),(h[0]+1 if h else x.new_empty(0,dtype=torch.int32))
@f.register_fake
def _(x,w,wq,h):return x.new_empty(x.shape[0],w.shape[0]),x.new_empty(3 if h else 0,dtype=torch.int32)
@torch.library.custom_op("t::g",mutates_args=())
def g(dy:Tensor,x:Tensor,w:Tensor,wq:list[Tensor],h:list[Tensor])->tuple[Tensor,Tensor,Tensor]:
    W=wq[1] if wq else q(w)
    return dy@(W.float()/2),dy.t()@x,(h[0]+1 if h else x.new_empty(0,dtype=torch.int32))
@g.register_fake
def _(dy,x,w,wq,h):return dy.new_empty(dy.shape[0],w.shape[1]),w.new_empty(w.shape),x.new_empty(3 if h else 0,dtype=torch.int32)
def setup(ctx,inputs,output):
    x,w,wq,h=inputs;ctx.save_for_backward(w,*wq,*h[1:],x);ctx.nq=len(wq);ctx.nh=len(h);ctx.mark_non_differentiable(output[1])
def bw(ctx,dy,_):
    w,*r=ctx.saved_tensors;wq=r[:ctx.nq];r=r[ctx.nq:];hd=r[:ctx.nh//2];x=r[-1]
    dx,dw,nh=g(dy,x,w,wq,hd)
    if hd:hd[0].copy_(nh)
    return dx,dw,[None]*ctx.nq,[None]*ctx.nh
f.register_autograd(bw,setup_context=setup)
H=int(sys.argv[1]);T=int(sys.argv[2]) if len(sys.argv)>2 else 0
class Lin(nn.Linear):
    def __init__(s,i,o,c):
        super().__init__(i,o,bias=False);s.c=c
        for n in('c0','c1'):s.register_buffer(n,None,persistent=False)
        for n in('hx','hdy'):s.register_buffer(n,torch.zeros(3,dtype=torch.int32),persistent=False)
    def upd(s):
        with torch.no_grad():
            a,b=q(s.weight),q(s.weight.t().contiguous()).t()
            if s.c0 is None:s.c0,s.c1=a,b
            else:s.c0.copy_(a);s.c1.copy_(b)
    def forward(s,x):
        wq=[s.c0,s.c1] if s.c else []
        h=[s.hx,s.hdy] if H else []
        y,nh=f(x,s.weight,wq,h)
        if H==1 or H==3:s.hx.copy_(nh)
        return y
def run(c,comp):
    torch._dynamo.reset();torch.manual_seed(0)
    m=nn.Sequential(Lin(64,128,c),nn.GELU(),Lin(128,128,c),nn.GELU(),Lin(128,64,c)).to(D)
    L=[l for l in m if isinstance(l,Lin)]
    if c:[l.upd() for l in L]
    if T&1:[torch._dynamo.mark_static_address(b) for l in L for b in (l.c0,l.c1,l.hx,l.hdy) if b is not None]
    mc=torch.compile(m,mode="reduce-overhead") if comp else m
    o=torch.optim.AdamW(m.parameters(),lr=1e-2);x=torch.randn(256,64,device=D);out=[]
    for s in range(5):
        for l in L:l.hx.zero_();l.hdy.zero_()
        if comp:torch.compiler.cudagraph_mark_step_begin()
        loss=mc(x).square().mean();loss.backward()
        out.append((loss.item(),sum(p.grad.double().norm()**2 for p in m.parameters()).item()))
        o.step();o.zero_grad(set_to_none=True)
        if c:[l.upd() for l in L]
    return out
comp=D=='cuda'
a,b=run(1,comp),run(0,comp)
print("H",H,"T",T,"eq",a==b,[i for i in range(5) if a[i]!=b[i]],dict(counters["inductor"]))
for u,v in zip(a,b):print(u,v)
