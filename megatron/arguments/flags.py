"""The command line: Megatron-DeepSpeed's flag names and meanings, grouped as ``--help`` shows them.

Every flag has help text; ``tools/gen_flags_doc.py`` turns this parser into ``docs/flags.md``.
Flags that are accepted for compatibility but change nothing here say so in their help, and
``parse_args`` logs a warning once when they are set.
"""

from __future__ import annotations

import argparse

from megatron.arguments.async_save_flags import add_async_save_arguments
from megatron.arguments.fp8_flags import add_fp8_arguments
from megatron.arguments.interleaved_flags import add_interleaved_arguments
from megatron.arguments.mla_flags import add_mla_arguments
from megatron.arguments.moe_flags import add_moe_arguments
from megatron.arguments.mtp_flags import add_mtp_arguments
from megatron.arguments.muon_flags import add_muon_arguments
from megatron.arguments.resilience_flags import add_resilience_arguments
from megatron.arguments.upstream_flags import add_upstream_arguments
from megatron.arguments.yarn_flags import add_yarn_arguments
from megatron.arguments.zero_bubble_flags import add_zero_bubble_arguments
from megatron.config import (
    ATTENTION_BACKENDS,
    CP_COMM_TYPES,
    DATA_IMPLS,
    DEFAULT_TOKENIZER_TYPE,
    DISTRIBUTED_BACKENDS,
    LR_DECAY_STYLES,
    NORMALIZATIONS,
    OPTIMIZERS,
    PARTITION_METHODS,
    POSITION_EMBEDDING_TYPES,
    TOKENIZER_TYPES,
)

