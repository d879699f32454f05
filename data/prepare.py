"""
Any local text files -> train.bin / val.bin / meta.json, in the same format as the named datasets.
Each file is one document (see data.common.SPLIT_RULE for the split).

    python data/prepare.py --input notes.txt book.txt --out data/mycorpus [--tokenizer char|gpt2] [--val_fraction 0.1]

The tokenizer is char unless --tokenizer says gpt2: the same default as train.py's
--dataset_input, so both build the same dataset from the same files.
"""
import argparse
import os
import sys

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import DATASETS
from data.common import clean_text, read_text_file, sha256_file, write_dataset

DEFAULT_TOKENIZER = "char"   # train.py builds from --dataset_input with it too


def prepare(input_paths, out_dir, tokenizer=DEFAULT_TOKENIZER, val_fraction=0.1):
    # each file counted under its path as given: two notes.txt from different folders stay apart
    documents = [(path, clean_text(read_text_file(path))) for path in input_paths]
    return write_dataset(out_dir, documents, tokenizer=tokenizer, val_fraction=val_fraction,
                         source="local files: " + ", ".join(input_paths),
                         inputs=[(path, sha256_file(path)) for path in input_paths])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="UTF-8 text files, one document each")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--tokenizer", choices=["char", "gpt2"], default=DEFAULT_TOKENIZER,
                        help="char (the default, as train.py's --dataset_input builds) or gpt2 "
                             "(GPT-2 BPE)")
    parser.add_argument("--val_fraction", type=float, default=0.1)
    args = parser.parse_args()
    name = os.path.basename(os.path.normpath(args.out))
    if name in DATASETS:  # train.py would take that text for the named dataset
        sys.exit(f"error: {name!r} is a named dataset, which its own data/{name}/prepare.py builds; "
                 f"give your text another name, e.g. --out data/my_{name}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        sys.exit(f"error: --out {args.out} is a file: give a folder")
    try:
        meta = prepare(args.input, args.out, args.tokenizer, args.val_fraction)
    except (ValueError, RuntimeError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"{args.tokenizer} tokenizer, vocab {meta['vocab_size']}, train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens -> {args.out}")
