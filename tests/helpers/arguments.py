"""Command lines for the argument tests: a tiny config over the ``files`` fixture, and BLOOM-176B's
flags verbatim (bigscience/train/tr11-176B-ml/tr11-176B-ml.slurm) with stand-in files."""

from __future__ import annotations

import json
import pathlib

from megatron.arguments import run_config_from_argv
from megatron.config import RunConfig
from megatron.testing.tiny_corpus import write_stand_in_dataset


def tiny_flags(d) -> dict:
    return {"--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 32,
            "--micro-batch-size": 2, "--global-batch-size": 8, "--train-iters": 10, "--lr": 1e-3,
            "--tokenizer-type": "GPT2BPETokenizer", "--vocab-file": d / "vocab.json",
            "--merge-file": d / "merges.txt", "--data-path": d / "a", "--distributed-backend": "gloo"}


def argv_of(flags: dict) -> list[str]:
    """``{"--flag": value}`` -> argv: None drops the flag, True is a bare flag, a list gives several values."""
    out = []
    for flag, value in flags.items():
        if value is None:
            continue
        out.append(flag)
        if value is not True:
            out += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return out


def tiny_config_argv(d, drop=(), **overrides) -> list[str]:
    """The tiny config's argv; overrides use python names: lr_warmup_iters=3 -> --lr-warmup-iters 3."""
    flags = tiny_flags(d)
    for name in drop:
        flags.pop(name)
    for name, value in overrides.items():
        flags["--" + name.replace("_", "-")] = value
    return argv_of(flags)


def parse(d, world_size=2, drop=(), **overrides) -> RunConfig:
    """``run_config_from_argv`` of the tiny config (its tokenizer files are empty: no vocabulary)."""
    return run_config_from_argv(tiny_config_argv(d, drop, **overrides), world_size=world_size, with_vocab=False)


def ds_json(d, **entries) -> pathlib.Path:
    path = d / "ds.json"
    path.write_text(json.dumps(entries))
    return path


def bloom_setup(d: pathlib.Path, zero_stage: int = 0) -> tuple[list[str], pathlib.Path]:
    """BLOOM-176B's flags, for 48 nodes x 8 GPUs, and its DeepSpeed JSON, both with ZeRO stage ``zero_stage``
    (BLOOM's: 0, which runs here as DeepSpeed 0.19's stage 1, the same BF16_Optimizer)."""
    prefixes = [d / f"data/{name}_text_document" for name in ("roots_en", "roots_fr", "roots_code")]
    for prefix in prefixes:
        write_stand_in_dataset(prefix)
    (d / "train-splits.txt").write_text(
        f'"train: 0.5 0:0.95 {prefixes[0]}, 0.3 0:0.95 {prefixes[1]}, 0.2 0:0.95 {prefixes[2]}"\n')
    (d / "valid-splits.txt").write_text(
        f'"valid_en: 1 0.95:1.0 {prefixes[0]}" "valid_fr: 1 0.95:1.0 {prefixes[1]}"\n')
    (d / "tokenizer").mkdir()
    ds_config = d / "ds_config.json"
    ds_config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2048, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zero_stage}, "bf16": {"enabled": True}, "steps_per_print": 2000,
        "wall_clock_breakdown": False}))
    argv = f"""
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 12
    --pp-partition-method type:transformer|embedding
    --num-layers 70 --hidden-size 14336 --num-attention-heads 112 --seq-length 2048 --max-position-embeddings 2048
    --micro-batch-size 2 --rampup-batch-size 192 16 9_765_625 --global-batch-size 2048 --train-samples 220_000_000
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path {d}/tokenizer
    --init-method-std 0.0048 --embed-layernorm --sync-tp-duplicated-parameters --bf16 --seed 42
    --position-embedding-type alibi --checkpoint-activations --abort-on-unmet-fused-kernel-constraints
    --kill-switch-path {d}/kill-switch-tr11-176B-exp1 --pad-vocab-size-to 250880
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --lr 6e-5 --min-lr 6e-6
    --lr-decay-style cosine --lr-decay-samples 200_000_000 --lr-warmup-samples 183_105 --clip-grad 1.0
    --weight-decay 1e-1 --exit-duration-in-mins 5990
    --log-interval 1 --save-interval 100 --eval-interval 1000 --eval-iters 1 --tensorboard-dir {d}/tensorboard
    --tensorboard-queue-size 5 --log-timers-to-tensorboard --log-batch-size-to-tensorboard
    --log-validation-ppl-to-tensorboard
    --save {d}/checkpoints --load {d}/checkpoints
    --train-weighted-split-paths-path {d}/train-splits.txt --valid-weighted-split-paths-path {d}/valid-splits.txt
    --num-workers 2 --valid-num-workers 0 --data-impl mmap --distributed-backend nccl
    --deepspeed --deepspeed_config {ds_config} --zero-stage {zero_stage} --deepspeed-activation-checkpointing
    """.split()
    return argv, ds_config


def parse_bloom(argv, world_size=384) -> RunConfig:
    """BLOOM's flags without its tokenizer (a stand-in folder): no vocabulary."""
    return run_config_from_argv(argv, world_size=world_size, with_vocab=False)
