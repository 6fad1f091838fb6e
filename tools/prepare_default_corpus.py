"""Build (or reuse) the offline default corpus: text from the installed Python's docstrings and docs,
a byte-level BPE tokenizer trained on it, and its Megatron mmap dataset. Prints one JSON line with
the data prefix and tokenizer paths. See ``megatron.data.corpus``.

    python tools/prepare_default_corpus.py --output-dir data_cache/default_corpus
"""

import argparse
import json
import sys

from megatron.data.corpus import DEFAULT_MIN_BYTES, DEFAULT_VOCAB_SIZE, prepare_default_corpus


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="data_cache/default_corpus")
    parser.add_argument("--min-bytes", type=int, default=DEFAULT_MIN_BYTES, help="bytes of text to collect")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--workers", type=int, default=2, help="processes parsing and tokenizing")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = prepare_default_corpus(args.output_dir, min_bytes=args.min_bytes, vocab_size=args.vocab_size,
                                    workers=args.workers)
    result.pop("files")
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