# (flag, dest) of the options that only --dry-run reads (a real run refuses them).
# Megatron-LM's spellings of --position-embedding-type -> ours.
POSITION_EMBEDDING_ALIASES = {"rope": "rotary", "learned_absolute": "absolute"}
# 'yarn' (Megatron-LM's): rotary positions with YaRN scaling (megatron.arguments.yarn_flags)
POSITION_EMBEDDING_FLAG_VALUES = POSITION_EMBEDDING_TYPES + tuple(POSITION_EMBEDDING_ALIASES) + ("yarn",)
# Megatron-LM's --attention-backend names for kernels of the same math -> ours: fused (Transformer Engine's cuDNN
# fused attention) runs as torch's SDPA, local (Megatron's own unfused core) as unfused.
ATTENTION_BACKEND_ALIASES = {"fused": "sdpa", "local": "unfused"}
ATTENTION_BACKEND_FLAG_VALUES = ATTENTION_BACKENDS + tuple(ATTENTION_BACKEND_ALIASES)
DRY_RUN_OPTIONS = (("--world-size", "dry_run_world_size"), ("--dry-run-json", "dry_run_json"),
                   ("--dry-run-gpu", "dry_run_gpu"), ("--dry-run-cluster", "dry_run_cluster"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py", allow_abbrev=False,
        description="Pretrain a GPT/BLOOM model. Flag names and meanings follow Megatron-DeepSpeed.")
    for add in (_model, _parallelism, add_interleaved_arguments, add_zero_bubble_arguments, add_moe_arguments,
                add_mla_arguments, add_yarn_arguments, add_mtp_arguments, add_fp8_arguments, _data, _tokenizer,
                _training, _learning_rate, _regularization, _mixed_precision, _speed, _checkpointing,
                add_async_save_arguments, _logging, _exit, add_resilience_arguments, _deepspeed, _dry_run,
                add_muon_arguments, add_upstream_arguments):
        add(parser)
    return parser


def _model(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers (required).")
    g.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size (required).")
    g.add_argument("--num-attention-heads", type=int, default=None,
                   help="Number of attention heads (required); must divide --hidden-size and be divisible by "
                        "--tensor-model-parallel-size.")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="Hidden size of the MLP. Default: 4 x --hidden-size; with --swiglu, 2/3 of that rounded down "
                        "to a multiple of 64 (Megatron's rule).")
    g.add_argument("--seq-length", type=int, default=None, help="Tokens per training sample (required).")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Rows of the learned position embedding (absolute positions only); must be >= "
                        "--seq-length. Default: --seq-length. Has no effect with rotary or alibi (a warning says so).")
    g.add_argument("--position-embedding-type", default=None, choices=POSITION_EMBEDDING_FLAG_VALUES,
                   help="Position encoding: learned absolute positions ('absolute', Megatron-LM's "
                        "'learned_absolute'), rotary ('rotary', Megatron-LM's 'rope'), rotary with YaRN scaling "
                        "('yarn', Megatron-LM's; its numbers: --rotary-scaling-factor and the --yarn-* flags), "
                        "ALiBi biases (BLOOM), or none. Default: absolute, or what --use-rotary-position-embeddings / "
                        "--no-position-embedding say.")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Rotary positions (Megatron-DeepSpeed's and Megatron-LM's older spelling of "
                        "--position-embedding-type rotary).")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                   help="No learned position embedding: alone, no position information at all "
                        "(--position-embedding-type none); beside rotary or alibi it changes nothing.")
    g.add_argument("--rotary-base", "--rotary-position-embeddings-theta", dest="rotary_base", type=float,
                   default=10000.0,
                   help="Base of the rotary frequencies (Llama 2: 10000, Llama 3: 500000). "
                        "--rotary-position-embeddings-theta is Megatron-DeepSpeed's name.")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.1's rope scaling (Megatron-LM's flag): rotary frequencies with wavelengths beyond "
                        "8192 positions divided by --rope-scaling-factor, those below 2048 kept, interpolated between.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="With --use-rope-scaling: the factor (Llama 3.1: 8).")
    g.add_argument("--embed-layernorm", action="store_true",
                   help="Apply a LayerNorm right after the word embedding (BLOOM).")
    g.add_argument("--normalization", type=str.lower, default="layernorm", choices=NORMALIZATIONS,
                   help="The norm of every block and the final one: layernorm or rmsnorm (Llama); Megatron-LM's "
                        "spellings LayerNorm / RMSNorm are accepted.")
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5,
                   help="Epsilon of every norm (--norm-epsilon is Megatron-LM's name).")
    g.add_argument("--swiglu", action="store_true",
                   help="Gated MLP silu(x W_gate) * (x W_up) W_down (Llama) instead of GeLU.")
    g.add_argument("--num-key-value-heads", type=int, default=None,
                   help="Key / value heads for grouped-query attention (1: multi-query); must divide "
                        "--num-attention-heads and be divisible by --tensor-model-parallel-size. Default: one per "
                        "query head.")
    g.add_argument("--group-query-attention", action="store_true",
                   help="Megatron-LM: use grouped-query attention with --num-query-groups groups.")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="Megatron-LM's name for --num-key-value-heads (needs --group-query-attention).")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Megatron-LM's attention head size: the width of each query, key and value head, "
                        "independent of --hidden-size (Qwen3: 128 with hidden 4096 and 64 heads); the query and "
                        "output projections are --num-attention-heads x this wide. Must be even with rotary "
                        "positions. Default: --hidden-size / --num-attention-heads.")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="Megatron-LM's share of each head's dimensions that rotary positions rotate; 1.0 (every "
                        "dimension, Llama's) is what this engine does, another value is refused.")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                   help="Megatron-LM's linear position interpolation (positions divided by this before the rotary "
                        "angles); 1 (positions unchanged) is accepted, another value is refused (not implemented: "
                        "use YaRN, --rotary-scaling-factor, or Llama 3.1's scaling for longer contexts).")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Give the output head its own weight instead of reusing the word embedding (Llama).")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="No biases in the linear layers (attention and MLP), as Llama.")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="Keep a bias in the query / key / value projection even with --disable-bias-linear "
                        "(Qwen2; Megatron-LM's flag).")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="Normalize every query and key head over its head dimension before the rotary positions "
                        "(--normalization's kind, one weight per head dimension shared by the heads; Qwen3, "
                        "Megatron-LM's flag).")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="Megatron-LM's zero-centred norm weights: every norm (LayerNorm or RMSNorm, the q / k norms "
                        "too) stores w, starting at 0, and scales by 1 + w; the same function as the usual weight "
                        "1 + w, stored with more precision near 1. Exported to Hugging Face as 1 + w.")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="Standard deviation of the normal weight initialization; output projections use "
                        "std / sqrt(2 x num-layers).")


