"""parallel.py: FSDP2 over two gloo processes on the CPU against one process, for a ufp4 model.

The single-process reference accumulates the two ranks' micro-batches with the same random seeds
(stochastic rounding draws) and averages, which is what FSDP2 computes: the gradients, the AdamW
step and a resume from a gathered or a plain checkpoint are compared bit for bit; the gradient
norm (summed over shards in another order) to a relative 1e-6."""
import copy
import os
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import fp4  # noqa: E402
import parallel  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

WORLD, PER_RANK, T, SEED = 2, 4, 16, 1234

def build(tie=False, init_seed=0):
    torch.manual_seed(init_seed)
    cfg = GPTConfig(block_size=T, vocab_size=64, n_layer=2, n_head=2, n_embd=32,
                    tie_embeddings=tie)
    model = fp4.convert(GPT(cfg), fp4.make_recipe("ufp4"))
    return model, model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")

def batch(step, rank):
    """Rank `rank`'s rows of step `step`'s global batch, and its SR seed."""
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 64, (WORLD * PER_RANK, T + 1), generator=g)
    rows = idx[rank * PER_RANK:(rank + 1) * PER_RANK]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), SEED + 10 * step + rank

def forward_backward(model, step, rank):
    x, y, seed = batch(step, rank)
    torch.manual_seed(seed)   # the stochastic-rounding draws of this rank's micro-batch
    _, loss = model(x, y)
    loss.backward()
    return loss.detach()

def optimizer_step(model, optimizer):
    # a limit above the norm: the norm of the shards sums in another order (equal to ~1e-7),
    # and an active clip would carry that difference into the weights
    norm = parallel.clip_grad_norm(model, 10.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm

# -----------------------------------------------------------------------------
# the workers: `RANK=r WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python tests/test_parallel.py DIR`

def worker(folder):
    import datetime
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    for tie in (False, True):   # one launch for both: a process start costs seconds
        run_rank(folder, tie, rank, dist)
    dist.destroy_process_group()
    # as train.py does under torchrun: a gloo worker thread can outlive the group and abort the
    # rank during interpreter shutdown ("terminate called without an active exception") after
    # everything was written, so leave without finalizing
    sys.stdout.flush()
    os._exit(0)

def run_rank(folder, tie, rank, dist):
    save = (lambda obj, name: torch.save(obj, os.path.join(folder, f"{tie}_{name}"))) \
        if rank == 0 else (lambda obj, name: None)
    model, _ = build(tie)
    parallel.shard_model(model)
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")   # on the shards
    forward_backward(model, 0, rank)
    save({n: p.grad.full_tensor() for n, p in model.named_parameters()}, "grads0.pt")
    save(optimizer_step(model, optimizer), "norm0.pt")
    state = parallel.full_state_dict(model)
    optim = parallel.full_optimizer_state_dict(model, optimizer)
    assert (len(state) > 0) == (rank == 0)   # gathered to rank 0 alone
    save(dict(model=state, optimizer=optim), "fsdp_step1.pt")
    finite = [parallel.all_finite(model)]
    if rank == 1:   # a NaN in one rank's shard: every rank must see it
        with torch.no_grad():
            next(model.parameters()).to_local().view(-1)[0] = float("nan")
    finite.append(parallel.all_finite(model))
    assert finite == [True, False], finite
    # resume, on fresh weights, from the gathered checkpoint and from the plain run's one
    for name in ("fsdp_step1.pt", "plain_step1.pt"):
        dist.barrier()
        ckpt = torch.load(os.path.join(folder, f"{tie}_{name}"), weights_only=True)
        model, _ = build(tie, init_seed=99)
        parallel.shard_model(model)
        optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
        parallel.load_full_state(model, optimizer, ckpt["model"], ckpt["optimizer"])
        forward_backward(model, 1, rank)
        optimizer_step(model, optimizer)
        save(parallel.full_state_dict(model), f"resumed_from_{name}")

# -----------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def launch(argv, timeout):
    """argv on WORLD gloo processes (ranks in the environment, as torchrun sets them); their
    output. Once more on a new port if the first was taken between probing and binding it."""
    for attempt in range(2):
        env = dict(os.environ, WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, *argv], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(WORLD)]
        try:
            outs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:   # a rank that died leaves the other waiting in a collective
            for p in procs:
                if p.poll() is None:
                    p.kill()
        text = "\n".join(outs)
        if all(p.returncode == 0 for p in procs) or "address already in use" not in text.lower() or attempt:
            break
    assert all(p.returncode == 0 for p in procs), \
        f"exit codes {[p.returncode for p in procs]}:\n" + text[-4000:]
    return outs

