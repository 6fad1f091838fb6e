"""A tiny ``RunConfig`` built straight from the dataclasses (no command line), for the config tests."""

from __future__ import annotations

import dataclasses

from megatron.config import (
    BatchConfig,
    CheckpointConfig,
    DataConfig,
    ExitConfig,
    LoggingConfig,
    LRScheduleConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    TokenizerConfig,
    TrainingConfig,
)


def tiny_model(**overrides) -> ModelConfig:
    """2 layers, hidden 64, 4 heads, 128 vocabulary rows, 32 positions; ``overrides`` replace fields."""
    base = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128, seq_length=32)
    return dataclasses.replace(base, **overrides)


def run_config(dtype: str = "bf16", precision=None, batch=None, dp=2, clip_grad=1.0, activation_checkpointing=False,
               **parts) -> RunConfig:
    """A tiny run: ``dtype`` is ``ModelConfig.params_dtype`` (fp32 | bf16 | fp16), ``precision`` the
    PrecisionConfig (default ZeRO stage 1), ``dp`` the data-parallel size; ``parts`` replace whole
    RunConfig fields (``training=TrainingConfig(...)``, ``model=tiny_model(...)``). Not validated."""
    fields = dict(
        model=tiny_model(params_dtype=dtype),
        parallel=ParallelConfig(data_parallel_size=dp),
        optimizer=OptimizerConfig(clip_grad=clip_grad),
        lr_schedule=LRScheduleConfig(),
        batch=batch or BatchConfig(micro_batch_size=2, global_batch_size=16),
        precision=precision or PrecisionConfig(zero_stage=1),
        data=DataConfig(data_path=((1.0, "a"),), seq_length=32,
                        tokenizer=TokenizerConfig("GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt")),
        training=TrainingConfig(train_iters=10, checkpoint_activations=activation_checkpointing,
                                deepspeed_activation_checkpointing=activation_checkpointing),
        logging=LoggingConfig(), checkpoint=CheckpointConfig(), exit=ExitConfig())
    fields.update(parts)
    return RunConfig(**fields)