def _parallelism(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Degree of tensor model parallelism.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="Number of pipeline stages. Data-parallel size = world size / (TP x PP); the world "
                        "size must be a multiple of TP x PP.")
    g.add_argument("--ds-sequence-parallel-size", type=int, default=1,
                   help="DeepSpeed-Ulysses sequence parallelism (Megatron-DeepSpeed's flag): each sample's sequence "
                        "is split over this many ranks, which exchange query, key and value heads for tokens by "
                        "all-to-all around the core attention (deepspeed.sequence.layer.DistributedAttention). "
                        "Data-parallel size = world size / (TP x PP x SP); --seq-length, the attention heads and "
                        "the key / value heads must be divisible by it (heads by TP x SP). Pipeline size 1 only; "
                        "runs on DeepSpeed's model engine at any --zero-stage. Default 1: off.")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Context parallelism (Megatron-LM's flag): each sample's sequence is split over this many "
                        "ranks, each holding chunks i and 2c-1-i of 2c (even causal work), and attention passes the "
                        "key / value blocks around the ring (ring attention, online softmax). Data-parallel size = "
                        "world size / (TP x PP x CP); gradients are reduced over DP x CP. --seq-length must be a "
                        "multiple of 2 x CP. Runs at every --zero-stage (0 and 1 on the pipeline engine, 2 and 3 on the "
                        "model engine); what it does not work with yet (Ulysses, ZeRO++ hpZ, attention "
                        "dropout, interleaved or ZB-H1 schedules, ...) is refused by name before launch "
                        "(megatron/config/combinations.py). Default 1: off.")
    g.add_argument("--cp-comm-type", default="p2p", choices=CP_COMM_TYPES,
                   help="How context parallelism exchanges key / value blocks (Megatron-LM's flag): p2p, a ring of "
                        "point-to-point sends overlapped with the block computation. Default p2p.")
    g.add_argument("--pp-partition-method", default="type:transformer", metavar="{" + ",".join(PARTITION_METHODS) + "}",
                   help="How DeepSpeed splits the layers over pipeline stages: 'type:transformer' balances "
                        "transformer layers; 'type:transformer|embedding' also counts the tied embedding on the "
                        "first and last stage as a layer (BLOOM); 'parameters' balances parameter counts; "
                        "'uniform' balances layer counts.")
    g.add_argument("--distributed-backend", default=None, choices=DISTRIBUTED_BACKENDS,
                   help="torch.distributed backend. Default: nccl if CUDA is available, else gloo.")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="Minutes a collective may wait for the other ranks before the job fails (every process "
                        "group, gloo and NCCL; Megatron-LM's flag, minutes may be fractional). Default 10.")
    g.add_argument("--zero-hpz-partition-size", type=int, default=1,
                   help="With --zero-stage 3: keep a secondary copy of the parameters sharded within groups of "
                        "this many data-parallel ranks (DeepSpeed ZeRO++'s hpZ, zero_optimization."
                        "zero_hpz_partition_size), so that the all-gathers of the backward pass stay inside a group "
                        "(a node); the optimizer state and gradients stay sharded over all data-parallel ranks. "
                        "Must divide the data-parallel size (with --ds-sequence-parallel-size, data-parallel x "
                        "sequence-parallel: ZeRO shards over both). Default 1: no secondary copy.")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism (Korthikanti et al. 2022): inside each tensor-parallel "
                        "group, layer norms, dropout and residual adds run on a 1/TP shard of the sequence, the "
                        "column-parallel layers all-gather their input along the sequence and the row-parallel "
                        "layers reduce-scatter their output instead of all-reducing it. Saves activation memory "
                        "(docs/parallelism.md); needs --seq-length divisible by TP; no effect with TP 1.")
    g.add_argument("--sync-tp-duplicated-parameters", action="store_true",
                   help="Average the parameters replicated over tensor-parallel ranks (layer norms, row-parallel "
                        "biases) every step so they cannot drift apart (BLOOM).")
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="Local rank, passed by the DeepSpeed launcher. The LOCAL_RANK environment variable wins "
                        "when both are set.")


def _data(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Data mode 1: one dataset prefix (path without .bin/.idx), or WEIGHT PREFIX pairs to "
                        "blend, e.g. '0.3 A 0.7 B'. Exclusive with the weighted split paths.")
    g.add_argument("--split", default=None,
                   help="Data mode 1: train, validation, test proportions of --data-path, e.g. '969, 30, 1' "
                        "(the default).")
    for split, extra in (("train", "exactly ONE group"), ("valid", "one or more groups, each evaluated on its own"),
                         ("test", "one or more groups")):
        g.add_argument(f"--{split}-weighted-split-paths", nargs="*", default=None,
                       help=f"Data mode 2, {split} data: {extra}, each a quoted string "
                            f"'NAME: WEIGHT START:END PREFIX, WEIGHT START:END PREFIX' blending documents "
                            f"[START, END) (fractions) of each prefix.")
        g.add_argument(f"--{split}-weighted-split-paths-path", default=None,
                       help=f"A file holding the --{split}-weighted-split-paths groups on one line, each "
                            f"between double quotes (as BigScience's load_ratios_meg_ds_format.py writes it).")
    g.add_argument("--data-impl", "--dataset-impl", dest="data_impl", default="mmap",
                   choices=("lazy", "cached") + DATA_IMPLS,
                   help="Indexed dataset format. Only Megatron's 'mmap' format is read ('infer' finds it); "
                        "'lazy' and 'cached' are refused with an error. --dataset-impl: Megatron-DeepSpeed's "
                        "older name.")
    g.add_argument("--data-cache-path", default=None,
                   help="Path to a directory to hold cached index files (the sample indexes built at startup). "
                        "Default: beside the data. It must be creatable and writable, and shared by all nodes.")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="Megatron-LM: the loss of a step is the sum over its counted tokens divided by the tokens "
                        "counted in the whole global batch, not the mean of the micro-batches' means. The two differ "
                        "only where --eod-mask-loss masks tokens (each micro-batch then counts its own); there the "
                        "step's count is summed over its micro-batches and data-parallel ranks before the step "
                        "(pipeline engine: ZeRO 0 / 1, no CP or Ulysses).")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="No loss at positions whose input token is the tokenizer's end-of-document token (the "
                        "prediction of the next document's first token from the previous document).")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="Position ids restart at 0 after each end-of-document token. Only learned absolute "
                        "positions read position ids (as in Megatron-LM); with ALiBi or rotary it is refused.")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="Megatron's per-document attention mask: documents packed into one sample (split after "
                        "each end-of-document token) do not attend to each other, in every attention backend "
                        "(flash excepted) and under TP, SP, PP, CP and Ulysses. SDPA runs each document alone (a dense "
                        "[b, 1, s, s] mask with attention dropout or under --torch-compile), unfused a dense mask "
                        "([b, heads, s, s] with ALiBi), flex a block mask, the ring its blocks' "
                        "(docs/performance.md). Rotary and ALiBi are relative, so a document then computes as alone "
                        "at position 0; learned positions need --reset-position-ids for that.")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes for training.")
    g.add_argument("--valid-num-workers", type=int, default=2,
                   help="DataLoader worker processes for validation and test.")


