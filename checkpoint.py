"""
checkpoint.py: the files train.py writes and sample.py reads, and the model a checkpoint describes.

A checkpoint is a dict of tensors and plain Python values (no numpy objects, no classes), so it
loads with torch.load(weights_only=True): loading one cannot run code. It carries a sha256 of its
contents (`checksum`), checked on every load, so a flipped byte is found before it trains.

Files in a run's out_dir: ckpt.pt (the latest healthy state), ckpt_prev.pt (the one before it),
ckpt_best.pt (the lowest val loss so far); train.py adds model.safetensors (the latest weights
alone) and log.png. save_checkpoint writes atomically: a crash at any moment
leaves each of them either the old or the new complete file.
"""
import errno
import hashlib
import os
import random
import shutil

import numpy as np
import torch

import fp4
from configurator import ConfigError
from model import GPT, GPTConfig

LATEST, PREVIOUS, BEST = "ckpt.pt", "ckpt_prev.pt", "ckpt_best.pt"
CKPT_KEYS = ("model", "optimizer", "iter_num", "best_val_loss", "config", "model_args", "recipe")
# config keys that override a recipe preset (None = the preset's choice) -> fp4.make_recipe's names
RECIPE_KEYS = dict(recipe_format="fmt", recipe_rht="rht", recipe_sr_dy="sr_dy",
                   recipe_rht_size="rht_size", recipe_weight_2d="weight_2d",
                   recipe_bf16_first="bf16_first", recipe_bf16_last="bf16_last",
                   recipe_fp8_gemm="fp8_gemm", recipe_fp8_fast_accum="fp8_fast_accum",
                   recipe_fp8_wgrad_x="fp8_wgrad_x", recipe_fp8_x_scale="fp8_x_scale",
                   recipe_fp8_weight_cache="fp8_weight_cache",
                   recipe_fp8_dy_scale="fp8_dy_scale", recipe_fp8_step_room="fp8_step_room")


class CheckpointError(RuntimeError):
    pass


def prev_path(path):
    root, ext = os.path.splitext(path)
    return root + "_prev" + ext


def best_path(path):
    return os.path.join(os.path.dirname(path), BEST)

# -----------------------------------------------------------------------------
# the model a checkpoint (or a config) describes


def make_recipe_from(cfg):
    """The fp4 recipe named by cfg["recipe"] with the config's ablation overrides."""
    overrides = {arg: cfg.get(key) for key, arg in RECIPE_KEYS.items()
                 if cfg.get(key) not in (None, "")}
    try:
        return fp4.make_recipe(cfg["recipe"], **overrides)
    except ValueError as e:
        raise ConfigError(f"recipe: {e}") from None


def build_model(ckpt, recipe, path="the checkpoint"):
    """The checkpoint's model with its weights, its linears quantized by `recipe`, on the CPU."""
    model = GPT(GPTConfig(**ckpt["model_args"]))
    try:
        model = fp4.convert(model, recipe)
    except ValueError as e:
        raise ConfigError(f"{e}; recipes that fit the model in {path}: "
                          f"{', '.join(fitting_recipes(ckpt['model_args']))}") from None
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: the weights do not fit the model: {e}") from e
    return model

def recipe_misfit(config, recipe):
    """Why the model of GPTConfig `config` does not fit `recipe` (a name or an fp4 recipe): its
    widths against the recipe's blocks; "" where it fits. Built on the meta device: free."""
    with torch.device("meta"):
        try:
            fp4.convert(GPT(config), recipe)
        except ValueError as e:
            return str(e)
    return ""


def fitting_recipes(model_args):
    """The recipe presets whose blocks fit the model's widths."""
    config = GPTConfig(**model_args)
    return [name for name in fp4.RECIPES if not recipe_misfit(config, name)]


def data_changes(trained, meta):
    """How a dataset's meta.json differs from the one a checkpoint was trained on ("" where it
    is the same data): the same name rebuilt from other text must not continue or score a run."""
    if not trained:   # (a checkpoint without its meta)
        return ""
    changes = [f"{key} {trained.get(key)} -> {meta.get(key)}"
               for key in ("tokenizer", "vocab_size", "train_tokens", "val_tokens")
               if trained.get(key) != meta.get(key)]
    inputs = [[(i.get("file", "?"), i.get("sha256")) for i in m.get("inputs", [])]
              for m in (trained, meta)]
    if [d for _, d in inputs[0]] != [d for _, d in inputs[1]]:
        old, new = (", ".join(f for f, _ in files) or "-" for files in inputs)
        changes.append(f"built from other files ({old} -> {new})")
    return "; ".join(changes)

