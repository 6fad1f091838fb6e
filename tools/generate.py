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

from megatron.cli import add_model_args, load_generator


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