def _tokenizer(parser):
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=DEFAULT_TOKENIZER_TYPE, choices=TOKENIZER_TYPES,
                   help="Tokenizer, by Megatron-DeepSpeed's and Megatron-LM's names: GPT2BPETokenizer (the default, "
                        "as upstream: --vocab-file, --merge-file), SentencePieceTokenizer / GPTSentencePieceTokenizer "
                        "(--tokenizer-model), Llama2Tokenizer (--tokenizer-model; BOS first in every text), "
                        "HuggingFaceTokenizer (--tokenizer-model: a local folder or tokenizer.json; adds the "
                        "tokenizer's own special tokens), PretrainedFromHF (--tokenizer-name-or-path).")
    g.add_argument("--tokenizer-name-or-path", default=None,
                   help="PretrainedFromHF: a local tokenizer.json, a directory holding a saved tokenizer, or a "
                        "hub name (ORG/NAME) found in the local Hugging Face cache ($HF_HUB_CACHE, else "
                        "$HF_HOME/hub, else ~/.cache/huggingface/hub). Nothing is downloaded.")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: the vocab.json file.")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: the merges.txt file.")
    g.add_argument("--tokenizer-model", default=None,
                   help="The SentencePiece types: the .model file. HuggingFaceTokenizer: a local tokenizer folder "
                        "or tokenizer.json, or a hub name found in the local Hugging Face cache.")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the embedding rows to a multiple of this value times the tensor-parallel size.")
    g.add_argument("--pad-vocab-size-to", type=int, default=None,
                   help="Pad the embedding rows to exactly this many (BLOOM: 250880) instead; must be at least "
                        "the tokenizer's vocabulary and divisible by the tensor-parallel size. Replaces "
                        "--make-vocab-size-divisible-by.")


def _training(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="Samples per rank per forward/backward pass (required).")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per optimizer step; a multiple of micro-batch size x data-parallel size. "
                        "Default: micro-batch size x data-parallel size (one micro-batch per step).")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "RAMPUP_SAMPLES"),
                   help="Grow the global batch from START by INCREMENT, spreading the increments evenly over "
                        "RAMPUP_SAMPLES samples, up to --global-batch-size (needs --train-samples). BLOOM: "
                        "192 16 9_765_625.")
    g.add_argument("--train-samples", type=int, default=None,
                   help="Samples to train on over all runs (sample-based training). Give this or --train-iters.")
    g.add_argument("--train-iters", type=int, default=None,
                   help="Iterations to train over all runs (iteration-based training). Give this or "
                        "--train-samples.")
    g.add_argument("--train-tokens", type=int, default=None,
                   help="Megatron-DeepSpeed: stop once this many tokens (consumed samples x --seq-length) are "
                        "trained on, or at --train-iters / --train-samples if that comes first.")
    g.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                   help="Optimizer: adam (with decoupled weight decay, as Megatron's), sgd, or muon (the --muon-* flags).")
    g.add_argument("--seed", type=int, default=1234, help="Random seed for initialization, dropout and data order.")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="Recompute activations in the backward pass instead of storing them.")
    g.add_argument("--checkpoint-num-layers", type=int, default=1,
                   help="Transformer layers per activation-checkpointed chunk.")
    g.add_argument("--eval-interval", type=int, default=1000, help="Iterations between evaluations.")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="Iterations per evaluation (per validation group); 0 disables evaluation.")
    g.add_argument("--eval-harness-tasks", type=_comma_list, default=(), metavar="TASK[,TASK...]",
                   help="lm-evaluation-harness tasks (loglikelihood ones) scored on the live model every "
                        "--eval-harness-interval iterations, logged as lm-eval/TASK/METRIC beside the loss "
                        "(docs/evaluation.md). New in this project.")
    g.add_argument("--eval-harness-interval", type=int, default=None,
                   help="Iterations between --eval-harness-tasks evaluations. New in this project.")
    g.add_argument("--eval-harness-include-path", default=None,
                   help="A folder of the harness's task YAMLs for --eval-harness-tasks (searched before its "
                        "built-in tasks). New in this project.")
    g.add_argument("--eval-harness-limit", type=float, default=None,
                   help="Documents per --eval-harness-tasks task (a fraction when below 1; default all). New in "
                        "this project.")
    g.add_argument("--skip-train-iteration-range", nargs="+", default=None, metavar="START-END",
                   help="Iterations to skip (their data is consumed, no update is made), as inclusive "
                        "START-END ranges, e.g. 101-200 251-300; overlapping ranges are merged.")
    g.add_argument("--max-nonfinite-steps", type=int, default=None,
                   help="Stop the run (without saving) once this many CONSECUTIVE steps had a NaN or infinite "
                        "loss or gradient norm, instead of at the first (--check-for-nan-in-loss-and-grad). "
                        "New in this project.")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                   help="Stop the run, without saving, at the first iteration whose loss or gradient norm is NaN or "
                        "infinite, or whose optimizer step DeepSpeed skipped without fp16 loss scaling (Megatron-LM's "
                        "flag, on by default).")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad",
                   help="Train on through non-finite losses and gradient norms (Megatron-LM's flag).")
    g.add_argument("--loss-spike-factor", type=float, default=10.0,
                   help="Report (log line and TensorBoard 'loss-spikes') an iteration whose loss is more than this "
                        "many times the mean of the last 100 finite losses; 0 disables. New in this project.")


