#!/usr/bin/env python
"""Convert a local transformers directory (Bloom, GPT-2, GPT-NeoX, Llama, Mistral, Qwen2, Mixtral, Qwen3-MoE,
DeepSeek-V3) into a training checkpoint.

    python tools/convert_checkpoint/from_hf.py --hf-dir DIR --save CKPT \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 [--expert-model-parallel-size 2]
    pretrain_gpt.py ... --load CKPT --finetune      # the same architecture flags, TP and vocabulary padding

The vocabulary is padded by Megatron's rule (--make-vocab-size-divisible-by x TP, or
--pad-vocab-size-to) with zero rows: every real token keeps its logit. The checkpoint holds the
weights only (iteration 0, no optimizer state): continue with --finetune (or --no-load-optim, which
also takes the recorded iteration 0 and an RNG state seeded with --seed). A tokenizer.json in
--hf-dir is recorded as the checkpoint's tokenizer (PretrainedFromHF). An MoE model's experts are
split over --expert-model-parallel-size ranks as a training run at that size saves them (train at that
size; the expert files follow the default --pp-partition-method). DeepSeek-V3 becomes a model with
--multi-latent-attention and sigmoid, group-limited routing with an expert bias (its multi-token-prediction
layers are dropped with a warning, as transformers' model ignores them). The work is in
``megatron.checkpoint.hf`` (``io``; the families in ``hf.families``) and ``megatron.checkpoint.single_process``.
"""

import argparse
import json
import os


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="a LOCAL directory saved by save_pretrained (never a hub name)")
    parser.add_argument("--save", required=True, help="the checkpoint directory to create")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-model-parallel-size", type=int, default=1,
                        help="MoE (Mixtral, Qwen3-MoE, DeepSeek-V3): split each layer's experts over this many expert-parallel "
                             "ranks, as a training run at that size saves them (one expert file per rank)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--pad-vocab-size-to", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=None,
                        help="training length to record (default: 2048 for Bloom, n_positions for GPT-2, "
                             "max_position_embeddings for the others)")
    parser.add_argument("--params-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="dtype of the saved weights; match the run's (--bf16: bf16)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the recorded RNG state")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from megatron.checkpoint.hf.io import read_hf_model
    from megatron.checkpoint.run_state import converted_client_state, converted_run_state
    from megatron.checkpoint.single_process import save_as_training_checkpoint
    from megatron.data.tokenizers import pad_vocab_size

    args = parse_args(argv)
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    if not os.path.isdir(args.hf_dir):
        raise ValueError(f"--hf-dir {args.hf_dir!r} is not a directory; pass a local save_pretrained directory")

    def padded(vocab: int) -> int:
        return pad_vocab_size(vocab, args.make_vocab_size_divisible_by, tp, args.pad_vocab_size_to)

    config, state, arch = read_hf_model(args.hf_dir, padded_vocab_size_fn=padded, seq_length=args.seq_length,
                                        params_dtype=args.params_dtype, seed=args.seed)
    tokenizer = {}
    if os.path.isfile(os.path.join(args.hf_dir, "tokenizer.json")):
        tokenizer = {"tokenizer_type": "PretrainedFromHF", "tokenizer_name_or_path": os.path.abspath(args.hf_dir)}
    record = converted_run_state(config, tp, pp, tokenizer=tokenizer, ep=ep,
                                 extra={"converted_from": {"hf_dir": os.path.abspath(args.hf_dir), "architecture": arch}})
    tag_dir = save_as_training_checkpoint(config, state, args.save, tp, pp, converted_client_state(args.seed), record,
                                          ep=ep)
    print(json.dumps({"checkpoint": tag_dir, "architecture": arch, "padded_vocab_size": config.padded_vocab_size,
                      "original_vocab_size": config.original_vocab_size, "tensor_model_parallel_size": tp,
                      "pipeline_model_parallel_size": pp, "expert_model_parallel_size": ep}))
    return 0


if __name__ == "__main__":
    from megatron.cli import run_tool

    run_tool(main)