def run_workers(folder):
    launch([__file__, str(folder)], timeout=120)

def reference_step(model, optimizer, step):
    """One process: both ranks' micro-batches with their seeds, gradients averaged as FSDP2
    averages them over ranks."""
    for rank in range(WORLD):
        forward_backward(model, step, rank)
    for p in model.parameters():
        p.grad /= WORLD
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, optimizer_step(model, optimizer)

def assert_same(got, want, what):
    assert set(got) == set(want), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {bad[:3]} differ, max " + \
        f"{max((got[k] - want[k]).abs().max().item() for k in bad):.3g}"

def test_fsdp2_matches_one_process_bit_for_bit(tmp_path):
    want = {}
    for tie in (False, True):   # the default dense model, and a tied lm_head (GPT-2 style)
        model, optimizer = build(tie)
        grads, norm = reference_step(model, optimizer, 0)
        torch.save(dict(model=model.state_dict(), optimizer=optimizer.state_dict()),
                   str(tmp_path / f"{tie}_plain_step1.pt"))
        step1 = {k: v.clone() for k, v in model.state_dict().items()}
        optim1 = copy.deepcopy(parallel._name_keyed(model, optimizer, optimizer.state_dict()))
        reference_step(model, optimizer, 1)
        want[tie] = grads, norm, step1, optim1, model.state_dict()
    run_workers(tmp_path)
    for tie, (grads, norm, step1, optim1, step2) in want.items():
        def got(name, tie=tie):
            return torch.load(str(tmp_path / f"{tie}_{name}"), weights_only=True)
        assert_same(got("grads0.pt"), grads, f"gradients (tie={tie})")
        assert torch.allclose(got("norm0.pt"), norm, rtol=1e-6, atol=0) and norm < 10.0
        fsdp1 = got("fsdp_step1.pt")
        assert_same(fsdp1["model"], step1, f"weights after one AdamW step (tie={tie})")
        for name, s in optim1["state"].items():
            assert_same(fsdp1["optimizer"]["state"][name], s, f"AdamW state of {name}")
        for name in ("fsdp_step1.pt", "plain_step1.pt"):
            assert_same(got(f"resumed_from_{name}"), step2, f"the step after resuming from {name}")
        # the gathered checkpoint loads into a plain model and optimizer and continues identically
        plain, optimizer = build(tie, init_seed=99)
        plain.load_state_dict(fsdp1["model"])
        parallel.load_full_state(plain, optimizer, fsdp1["model"], fsdp1["optimizer"])
        reference_step(plain, optimizer, 1)
        assert_same(plain.state_dict(), step2, f"a plain model resumed from FSDP2 (tie={tie})")

# -----------------------------------------------------------------------------
# train.py's fsdp switch

def launch_train(ds, out, **kw):
    """train.py on two gloo processes; returns their output."""
    from train_helpers import tiny_args
    return launch([os.path.join(ROOT, "train.py")] + tiny_args(ds, str(out), **kw), timeout=300)