def _comma_list(text: str) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b') (empty names dropped)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _learning_rate(parser):
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None,
                   help="Peak learning rate, reached at the end of warmup (required).")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate at and after the end of the decay.")
    g.add_argument("--lr-decay-style", default="linear", choices=LR_DECAY_STYLES,
                   help="Decay from --lr to --min-lr after warmup; 'constant' keeps --lr.")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="Samples over which to decay (warmup included). Default: --train-samples.")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Iterations over which to decay (warmup included). Default: --train-iters.")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="Samples of linear warmup from 0 (sample-based training).")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="Iterations of linear warmup from 0 (iteration-based training).")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Megatron-LM: let --exp-avg-dtype / --exp-avg-sq-dtype store Adam's moments in a lower "
                        "precision (computed in fp32 each step, stored rounded). Its --main-grads-dtype and "
                        "--main-params-dtype are fp32 here (DeepSpeed's fp32 gradient accumulation and masters).")
    g.add_argument("--exp-avg-dtype", default="fp32", choices=("fp32", "bf16", "fp16", "fp8"),
                   help="Megatron-LM: the dtype Adam's first moment is stored in (needs "
                        "--use-precision-aware-optimizer); fp8 is refused (no FP8 here).")
    g.add_argument("--exp-avg-sq-dtype", default="fp32", choices=("fp32", "bf16", "fp16", "fp8"),
                   help="Megatron-LM: the dtype Adam's second moment is stored in (needs "
                        "--use-precision-aware-optimizer); fp8 is refused (no FP8 here).")
    g.add_argument("--main-grads-dtype", default="fp32", choices=("fp32", "bf16"),
                   help="Megatron-LM: the dtype of the main gradients. fp32 only here (DeepSpeed's BF16_Optimizer "
                        "accumulates in fp32); bf16 is refused.")
    g.add_argument("--main-params-dtype", default="fp32", choices=("fp32", "fp16"),
                   help="Megatron-LM: the dtype of the master weights. fp32 only here (DeepSpeed's optimizer "
                        "wrappers keep fp32 masters); fp16 is refused.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="Megatron-LM: the learning rate the linear warmup starts from (default 0), rising to --lr "
                        "(and to --decoupled-lr for the embedding and output layer).")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="Megatron-LM: the word embedding's and the output layer's own peak learning rate, on the "
                        "same schedule as --lr (warmup, decay style and lengths).")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="Megatron-LM: the floor of --decoupled-lr's decay. Default: --min-lr.")
    g.add_argument("--lr-decay-tokens", type=int, default=None,
                   help="Megatron-DeepSpeed's token-based schedule: tokens over which to decay (warmup included), "
                        "counted as consumed samples x --seq-length; replaces the iteration / sample decay length. "
                        "The warm-up is then --lr-warmup-tokens, or the iteration / sample warm-up in tokens.")
    g.add_argument("--lr-warmup-tokens", type=int, default=None,
                   help="Tokens of linear warmup from 0 (needs --lr-decay-tokens).")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warmup as a fraction of the decay length; exclusive with --lr-warmup-samples/-iters.")
    g.add_argument("--override-lr-scheduler", "--override-opt_param-scheduler", dest="override_lr_scheduler",
                   action="store_true",
                   help="On resume, use these flags' schedule rather than the checkpoint's "
                        "(--override-opt_param-scheduler: Megatron-LM's and Megatron-DeepSpeed's later name).")
    g.add_argument("--use-checkpoint-lr-scheduler", "--use-checkpoint-opt_param-scheduler",
                   dest="use_checkpoint_lr_scheduler", action="store_true",
                   help="On resume, use the checkpoint's schedule rather than these flags'. Without either flag "
                        "a difference is an error.")


