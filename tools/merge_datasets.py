"""Concatenate Megatron mmap datasets (same token dtype) into one: tokens and document boundaries.

    python tools/merge_datasets.py --input data/part0_text_document data/part1_text_document \\
        --output-prefix data/all_text_document

The work is ``megatron.data.indexed_dataset.merge_datasets``; the output is written atomically.
"""

import argparse
import sys

from megatron.data.indexed_dataset import merge_datasets


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="dataset prefixes (without .bin/.idx), merged in the order given")
    parser.add_argument("--output-prefix", required=True, help="writes {output_prefix}.bin/.idx")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        merge_datasets(args.input, args.output_prefix)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(args.input)} datasets into {args.output_prefix}.bin/.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
