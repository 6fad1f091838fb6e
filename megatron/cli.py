"""Shared by the command-line tools: how a tool's ``main`` ends; the model flags of generate and serve."""

import argparse
import sys
from typing import Callable, Optional

from megatron.config.data import TOKENIZER_TYPES


def run_tool(main: Callable[[], Optional[int]]) -> None:
    """Run ``main()`` and exit with its status; bad input (a ValueError naming the problem and the
    fix) becomes a one-line ``error: ...`` on stderr and exit status 2, without a traceback."""
    try:
        sys.exit(main())
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--load, --tag, --dtype and the tokenizer flags (shared with tools/serve.py)."""
    parser.add_argument("--load", required=True, help="the training checkpoint directory (holding 'latest')")
    parser.add_argument("--tag", default=None, help="a tag inside --load (default: the one 'latest' names)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16", "saved"), default="fp32",
                        help="dtype of the model in memory (default fp32; saved: the checkpoint's)")
    group = parser.add_argument_group("tokenizer (default: the checkpoint's)")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-model", default=None)
    group.add_argument("--tokenizer-name-or-path", default=None)


def load_generator(args: argparse.Namespace, parallel_state=None):
    """The checkpoint's Generator (with ``parallel_state``: this rank's part of a tensor-parallel model)."""
    from megatron.inference.generation import Generator  # noqa: PLC0415 (torch and the model: only when a tool loads one)

    return Generator.from_checkpoint(args.load, tag=args.tag, dtype=args.dtype, parallel_state=parallel_state,
                                     tokenizer_type=args.tokenizer_type,
                                     vocab_file=args.vocab_file, merge_file=args.merge_file,
                                     tokenizer_model=args.tokenizer_model,
                                     tokenizer_name_or_path=args.tokenizer_name_or_path)