def _regularization(parser):
    g = parser.add_argument_group("regularization")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="Clip gradients to this global L2 norm; 0 disables clipping.")
    g.add_argument("--weight-decay", type=float, default=0.01,
                   help="Decoupled weight decay (not applied to biases and norms).")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout on hidden states.")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum (--optimizer sgd).")


def _mixed_precision(parser):
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters with fp32 master weights and fp32 gradient accumulation (DeepSpeed's "
                        "BF16_Optimizer, BLOOM's path).")
    g.add_argument("--fp16", action="store_true", help="fp16 parameters with loss scaling.")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="Megatron-LM: reduce the gradients over the data-parallel ranks in bf16 (needs --bf16). "
                        "DeepSpeed does so for every bf16 run by default (its communication_data_type: the fp32 "
                        "gradient buffer cast to bf16 for the all-reduce); the flag writes it into the DeepSpeed "
                        "config. For fp32 reductions, put \"communication_data_type\": \"fp32\" in the DeepSpeed "
                        "JSON.")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="fp16: static loss scale; unset or 0: dynamic loss scaling. Ignored (with a warning) "
                        "without --fp16.")
    g.add_argument("--initial-loss-scale", type=float, default=None,
                   help="fp16 dynamic scaling: initial scale, a power of 2. Default: the DeepSpeed JSON's "
                        "initial_scale_power, else DeepSpeed's 2**16 (what Megatron-DeepSpeed runs got).")
    g.add_argument("--min-loss-scale", type=float, default=None,
                   help="fp16 dynamic scaling: lowest scale. Default: the DeepSpeed JSON's, else 1.")
    g.add_argument("--loss-scale-window", type=int, default=None,
                   help="fp16 dynamic scaling: steps without overflow before the scale grows. Default: the "
                        "DeepSpeed JSON's, else 1000.")
    g.add_argument("--hysteresis", type=int, default=None,
                   help="fp16 dynamic scaling: overflows tolerated before the scale shrinks. Default: the "
                        "DeepSpeed JSON's, else 2.")


def _checkpointing(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="Directory to save checkpoints to (needs --save-interval).")
    g.add_argument("--load", default=None, help="Directory to resume from (its 'latest' checkpoint), if any.")
    g.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoint saves.")
    g.add_argument("--no-load-optim", action="store_true", help="Do not load the optimizer state when resuming.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not load the RNG states when resuming.")
    g.add_argument("--finetune", action="store_true",
                   help="Load only the weights; iteration count and consumed samples restart at 0.")
    g.add_argument("--universal-checkpoint", action="store_true",
                   help="--load holds a universal checkpoint (DeepSpeed's ds_to_universal), loadable into "
                        "any TP/PP/DP layout.")
    g.add_argument("--no-load-fallback", action="store_true",
                   help="Refuse to start when the --load checkpoint fails its checksums, instead of resuming "
                        "from the newest earlier intact one with a warning. New in this project.")
    g.add_argument("--keep-last-n-checkpoints", type=int, default=None,
                   help="After each save, delete all but the newest N checkpoints. Default: keep all. "
                        "New in this project.")


