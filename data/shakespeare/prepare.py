"""
Shakespeare with GPT-2 BPE (tiktoken): the same text and options as data/shakespeare_char.

    python data/shakespeare/prepare.py [--input PATH | --url [URL]]
"""
import argparse
import os
import sys

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data.common import DEFAULT_CACHE_DIR, write_dataset
from data.shakespeare_char.prepare import TINYSHAKESPEARE_URL, shakespeare_source

HERE = os.path.dirname(os.path.abspath(__file__))


def prepare(out_dir=HERE, input_path=None, url=None, cache_dir=DEFAULT_CACHE_DIR, val_fraction=0.1):
    documents, inputs, source = shakespeare_source(input_path, url, cache_dir)
    return write_dataset(out_dir, documents, tokenizer="gpt2", val_fraction=val_fraction,
                         source=source, inputs=inputs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", dest="input_path", help="local text file instead of the default source")
    parser.add_argument("--url", nargs="?", const=TINYSHAKESPEARE_URL,
                        help="download the text from this URL (default: tinyshakespeare; needs internet)")
    parser.add_argument("--out", default=HERE, help="output folder (default: this script's folder)")
    parser.add_argument("--cache_dir", default=DEFAULT_CACHE_DIR)
    parser.add_argument("--val_fraction", type=float, default=0.1)
    args = parser.parse_args()
    try:
        meta = prepare(args.out, args.input_path, args.url, args.cache_dir, args.val_fraction)
    except RuntimeError as e:  # a source could not be fetched: the message says how to fix it
        sys.exit(f"error: {e}")
    print(f"train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens -> {args.out}")
