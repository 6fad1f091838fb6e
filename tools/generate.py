#!/usr/bin/env python
"""Generate text from a training checkpoint of any TP / PP, in one process, with a KV cache.

    python tools/generate.py --load CKPT --prompt "The river" --prompt "A model" --max-new-tokens 32 --greedy \\
        --output-json out.json
    python tools/generate.py --load CKPT --prompt "The river" --top-k 50 --top-p 0.9 --temperature 0.8 --seed 1

The tokenizer is the one the checkpoint records unless the tokenizer flags (as in training) say
otherwise. Without --greedy tokens are sampled (temperature 1, no top-k / top-p cut unless given).
Generation stops at --max-new-tokens or at the end-of-document token.

--output-json writes ONE JSON array with an object per prompt, in order:
{"prompt", "token_ids" (the generated ids only, ending with the end-of-document id if it stopped
there), "text" (their text, without that token), "finish_reason" ('eod' or 'length'),
"prompt_token_ids"}. Without it the array is printed. The work is in ``megatron.inference.generation``.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "PretrainedFromHF")


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


def load_generator(args: argparse.Namespace):
    from megatron.inference.generation import Generator

    return Generator.from_checkpoint(args.load, tag=args.tag, dtype=args.dtype, tokenizer_type=args.tokenizer_type,
                                     vocab_file=args.vocab_file, merge_file=args.merge_file,
                                     tokenizer_model=args.tokenizer_model,
                                     tokenizer_name_or_path=args.tokenizer_name_or_path)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (ignores the sampling flags)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0: no nucleus cut")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same text)")
    parser.add_argument("--output-json", default=None, help="write the JSON array of results here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from megatron.inference.generation import SamplingParams

    args = parse_args(argv)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed).validate()
    completions = load_generator(args).generate(args.prompt, params)
    results = [c.to_json() for c in completions]
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    else:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    from megatron.cli import run_tool

    run_tool(main)