# -----------------------------------------------------------------------------
# RNG states as tensors and plain values (torch.load's weights_only=True refuses numpy arrays)


def load_model(path, recipe_name, device, use):
    """(model in eval mode on device, its recipe, checkpoint, path) for sampling or evaluation:
    the checkpoint's recipe with its ablation overrides, or recipe_name without them."""
    ckpt, path = load_checkpoint(path, flag="--ckpt_path")
    if "meta" not in ckpt:
        raise CheckpointError(f"{path} holds no tokenizer (meta): cannot {use}")
    cfg = dict(ckpt["config"])
    if recipe_name:
        cfg.update({k: None for k in RECIPE_KEYS}, recipe=recipe_name)
    recipe = make_recipe_from(cfg)
    return build_model(ckpt, recipe, path).eval().to(device), recipe, ckpt, path


def rng_state():
    np_state = np.random.get_state(legacy=False)
    return dict(python=random.getstate(),
                numpy=dict(np_state, state=dict(
                    key=torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                    pos=int(np_state["state"]["pos"]))),
                torch=torch.get_rng_state(),   # and this process's own GPU's (not every visible one's)
                cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)


def set_rng_state(s):
    random.setstate(s["python"])
    np_state = dict(s["numpy"])
    np_state["state"] = dict(key=np_state["state"]["key"].numpy().astype(np.uint32),
                             pos=np_state["state"]["pos"])
    np.random.set_state(np_state)
    torch.set_rng_state(s["torch"])
    cuda = s["cuda"]
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):   # older checkpoints: every GPU the process saw
            here = torch.cuda.current_device()
            cuda = cuda[here] if here < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda)

# -----------------------------------------------------------------------------
# checksum of the contents: every tensor's bytes and every plain value, in the dict's order


def _digest(obj, h):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k, v in obj.items():
            _digest(k, h)
            _digest(v, h)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__[0]}{len(obj)}".encode())
        for v in obj:
            _digest(v, h)
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def checksum(ckpt):
    h = hashlib.sha256()
    _digest({k: v for k, v in ckpt.items() if k != "checksum"}, h)
    return h.hexdigest()


def tensor_bytes(obj):
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0

# -----------------------------------------------------------------------------
# writing: a file is only ever replaced by a complete one, and rotation keeps readable files

_verified = set()   # (path, inode, size, mtime) of the files this process wrote or read back whole


def _stamp(path):
    st = os.stat(path)
    return os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns


def is_readable(path):
    """Whether `path` is a complete checkpoint whose checksum holds (a full read, unless this
    process wrote or verified that very file)."""
    if not os.path.exists(path):
        return False
    if _stamp(path) in _verified:
        return True
    try:
        _read(path)
    except CheckpointError:
        return False
    return True


def _fsync_dir(path):
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _link_or_copy(src, dst):
    """dst becomes a second name of src (a copy where hard links are not supported), atomically."""
    tmp = dst + ".tmp"
    if os.path.exists(tmp):
        os.remove(tmp)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _write(ckpt, tmp):
    """torch.save into tmp and fsync; on any failure tmp is removed and the space is named."""
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        cause = os_error(e)
        if cause is not None:
            need = tensor_bytes(ckpt) / 2**20
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(tmp))).free / 2**20
            hint = " (disk full)" if cause.errno == errno.ENOSPC else ""
            raise CheckpointError(
                f"could not write {tmp}{hint}: {cause.strerror or cause}; a checkpoint needs about "
                f"{need:,.0f} MiB and {free:,.0f} MiB are free there: free some space or use "
                f"another --out_dir (the earlier checkpoints are untouched)") from None
        raise


