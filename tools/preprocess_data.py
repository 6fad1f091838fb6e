"""Tokenize a jsonl corpus into Megatron mmap datasets: ``{output_prefix}_{key}_document.bin/.idx``.

Flags are Megatron-DeepSpeed's. Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/meg-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

Each worker is one process using one thread of the tokenizer (TOKENIZERS_PARALLELISM=false unless
set), so ``--workers`` says how many cores the run uses. The work is in ``megatron.data.preprocess``.
"""

import argparse
import os
import sys

from megatron.config import TokenizerConfig
from megatron.data.preprocess import DATASET_IMPLS, BadInputLine, PreprocessConfig, preprocess, summary
from megatron.data.tokenizers import TOKENIZER_TYPES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="a .jsonl file (or .jsonl.gz), one json object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract, one dataset each")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip (and count) malformed lines instead of stopping at the first one")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--tokenizer-model", help="SentencePieceTokenizer: the .model file")
    group.add_argument("--tokenizer-name-or-path", help="PretrainedFromHF: a LOCAL tokenizer.json or directory")
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    group.add_argument("--dataset-impl", default="mmap", help=f"one of {DATASET_IMPLS}")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    group.add_argument("--chunk-size", type=int, default=256, help="input lines per task sent to a worker")
    group.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = TokenizerConfig(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                           args.tokenizer_name_or_path)
    config = PreprocessConfig(input=args.input, output_prefix=args.output_prefix, tokenizer=spec,
                              json_keys=tuple(args.json_keys), append_eod=args.append_eod,
                              workers=args.workers, chunk_size=args.chunk_size, log_interval=args.log_interval,
                              skip_bad_lines=args.skip_bad_lines, dataset_impl=args.dataset_impl)
    try:
        stats = preprocess(config)
    except (BadInputLine, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary(stats), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
