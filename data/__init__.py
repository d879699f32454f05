"""
Datasets for nanoFP4. Each dataset lives in data/<name>/ as train.bin / val.bin (np.uint16 token ids)
plus meta.json; data/<name>/prepare.py makes them. train.py calls prepare_dataset(name), which
prepares a dataset on first use; data.loader.BinLoader reads batches from the .bin files.
"""
import importlib
import os

from data.common import load_meta

DATASETS = ("shakespeare_char", "shakespeare", "literature", "tinyshakespeare_char")


def named_folder_error(out, own, other_text=False):
    """Why a prepare script must not write to `out` ("" if it may): a named dataset's folder is what
    train.py reads as that dataset, so it takes only its own script's own source."""
    name = os.path.basename(os.path.abspath(out))
    if name in DATASETS and (other_text or name != own):
        return (f"{out} is the folder of the named dataset {name!r}, which train.py reads as that "
                f"dataset's own source; other text gets a folder of its own: give "
                f"--out=data/NAME and train with --dataset=NAME")
    return ""


def prepare_dataset(name: str, data_dir: str = "data", force: bool = False) -> str:
    """Folder of dataset `name` under data_dir, prepared first if its files are missing (or
    always, with force)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    path = os.path.join(data_dir, name)
    if not force and all(os.path.exists(os.path.join(path, f))
                         for f in ("train.bin", "val.bin", "meta.json")):
        return path
    print(f"preparing dataset {name} (first run only)...", flush=True)
    prepare = importlib.import_module(f"data.{name}.prepare").prepare
    try:
        prepare(out_dir=path, cache_dir=os.path.join(data_dir, "cache"))
    except Exception as e:
        reason = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise RuntimeError(f"preparing dataset {name!r} into {path} failed: {reason} "
                           f"(`python data/{name}/prepare.py` shows the whole error; downloads are cached "
                           f"in {os.path.join(data_dir, 'cache')})") from e
    return path