def os_error(e):
    """The OSError behind e, if any: torch.save reports a failed write (a full disk) as a
    RuntimeError raised while handling the OSError."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def save_checkpoint(ckpt, path, best=False):
    """Write ckpt (with its checksum) to `path`: a temp file, fsync, the old `path` kept as
    *_prev.pt when it is readable (a damaged one is never rotated over a good backup), then a
    rename into place. best=True also makes it ckpt_best.pt (a hard link: no second copy)."""
    ckpt = dict(ckpt, checksum=checksum(ckpt))
    tmp, prev = path + ".tmp", prev_path(path)
    _write(ckpt, tmp)
    if os.path.exists(path):
        if is_readable(path):   # a hard link keeps `path` in place the whole time
            _link_or_copy(path, prev)
        else:
            print(f"warning: {path} is unreadable: replacing it, {prev} is left as it is")
    os.replace(tmp, path)
    _verified.add(_stamp(path))
    if best:
        _link_or_copy(path, best_path(path))
    _fsync_dir(path)

# -----------------------------------------------------------------------------
# reading: clear errors that name a file that is good


def _reason(e):
    """The informative line of a torch.load error (weights_only errors open with boilerplate that
    suggests weights_only=False, which would run whatever code the file holds)."""
    text = str(e).split("WeightsUnpickler error:")[-1]
    head = ""
    if text.startswith("Weights only load failed"):
        head = text[len("Weights only load failed."):].split("In PyTorch 2.6")[0].strip()
        text = text.split("trusted source.", 1)[-1]
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line.strip().startswith(("Check the documentation", "Please file"))]
    if not lines:
        return head.splitlines()[0] if head else type(e).__name__
    return lines[0].split(" was not an allowed global")[0]


def _read(path, map_location="cpu"):
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        why = _reason(e)
        if "unsupported global" in why.lower():
            raise CheckpointError(f"{path} holds Python objects other than tensors and plain "
                                  f"values (a checkpoint of an older train.py, or not ours): "
                                  f"refusing to load it ({why})") from None
        with open(path, "rb") as f:
            head = f.read(4)
        if "Unsupported operand" in why or head and head != b"PK\x03\x04":
            raise CheckpointError(f"cannot read checkpoint {path} ({os.path.getsize(path)} bytes): "
                                  f"torch.save did not write it (a corrupt file, or another kind of "
                                  f"file: name a ckpt.pt)") from None
        raise CheckpointError(f"cannot read checkpoint {path} ({os.path.getsize(path)} bytes): it "
                              f"is truncated or corrupt ({type(e).__name__}: {why})") from None
    missing = [k for k in CKPT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a nanoFP4 checkpoint: missing {missing}")
    if ckpt.get("checksum") != checksum(ckpt):
        raise CheckpointError(f"checkpoint {path} is corrupt: its contents do not match its "
                              f"checksum (a damaged disk or copy)")
    _verified.add(_stamp(path))
    return ckpt


def _alternatives(path):
    """The other checkpoints of the same run that read back whole."""
    return [p for p in (prev_path(path), best_path(path))
            if p != path and os.path.exists(p) and is_readable(p)]


def load_checkpoint(path, map_location="cpu", flag="--resume_from"):
    """(checkpoint, the path it came from), loaded with weights_only=True and its checksum
    checked. A damaged file is refused with the readable alternatives named (as `flag`=PATH, or
    as paths where flag is None)."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder: name a checkpoint file, e.g. "
                              f"{os.path.join(path, LATEST)}")
    if not os.path.exists(path):
        prev = prev_path(path)
        if os.path.exists(prev):   # a crash between the two renames of save_checkpoint
            print(f"warning: {path} is missing; using the previous checkpoint {prev}")
            return load_checkpoint(prev, map_location, flag)
        folder = os.path.dirname(path) or "."
        try:
            there = sorted(f for f in os.listdir(folder) if f.endswith(".pt"))
        except OSError:   # no such folder, or not readable
            there = []
        raise CheckpointError(f"no checkpoint at {path}; " + (
            f"{folder} holds {', '.join(there)}" if there else
            "train with --init_from=scratch first"))
    try:
        return _read(path, map_location), path
    except CheckpointError as e:
        good = _alternatives(path)
        hint = "; readable: " + ", ".join(f"{flag}={p}" if flag else p for p in good) if good else \
            "; no other readable checkpoint of this run"
        raise CheckpointError(f"{e}{hint}") from None

# -----------------------------------------------------------------------------
# a run owns its out_dir: a lock against a second live run, no scratch run over a finished one

LOG, PREVIOUS_LOG = "log.jsonl", "log_prev.jsonl"
LOCK = "lock"
RUN_FILES = (LATEST, PREVIOUS, BEST, LOG)
WEIGHTS, PLOT = "model.safetensors", "log.png"   # derived from a run's files: go with them


