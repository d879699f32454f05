"""checkpoint.py: weights_only loading, the checksum, RNG states as tensors, rotation that keeps
readable files, failed saves that clean up."""
import errno
import os
import random

import numpy as np
import pytest
import torch

from train_helpers import ROOT  # noqa: F401  (puts the repo root on sys.path)

import checkpoint  # noqa: E402
from checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402


def fake_ckpt(v=1.0, **extra):
    return dict(model={"w": torch.full((4, 4), v)}, optimizer={"state": {}}, iter_num=int(v),
                best_val_loss=v, config={"n_layer": 1}, model_args={"n_layer": 1},
                recipe="bf16", rng=[checkpoint.rng_state()], **extra)


def test_rng_state_round_trips_and_is_plain(tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    state = checkpoint.rng_state()
    torch.save(state, tmp_path / "s.pt")
    want = random.random(), np.random.rand(), torch.rand(1).item()
    checkpoint.set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_checkpoints_load_with_weights_only(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(fake_ckpt(), path)
    ck = torch.load(path, weights_only=True)
    want = fake_ckpt()
    assert torch.equal(ck["model"]["w"], want["model"]["w"])
    keys = ("iter_num", "best_val_loss", "config", "model_args", "recipe")
    assert {k: ck[k] for k in keys} == {k: want[k] for k in keys}
    assert ck["checksum"] == checkpoint.checksum(ck)


def test_a_folder_or_a_missing_file_names_what_is_there(tmp_path):
    save_checkpoint(fake_ckpt(), str(tmp_path / "ckpt.pt"))
    with pytest.raises(checkpoint.CheckpointError, match=r"is a folder: name a checkpoint file, "
                                                         r"e.g. .*ckpt.pt"):
        checkpoint.load_checkpoint(str(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint at .*ckpt_40.pt; .* holds "
                                                         r"ckpt.pt"):
        checkpoint.load_checkpoint(str(tmp_path / "ckpt_40.pt"))


def test_fitting_recipes_of_a_model():
    args = dict(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=48)
    assert checkpoint.fitting_recipes(args) == ["bf16", "ufp4", "e2m1", "nvfp4"]   # not 1x32 blocks


def test_flipped_byte_in_tensor_data_is_refused_naming_the_backup(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(fake_ckpt(1.0), path)
    save_checkpoint(fake_ckpt(2.0), path)
    blob = bytearray(open(path, "rb").read())
    at = blob.index(torch.full((4, 4), 2.0).numpy().tobytes())   # the tensor's stored bytes
    blob[at + 5] ^= 0x40
    open(path, "wb").write(bytes(blob))
    with pytest.raises(CheckpointError, match=r"ckpt.pt is corrupt: its contents do not match its "
                                              r"checksum.*readable: --resume_from=.*ckpt_prev.pt"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="readable: --ckpt_path=.*ckpt_prev.pt"):
        load_checkpoint(path, flag="--ckpt_path")


def test_rotation_never_moves_an_unreadable_file_over_a_readable_one(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(fake_ckpt(1.0), path)
    save_checkpoint(fake_ckpt(2.0), path)
    with open(path, "r+b") as f:   # ckpt.pt truncated; ckpt_prev.pt holds iter 1
        f.truncate(100)
    checkpoint._verified.clear()
    save_checkpoint(fake_ckpt(3.0), path)   # e.g. a run resumed from ckpt_prev.pt
    assert load_checkpoint(path)[0]["iter_num"] == 3
    assert load_checkpoint(str(tmp_path / "ckpt_prev.pt"))[0]["iter_num"] == 1


def test_best_is_kept_apart_from_the_latest(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(fake_ckpt(1.0), path, best=True)
    save_checkpoint(fake_ckpt(2.0), path)
    save_checkpoint(fake_ckpt(3.0), path)
    assert load_checkpoint(str(tmp_path / "ckpt_best.pt"))[0]["iter_num"] == 1
    assert load_checkpoint(path)[0]["iter_num"] == 3


def test_failed_save_removes_its_temp_file_and_names_the_space(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(fake_ckpt(1.0), path)

    def disk_full(obj, f):
        f.write(b"PK\x03\x04 part")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"could not write .*ckpt.pt.tmp \(disk full\): No "
                                              r"space left on device; a checkpoint needs about "
                                              r"\d+ MiB and [\d,]+ MiB are free"):
        save_checkpoint(fake_ckpt(2.0), path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
    monkeypatch.undo()
    assert load_checkpoint(path)[0]["iter_num"] == 1


def test_older_pickles_with_numpy_objects_are_refused(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    torch.save(dict(fake_ckpt(), rng=[np.random.get_state()]), path)
    with pytest.raises(CheckpointError, match="holds Python objects other than tensors.*refusing"):
        load_checkpoint(path)


def test_the_cuda_rng_state_is_this_processs_own_gpus(monkeypatch):
    """A process saves its own GPU's generator, not every visible GPU's: a checkpoint written
    where 2 GPUs were visible must resume where 1 is. Older checkpoints hold a list (one per
    visible GPU): the process takes its own device's entry, or the first."""
    states = [torch.tensor([i], dtype=torch.uint8) for i in range(2)]
    got = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: states[1])
    monkeypatch.setattr(torch.cuda, "set_rng_state", got.append)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: pytest.fail("per-GPU list restored"))
    s = checkpoint.rng_state()
    assert s["cuda"] is states[1]
    for device, want in ((0, 0), (1, 1), (3, 0)):   # 3: a device the saving process did not see
        monkeypatch.setattr(torch.cuda, "current_device", lambda d=device: d)
        checkpoint.set_rng_state(dict(s, cuda=states))
        assert got.pop() is states[want]
    checkpoint.set_rng_state(s)
    assert got.pop() is states[1]
