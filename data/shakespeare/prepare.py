"""
Shakespeare with GPT-2 BPE (tiktoken): the same text and options as data/shakespeare_char.

    python data/shakespeare/prepare.py [--input PATH | --url [URL]] [--out data/NAME]
"""
import os
import sys

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data.common import DEFAULT_CACHE_DIR
from data.shakespeare_char import prepare as shakespeare_char

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = "gpt2"


def prepare(out_dir=HERE, input_path=None, url=None, cache_dir=DEFAULT_CACHE_DIR, val_fraction=0.1):
    return shakespeare_char.prepare(out_dir, input_path, url, cache_dir, val_fraction, tokenizer=TOKENIZER)


if __name__ == "__main__":
    shakespeare_char.main(TOKENIZER, HERE, __doc__)
