"""Helpers for tests/test_train.py and tests/test_sample.py: a tiny char dataset, tiny configs,
and a loader that hands each DDP rank its slice of one global batch."""
import json
import os
import random
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import data.loader  # noqa: E402

_BinLoader = data.loader.BinLoader

WORDS = ("the king", "my lord", "good night", "sweet love", "to be", "or not", "is the question",
         "fair lady", "a horse", "my kingdom")

def make_char_dataset(folder, n_train=20000, n_val=3000, seed=0):
    """A learnable char-level corpus (sentences from a small word list) as train.bin/val.bin/meta.json."""
    rng = random.Random(seed)
    def text(n):
        out = []
        while sum(map(len, out)) < n:
            out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))).capitalize() + ".\n")
        return "".join(out)[:n]
    train, val = text(n_train), text(n_val)
    itos = sorted(set(train + val))
    stoi = {ch: i for i, ch in enumerate(itos)}
    os.makedirs(folder, exist_ok=True)
    for split, t in (("train", train), ("val", val)):
        np.array([stoi[ch] for ch in t], dtype=np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    meta = dict(tokenizer="char", vocab_size=len(itos), itos=itos, stoi=stoi, dtype="uint16",
                train_tokens=len(train), val_tokens=len(val))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)
    return folder

def tiny_args(data_folder, out_dir, **overrides):
    """--key=value args for a tiny, fast run on the CPU."""
    args = dict(out_dir=out_dir, data_dir=os.path.dirname(data_folder),
                dataset=os.path.basename(data_folder), device="cpu", backend="torch",
                batch_size=4, block_size=32, n_layer=2, n_head=2, n_embd=32, max_iters=20,
                eval_interval=10, eval_iters=2, log_interval=1, warmup_iters=2,
                learning_rate=3e-3, min_lr=3e-4, seed=1)
    args.update(overrides)
    return [f"--{k}={v}" for k, v in args.items()]

MOE = dict(n_expert=4, top_k=2)

@pytest.fixture(autouse=True, scope="module")
def keep_global_rng():
    """train.main seeds the global RNGs, as a script should: give other test modules theirs back."""
    state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    torch.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])

def read_log(out_dir, kind="train"):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["type"] == kind]

class GlobalBatchLoader:
    """data.loader.BinLoader's interface, but every rank draws the same global batch of
    batch_size * world_size windows and keeps its own slice: a 2-process run then sees exactly
    the data of a 1-process run with twice the batch size."""

    def __init__(self, data_dir, split, block_size, batch_size, seed, device="cpu", rank=0,
                 world_size=1):
        self.inner = _BinLoader(data_dir, split, block_size, batch_size * world_size, seed, device)
        self.rank, self.batch_size = rank, batch_size

    def next_batch(self):
        x, y = self.inner.next_batch()
        s = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return x[s], y[s]

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)

if __name__ == "__main__":
    # a DDP worker: `RANK=.. WORLD_SIZE=.. python tests/train_helpers.py --key=value ...`
    import train
    data.loader.BinLoader = GlobalBatchLoader
    train.main(sys.argv[1:])
    train._exit(0)  # as train.py's own __main__: no interpreter finalization under DDP