def _logging(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines.")
    g.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard events here.")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="TensorBoard events held in memory before a flush to disk.")
    g.add_argument("--tensorboard-log-interval", type=int, default=1, help="Iterations between TensorBoard scalars.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true", help="Also write the timers to TensorBoard.")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                   help="Also write the global batch size to TensorBoard.")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="Also write validation perplexity to TensorBoard.")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="Peak TFLOP/s of one device, for the model-FLOPs utilization that is logged. Default: "
                        "the training loop's own estimate for the device. New in this project.")
    g.add_argument("--timing-log-level", type=int, default=0, choices=(0, 1, 2),
                   help="Per-phase timers after the log line (ms per iteration, across ranks): 0 none (no "
                        "overhead); 1 the step's phases (train-batch, optimizer-inner-step; forward-backward and "
                        "optimizer under ZeRO-2/3); 2 also batch-generator (and forward-compute, backward-compute "
                        "under ZeRO-2/3). 1 and 2 synchronize the device around each phase.")
    g.add_argument("--timing-log-option", default="minmax", choices=("max", "minmax", "all"),
                   help="Timers across ranks: the max, (min, max), or every rank's. TensorBoard gets the max.")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="Write memory each log interval: CUDA allocated / reserved bytes (mem-allocated-bytes, "
                        "mem-max-allocated-bytes, ...), on CPU the process RSS (mem-rss-bytes, mem-max-rss-bytes).")
    g.add_argument("--profile", action="store_true",
                   help="Profile iterations --profile-step-start+1 .. --profile-step-end: nsys ranges "
                        "(cudaProfilerStart/Stop; CUDA only), or torch.profiler with --use-pytorch-profiler.")
    g.add_argument("--profile-step-start", type=int, default=10, help="Iterations completed before the window.")
    g.add_argument("--profile-step-end", type=int, default=12, help="The last iteration of the window.")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=(), help="Ranks to profile. Default: all.")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="With --profile: torch.profiler, its trace (*.pt.trace.json) written into "
                        "--tensorboard-dir for TensorBoard's profiler plugin.")
    g.add_argument("--log-throughput", action="store_true",
                   help="Add to the log line, and to TensorBoard and W&B, per GPU: the model TFLOP/s "
                        "(Megatron-LM's throughput, recomputation not counted), tokens per second and, where the "
                        "device's peak is known (a known GPU, or --peak-tflops; not on CPU), MFU.")
    g.add_argument("--wandb-project", default=None,
                   help="Log to this Weights & Biases project the scalars TensorBoard gets, from the same rank "
                        "(the last), and the run's flags as its config. Unset or empty: no W&B. Needs the wandb "
                        "package (requirements.txt). Without network: WANDB_MODE=offline, then `wandb sync`.")
    g.add_argument("--wandb-exp-name", default=None, help="The W&B run's name. Default: one W&B picks.")
    g.add_argument("--wandb-save-dir", default=None,
                   help="Where W&B keeps the run's files (its wandb/ folder). Default: --save's wandb/ "
                        "folder, or the working directory without --save.")
    g.add_argument("--wandb-entity", default=None,
                   help="The W&B user or team that owns the project. Default: the logged-in user's default.")


def _exit(parser):
    g = parser.add_argument_group("exit")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Save and exit after the first iteration divisible by this.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="Save and exit once the run has lasted this many minutes.")
    g.add_argument("--kill-switch-path", default=None, help="Save and exit as soon as this file exists.")


def _deepspeed(parser):
    g = parser.add_argument_group("deepspeed")
    g.add_argument("--deepspeed", action="store_true",
                   help="Accepted for Megatron-DeepSpeed compatibility: DeepSpeed is always the engine here.")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                   help="A DeepSpeed JSON merged into the config built from these flags; a key that contradicts "
                        "a flag is an error, other keys are kept. It must not hold optimizer or scheduler "
                        "sections.")
    g.add_argument("--zero-stage", type=int, default=None,
                   help="DeepSpeed ZeRO stage, 0-3. 0 and 1 run on the pipeline engine (3D parallelism); with "
                        "--bf16, 0 (BLOOM's setting) runs DeepSpeed's BF16_Optimizer as stage 1, as 1 does (a "
                        "startup warning says so). 2 (gradients sharded too) and 3 (parameters too) need "
                        "--pipeline-model-parallel-size 1 and run on DeepSpeed's model engine, with "
                        "tensor parallelism. Default: the DeepSpeed JSON's stage, else 1 with --bf16 or "
                        "--use-distributed-optimizer, and 0 otherwise.")
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="Megatron-DeepSpeed: train without DeepSpeed's pipeline engine (its ZeRO-2/3 and Ulysses "
                        "scripts). Here the engine follows --zero-stage and --ds-sequence-parallel-size (ZeRO-2/3 or "
                        "Ulysses: the model engine), so the flag needs --pipeline-model-parallel-size 1 and changes "
                        "nothing else.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron-LM's distributed optimizer: the optimizer states (and fp32 master weights) sharded "
                        "over the data-parallel ranks, which is ZeRO stage 1 here (or 2 / 3, which shard more): "
                        "without --zero-stage or a JSON stage it selects 1; a stage 0 given with it is an error.")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="With --checkpoint-activations, recompute through DeepSpeed's activation checkpointing "
                        "(adds its activation_checkpointing config section).")