def lock_out_dir(out_dir):
    """Create out_dir and hold an flock on out_dir/lock (which names this pid) until
    unlock_out_dir: a second live run into the same folder is refused. The kernel drops the lock
    of a process that dies, so a lock file left by a killed run is free and taken over (its pid
    said in a note). Also finds an unwritable out_dir before anything is computed."""
    import fcntl
    path, created = os.path.join(out_dir, LOCK), os.path.abspath(out_dir)
    while not os.path.isdir(os.path.dirname(created)):   # the topmost folder this will create
        created = os.path.dirname(created)
    created = created if not os.path.isdir(out_dir) else None
    while True:
        try:
            os.makedirs(out_dir, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"cannot write into out_dir {out_dir} ({e.strerror}): pick a "
                              f"writable --out_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"out_dir {out_dir} is in use by a live run (pid {holder}): wait "
                              f"for it to finish, or pick another --out_dir") from None
        try:   # the file may have been removed by its last holder between open and flock
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    stale = os.pread(fd, 200, 0).decode(errors="replace").strip()
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    if stale:
        print(f"note: {path} was left by pid {stale}, which no longer runs: taken over")
    return fd, created


def unlock_out_dir(lock, out_dir):
    """Remove the lock file while still holding it, then release it; a folder that lock_out_dir
    created and nothing was written into goes too."""
    fd, created = lock
    try:
        os.remove(os.path.join(out_dir, LOCK))
    except FileNotFoundError:
        pass
    os.close(fd)
    folder = os.path.abspath(out_dir)
    while created and not os.listdir(folder):   # a run that wrote nothing leaves no empty folder
        os.rmdir(folder)
        if folder == created:
            break
        folder = os.path.dirname(folder)


def in_folder(path, folder):
    """Whether the file `path` lies in `folder`: a checkpoint resumed from elsewhere is a fork."""
    return os.path.dirname(os.path.abspath(path)) == os.path.abspath(folder)


def claim_out_dir(out_dir, init_from, resume_from, overwrite):
    """(files to remove, files to keep aside) for this run to own out_dir. A scratch run never
    lands on another run's checkpoints, nor does a resume from elsewhere (a fork), unless
    overwrite says so (their files are removed then); a log alone, of a run that stopped before
    its first checkpoint, is kept aside as log_prev.jsonl (for a fork too: its own log starts
    there). Resuming the run in out_dir, or forking into a new folder, is free."""
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(out_dir, f))]
    ckpts = [f for f in found if f != LOG]
    fork = init_from == "resume" and resume_from and not in_folder(resume_from, out_dir)
    if init_from == "scratch" and ckpts:
        clash = (f"out_dir {out_dir} holds a run ({', '.join(found)}): continue it with "
                 f"--init_from=resume, replace it with --overwrite=True, or pick another --out_dir")
    elif fork and ckpts:
        clash = (f"out_dir {out_dir} holds another run ({', '.join(ckpts)}): resuming "
                 f"{resume_from} into it would replace its checkpoints; fork into a new --out_dir, "
                 f"drop --resume_from to continue that run, or replace it with --overwrite=True")
    elif (init_from == "scratch" or fork) and found:
        return [], found
    else:
        return [], []
    if not overwrite:
        raise ConfigError(clash)
    return found + [f for f in (WEIGHTS, PLOT) if os.path.exists(os.path.join(out_dir, f))], []


def check_rewind(src, iter_num, out_dir, overwrite):
    """Resuming out_dir's own run from one of its older checkpoints (ckpt_best.pt, ckpt_prev.pt)
    would replace its later ckpt.pt and cut log.jsonl back to iter_num: refused unless overwrite
    says so. A ckpt.pt that does not read back whole (the reason to resume from ckpt_prev.pt) is
    no later state to lose."""
    latest = os.path.join(out_dir, LATEST)
    if not in_folder(src, out_dir) or os.path.abspath(src) == os.path.abspath(latest) \
            or not os.path.exists(latest):
        return
    try:
        later = _read(latest)["iter_num"]
    except CheckpointError:
        return
    if later <= iter_num:
        return
    if not overwrite:
        raise ConfigError(f"resuming {src} (iter {iter_num}) in its own out_dir would replace "
                          f"{latest} (iter {later}) and cut log.jsonl back to iter {iter_num}: "
                          f"fork it into a new --out_dir, drop --resume_from to continue from "
                          f"iter {later}, or go back in place with --overwrite=True")
    print(f"note: --overwrite=True: going back from iter {later} to {src}'s {iter_num}; "
          f"{latest} and log.jsonl's later records will be replaced", flush=True)


def remove_run_files(out_dir, names):
    for name in names:
        os.remove(os.path.join(out_dir, name))