def test_train_fsdp_matches_the_flat_buffer_path_and_resumes(tmp_path):
    """fsdp=True against the flat all-reduced buffer on the same two ranks (ufp4, MoE with the
    sigmoid router): the same gradients and AdamW steps, so the same losses. No clipping here:
    the gradient norm sums over shards in another order (equal to ~1e-7), and an active clip
    carries that into the weights, where FP4 rounding can flip a code and grow it (1e-5 of loss
    after a few steps). A run stopped and resumed under FSDP2 equals the uninterrupted one."""
    from train_helpers import make_char_dataset, read_log
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    kw = dict(recipe="ufp4", max_iters=6, lr_decay_iters=6, eval_interval=3, grad_clip=0.0,
              gradient_accumulation_steps=2, n_expert=4, top_k=2, router="sigmoid",
              router_bias_rate=0.01)
    launch_train(ds, tmp_path / "flat", **kw)
    launch_train(ds, tmp_path / "fsdp", fsdp=True, **kw)
    flat, fsdp = read_log(str(tmp_path / "flat")), read_log(str(tmp_path / "fsdp"))
    assert [r["iter"] for r in fsdp] == list(range(6))
    assert [r["loss"] for r in flat] == [r["loss"] for r in fsdp]
    for a, b in zip(flat, fsdp):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"]
    launch_train(ds, tmp_path / "split", fsdp=True, **dict(kw, max_iters=3))
    launch_train(ds, tmp_path / "split", fsdp=True, init_from="resume", **kw)
    split = read_log(str(tmp_path / "split"))
    steps = lambda log: [(r["loss"], r["grad_norm"]) for r in log]  # noqa: E731
    assert steps(split) == steps(fsdp)
    ckpt = torch.load(str(tmp_path / "split" / "ckpt.pt"), weights_only=False)
    plain = GPT(GPTConfig(**ckpt["model_args"]))
    plain.load_state_dict(ckpt["model"])   # the gathered checkpoint is a plain model's

def test_train_fsdp_in_one_process_without_torchrun(tmp_path):
    """fsdp=True in a plain `python train.py` (a one-rank process group of its own): the plain
    run's losses, and its checkpoint (optimizer keyed by name) resumes a plain run and back."""
    import train
    from train_helpers import make_char_dataset, read_log, tiny_args
    ds = make_char_dataset(str(tmp_path / "data" / "tiny"))
    kw = dict(recipe="ufp4", max_iters=4, lr_decay_iters=8, eval_interval=4, grad_clip=0.0,
              plot=False)
    train.main(tiny_args(ds, str(tmp_path / "plain"), **kw))
    train.main(tiny_args(ds, str(tmp_path / "fsdp"), fsdp=True, **kw))
    assert not torch.distributed.is_initialized()   # its group is gone with the run
    plain, fsdp = read_log(str(tmp_path / "plain")), read_log(str(tmp_path / "fsdp"))
    assert [r["loss"] for r in plain] == [r["loss"] for r in fsdp]
    ckpt = torch.load(str(tmp_path / "fsdp" / "ckpt.pt"), weights_only=True)
    assert isinstance(ckpt["optimizer"]["param_groups"][0]["params"][0], str)   # by name
    more = dict(kw, max_iters=6, init_from="resume")
    train.main(tiny_args(ds, str(tmp_path / "fsdp"), **more))               # fsdp -> plain
    train.main(tiny_args(ds, str(tmp_path / "plain"), fsdp=True, **more))   # plain -> fsdp
    a, b = read_log(str(tmp_path / "plain")), read_log(str(tmp_path / "fsdp"))
    assert [r["iter"] for r in a] == list(range(6))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_train_fsdp_refuses_cuda_graphs():
    import train
    with pytest.raises(train.ConfigError, match="fsdp=True does not run under CUDA graphs"):
        train.get_config(["--fsdp", "--compile", "--compile_mode=reduce-overhead",
                          "--device=cpu"])


def test_shard_model_needs_blocks():
    with pytest.raises(ValueError, match="blocks"):
        parallel.shard_model(torch.nn.Linear(2, 2))

if __name__ == "__main__":
    worker(sys.argv[1])