def _speed(parser):
    g = parser.add_argument_group("speed (docs/performance.md)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_FLAG_VALUES,
                   help="The attention core's kernel: sdpa (torch's scaled_dot_product_attention, ALiBi as a "
                        "materialized [np, s, s] bias), flex (torch's flex_attention compiled, ALiBi as a score_mod "
                        "and a causal block mask: no [np, s, s] tensor; needs --attention-dropout 0), flash "
                        "(FlashAttention-2 with alibi_slopes; needs the flash-attn package and a CUDA GPU, bf16 / "
                        "fp16), unfused (Megatron-LM's name: plain matmuls and an fp32 softmax, keeping the [np, s, s] "
                        "probabilities; fused by --torch-compile). auto: on CPU unfused inside --torch-compile's "
                        "layers up to s = 1024, else sdpa (both measured fastest there); on CUDA flash where "
                        "installed, else flex for ALiBi without attention dropout, else sdpa. Incremental decoding "
                        "always uses sdpa. Megatron-LM's flag of this name selects Transformer Engine kernels "
                        "(flash, fused, unfused, local); flash and unfused exist here.")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM's older spelling of --recompute-granularity selective.")
    g.add_argument("--recompute-granularity", default=None, choices=("full", "selective"),
                   help="Megatron-LM's recomputation: full = --checkpoint-activations (every layer's activations "
                        "recomputed in backward, --recompute-num-layers layers per chunk); selective = only the "
                        "attention core softmax(QK^T)V, whose [np, s, s] scores are the largest activations, "
                        "recomputed from the kept q, k, v. Selective with --checkpoint-activations runs as full "
                        "alone, which already recomputes the core (a startup warning says so).")
    g.add_argument("--recompute-modules", nargs="*", default=None, metavar="MODULE",
                   help="With --recompute-granularity selective (Megatron-LM's flag): the parts of every layer "
                        "recomputed in backward, keeping only their inputs; default core_attn. core_attn: the "
                        "attention core; layernorm: both norms' outputs (recomputed from their inputs); mlp: the "
                        "dense MLP (not the MoE layers); moe: the whole MoE layer (router, token exchange, experts, "
                        "shared expert; the all-to-all runs again in backward); moe_act: the experts' activation; "
                        "shared_experts: the shared expert; mla_up_proj: multi-latent attention's up-projections "
                        "and RoPE. The planner and --dry-run count what each one frees.")
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="Megatron-LM's deprecated spelling of --recompute-granularity selective --recompute-modules "
                        "... moe (added to the modules; refused with --recompute-granularity full).")
    g.add_argument("--recompute-method", default=None, choices=("uniform", "block"),
                   help="With --recompute-granularity full: uniform (chunks of --recompute-num-layers layers, "
                        "DeepSpeed's interval; the default). Megatron-LM's block (only the first N layers of a stage) "
                        "is not available on DeepSpeed's pipeline engine and is refused. uniform beside --checkpoint-activations "
                        "alone changes nothing (a startup warning says so).")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="With --recompute-granularity full: layers per recomputed chunk (= --checkpoint-num-layers).")
    g.add_argument("--torch-compile", action="store_true",
                   help="Compile each transformer layer with torch.compile (in place: same modules, parameter names "
                        "and checkpoints), with pipeline stages, tensor parallelism and activation checkpointing. "
                        "A mixture-of-experts layer is compiled by region: its norms, attention and shared expert; "
                        "the router, token dispatch and experts (data-dependent shapes) run eager. "
                        "The first iteration includes the compilation (its time is logged once). On CPU inductor "
                        "needs a C++ compiler (g++); the run refuses to start without one.")


def _dry_run(parser):
    g = parser.add_argument_group("dry run (new in this project; docs/slurm.md)")
    g.add_argument("--dry-run", action="store_true",
                   help="Check the job and print its plan instead of training: every flag, the data and tokenizer "
                        "files, the pipeline stages and their layers, the batch rampup, the run's samples and "
                        "tokens, the learning-rate schedule, and the planner's memory per GPU and step time. No "
                        "process group starts and nothing runs on a GPU. Exit status 0 when the job would start, "
                        "1 listing every problem found otherwise.")
    g.add_argument("--world-size", dest="dry_run_world_size", type=int, default=None, metavar="N",
                   help="With --dry-run: the number of processes to check the job for. Default: what the launch "
                        "environment gives (WORLD_SIZE; under SLURM with one task per node, nodes x GPUS_PER_NODE "
                        "or SLURM_GPUS_ON_NODE; with one task per GPU, SLURM_NTASKS). A real run takes it from "
                        "the launcher.")
    g.add_argument("--dry-run-json", default=None, metavar="FILE",
                   help="With --dry-run: also write the report as JSON to FILE.")
    g.add_argument("--dry-run-gpu", default=None, metavar="GPU",
                   help="With --dry-run: the GPU the memory and step-time estimates assume, one of the planner's "
                        "(GPUS in megatron/planner/specs.py; another name is an error listing them). Default: "
                        "A100-80GB, BLOOM-176B's.")
    g.add_argument("--dry-run-cluster", default=None, metavar="CLUSTER",
                   help="With --dry-run: the fabric the step-time estimate assumes (CLUSTERS in "
                        "megatron/planner/specs.py). Default: the DGX machine of --dry-run-gpu.")
