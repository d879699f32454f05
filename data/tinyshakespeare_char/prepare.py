"""
Character-level tinyshakespeare: nanoGPT's shakespeare_char (1.1M characters, vocab 65), the
input.txt of karpathy/char-rnn, downloaded on first use and checked against its sha256.

    python data/tinyshakespeare_char/prepare.py                     # downloads (needs internet)
    python data/tinyshakespeare_char/prepare.py --input path/to/input.txt   # a local copy

train.py builds it the same way on first use (`--dataset=tinyshakespeare_char`); offline, give it
a local copy with `--dataset_input=path/to/input.txt`.
"""
import argparse
import os
import sys

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data import named_folder_error  # noqa: E402
from data.common import DEFAULT_CACHE_DIR, clean_text, read_text_file, sha256_file, url_download, write_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TOKENIZER = "char"   # as its name says: train.py builds a local copy with no other


def fetch(cache_dir=DEFAULT_CACHE_DIR):
    """Path of input.txt in the download cache, fetched once; a wrong sha256 is refused."""
    try:
        path = url_download(URL, cache_dir)
    except RuntimeError as e:
        reason = str(e).splitlines()[0]
        raise RuntimeError(f"{reason}; offline, pass a local copy of tinyshakespeare with "
                           f"--dataset_input=path/to/input.txt (train.py) or --input "
                           f"path/to/input.txt (this script)") from None
    actual = sha256_file(path)
    if actual != SHA256:
        os.remove(path)
        raise RuntimeError(f"{URL} gave a file with sha256 {actual}, not tinyshakespeare's "
                           f"{SHA256} (removed it); pass a good copy with "
                           f"--dataset_input=path/to/input.txt (train.py) or --input (this script)")
    return path


def prepare(out_dir=HERE, cache_dir=DEFAULT_CACHE_DIR, input_path=None, val_fraction=0.1):
    path = input_path or fetch(cache_dir)   # fetch checks the download's sha256
    text = clean_text(read_text_file(path))
    digest = sha256_file(path)
    if digest != SHA256:
        raise ValueError(f"{input_path} is not tinyshakespeare's input.txt (sha256 "
                         f"{digest[:12]}..., not {SHA256[:12]}...): other text gets a dataset of its "
                         f"own (data/prepare.py, or train.py --dataset=NAME --dataset_input=FILE)")
    return write_dataset(out_dir, [(os.path.basename(path), text)], tokenizer=TOKENIZER,
                         val_fraction=val_fraction, source=f"tinyshakespeare from {input_path or URL}",
                         inputs=[(input_path or URL, digest)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", dest="input_path", help="a local copy of input.txt")
    parser.add_argument("--out", default=HERE, help="output folder (default: this script's folder)")
    parser.add_argument("--cache_dir", default=DEFAULT_CACHE_DIR)
    parser.add_argument("--val_fraction", type=float, default=0.1)
    args = parser.parse_args()
    error = named_folder_error(args.out, os.path.basename(HERE))
    if error:
        sys.exit(f"error: {error}")
    try:
        meta = prepare(args.out, args.cache_dir, args.input_path, args.val_fraction)
    except (RuntimeError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"vocab {meta['vocab_size']}, train {meta['train_tokens']:,} tokens, "
          f"val {meta['val_tokens']:,} tokens -> {args.out}")
