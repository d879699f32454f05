"""
Random-window batches from a memory-mapped train.bin / val.bin.

Each batch is batch_size windows of block_size + 1 consecutive tokens at random offsets; x is a window
without its last token, y the same window without its first (next-token targets). The offsets come
from the loader's own numpy Generator, seeded with (seed, rank): each DDP rank draws different data,
and a run resumed with load_state_dict() draws exactly the batches it would have drawn.
"""
import os

import numpy as np
import torch

from data.common import load_meta


def read_split(data_dir, split):
    """data_dir/<split>.bin memory-mapped (uint16 token ids), checked against meta.json where
    there is one: every token there (its byte count) and every id inside the vocabulary."""
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        raise ValueError(f"{path} is {'missing' if not os.path.exists(path) else 'empty'}: "
                         f"prepare the dataset again")
    size = os.path.getsize(path)
    meta = load_meta(data_dir) if os.path.exists(os.path.join(data_dir, "meta.json")) else None
    want = meta.get(f"{split}_tokens") if meta else None
    if size % 2 or (want is not None and size // 2 != want):  # a cut or foreign file
        raise ValueError(f"{path} has {size:,} bytes" + (f", not the {2 * want:,} of the "
                         f"{want:,} tokens meta.json records" if want is not None else
                         ", not whole uint16 tokens") + ": prepare the dataset again")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if meta is not None:
        vocab_size = meta["vocab_size"]
        largest = int(tokens.max())  # one pass over the file, once
        if largest >= vocab_size:
            raise ValueError(f"{path} holds token id {largest}, but meta.json says vocab_size is "
                             f"{vocab_size}: the .bin and meta.json do not belong together; prepare again")
    return tokens


class BinLoader:
    def __init__(self, data_dir, split, block_size, batch_size, seed, device="cpu", rank=0, world_size=1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.path = os.path.join(data_dir, f"{split}.bin")
        self.tokens = read_split(data_dir, split)
        if len(self.tokens) < block_size + 1:
            raise ValueError(f"{self.path} has {len(self.tokens)} tokens, fewer than one window of "
                             f"block_size + 1 = {block_size + 1}: use a smaller block_size or more data")
        self.block_size, self.batch_size = block_size, batch_size
        self.device = torch.device(device)
        self.rng = np.random.default_rng([seed, rank])
        self.step = 0  # batches drawn so far

    def next_batch(self):
        starts = self.rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)
        windows = np.stack([self.tokens[s:s + self.block_size + 1] for s in starts]).astype(np.int64)
        x = torch.from_numpy(windows[:, :-1].copy())
        y = torch.from_numpy(windows[:, 1:].copy())
        self.step += 1
        if self.device.type == "cuda":  # pinned host memory lets the copy overlap with compute
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state, "step": self.step}

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state["rng"]
        self.step = state["step"]
