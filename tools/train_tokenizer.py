"""Train a tokenizer on the text of jsonl files; the output loads with ``build_tokenizer``.

    python tools/train_tokenizer.py --input corpus.jsonl --type bpe --vocab-size 8192 --output-dir tok/

``--type bpe`` writes ``vocab.json`` + ``merges.txt`` (``--tokenizer-type GPT2BPETokenizer``) and
``tokenizer.json`` (``--tokenizer-type PretrainedFromHF``), end-of-document token ``<|endoftext|>``.
``--type sentencepiece`` writes ``tokenizer.model`` (``--tokenizer-type SentencePieceTokenizer``),
end-of-document token ``</s>``. Both are deterministic for the same input.
"""

import argparse
import itertools
import sys

from megatron.data.preprocess import BadInputLine, iter_texts
from megatron.data.tokenizers import train_bpe_tokenizer, train_sentencepiece_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help=".jsonl or .jsonl.gz files, read in order")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text is used")
    parser.add_argument("--type", choices=("bpe", "sentencepiece"), default="bpe")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--sentencepiece-model-type", choices=("unigram", "bpe", "char", "word"), default="unigram")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    texts = itertools.chain.from_iterable(iter_texts(path, args.json_keys) for path in args.input)
    try:
        if args.type == "bpe":
            files = train_bpe_tokenizer(texts, args.vocab_size, args.output_dir)
        else:
            files = train_sentencepiece_tokenizer(texts, args.vocab_size, args.output_dir,
                                                  model_type=args.sentencepiece_model_type)
    except (BadInputLine, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, path in files.items():
        print(f"{name}: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
