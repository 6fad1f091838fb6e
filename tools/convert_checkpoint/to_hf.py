#!/usr/bin/env python
"""Export a training checkpoint of any TP / PP to a transformers model directory.

    python tools/convert_checkpoint/to_hf.py --load CKPT --output-dir DIR [--tag global_stepN] [--dtype bf16]

ALiBi + embedding LayerNorm (BLOOM) writes a ``BloomForCausalLM``, learned positions a
``GPT2LMHeadModel``, rotary a ``GPTNeoXForCausalLM``, RMSNorm + SwiGLU + rotary a ``LlamaForCausalLM``
(``Qwen2ForCausalLM`` with q / k / v biases only), the same with MoE layers a ``MixtralForCausalLM``
(``Qwen3MoeForCausalLM`` with --qk-layernorm), with --multi-latent-attention a ``DeepseekV3ForCausalLM``
(config.json + model.safetensors). An MoE checkpoint of any
--expert-model-parallel-size is read whole (its expert files gathered). The vocabulary is cut to
the tokenizer's (original_vocab_size); Bloom's ``pretraining_tp`` records the training TP. When the
checkpoint's tokenizer record names existing files they are exported too, so
``AutoTokenizer.from_pretrained(DIR)`` works offline (GPT2BPETokenizer, PretrainedFromHF). The work is
in ``megatron.checkpoint.hf`` (``io``; the families in ``hf.families``).
"""

import argparse
import json
import sys


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="the training checkpoint directory (holding 'latest')")
    parser.add_argument("--output-dir", required=True, help="where config.json, model.safetensors and the tokenizer go")
    parser.add_argument("--tag", default=None, help="a tag inside --load (default: the one 'latest' names)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="dtype of the exported weights (default: as saved)")
    parser.add_argument("--no-tokenizer", action="store_true", help="do not export the tokenizer files")
    parser.add_argument("--max-shard-size-mb", type=float, default=5120,
                        help="split model.safetensors into shards of at most this size (transformers' index layout)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from megatron.checkpoint.hf.io import export_tokenizer, write_hf_model
    from megatron.checkpoint.single_process import load_full_state_dict
    from megatron.inference.generation import DTYPES, tokenizer_from_record

    args = parse_args(argv)
    config, state, run = load_full_state_dict(args.load, args.tag)
    record = run.get("tokenizer") or {}
    eod = None
    if record:
        try:
            eod = tokenizer_from_record(record).eod
        except ValueError as error:  # the tokenizer files moved: export the weights anyway
            print(f"WARNING: tokenizer not exported ({error})", file=sys.stderr)
            record = {}
    tp = run.get("parallel", {}).get("tensor_model_parallel_size", 1)
    arch = write_hf_model(config, state, args.output_dir, pretraining_tp=tp, eos_token_id=eod,
                          dtype=DTYPES[args.dtype] if args.dtype else None,
                          max_shard_bytes=int(args.max_shard_size_mb * 2**20))
    files = [] if args.no_tokenizer or not record else export_tokenizer(record, args.output_dir, config.seq_length)
    print(json.dumps({"output_dir": args.output_dir, "architecture": arch, "vocab_size":
                      config.original_vocab_size or config.padded_vocab_size, "tokenizer_files": files}))
    return 0


if __name__ == "__main__":
    from megatron.cli import run_tool

    run_tool(main)
