"""The checked Namespace -> the frozen ``RunConfig`` (``assemble_run_config``, not yet validated: the
pipeline's later steps validate it), and the tokenizer's padded vocabulary (``resolve_vocab_size``).
"""

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
from megatron.data.tokenizers import build_tokenizer, pad_vocab_size


def _pick(cls, args, **extra):
    """``cls`` filled from same-named attributes of ``args`` (flag names are field names), plus ``extra``."""
    names = [f.name for f in cls.__dataclass_fields__.values() if f.name not in extra]
    return cls(**{name: getattr(args, name) for name in names}, **extra)


def assemble_run_config(args) -> RunConfig:
    """The ``RunConfig`` of the flag steps' Namespace (``megatron.arguments.runner``), NOT yet validated.
    ``model.padded_vocab_size`` is None."""
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are both set; pick one")
    params_dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    model = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        padded_vocab_size=None, seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size, position_embedding_type=args.position_embedding_type,
        embed_layernorm=args.embed_layernorm, layernorm_epsilon=args.layernorm_epsilon,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, params_dtype=params_dtype, seed=args.seed,
        rotary_base=args.rotary_base, num_key_value_heads=args.num_key_value_heads, kv_channels=args.kv_channels,
        normalization=args.normalization,
        swiglu=args.swiglu, add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm, apply_layernorm_1p=args.apply_layernorm_1p,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        rope_scaling_factor=args.rope_scaling_factor if args.use_rope_scaling else None,
        attention_backend=args.attention_backend, recompute_core_attention=args.recompute_core_attention,
        recompute_modules=args.recompute_module_parts,
        # with one TP rank there is no sequence to split (the startup warnings say so)
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1, moe=args.moe,
        mla=args.mla, fp8=args.fp8, mtp_num_layers=args.mtp_num_layers or 0,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor, **args.yarn)
    rampup = tuple(args.rampup_batch_size) if args.rampup_batch_size is not None else None
    global_batch = args.global_batch_size
    if global_batch is None:  # Megatron's default: one micro-batch per data-parallel rank and step
        global_batch = args.micro_batch_size * args.data_parallel_size
    return RunConfig(
        model=model,
        parallel=_pick(ParallelConfig, args),
        optimizer=_pick(OptimizerConfig, args),
        lr_schedule=_pick(LRScheduleConfig, args),
        batch=_pick(BatchConfig, args, rampup_batch_size=rampup, global_batch_size=global_batch),
        precision=_pick(PrecisionConfig, args),
        data=_pick(DataConfig, args, tokenizer=_pick(TokenizerConfig, args), data_path=args.data_path_pairs,
                   eod_token_id=None,  # known once the tokenizer is built (resolve_vocab_size)
                   train_weighted_split_groups=args.train_weighted_split_groups,
                   valid_weighted_split_groups=args.valid_weighted_split_groups,
                   test_weighted_split_groups=args.test_weighted_split_groups),
        training=_pick(TrainingConfig, args),
        logging=_pick(LoggingConfig, args),
        checkpoint=_pick(CheckpointConfig, args),
        exit=_pick(ExitConfig, args),
        deepspeed_config=args.deepspeed_config,
        deepspeed_user_config=args.deepspeed_user_config,
        startup_warnings=tuple(args.startup_warnings),
    )


def resolve_vocab_size(run_config: RunConfig, tokenizer=None) -> RunConfig:
    """``run_config`` with the tokenizer's vocabulary and Megatron's padded size filled in.

    ``tokenizer`` defaults to the one the data flags name (``megatron.data.tokenizers``).
    """
    d = run_config.data
    if tokenizer is None:
        tokenizer = build_tokenizer(d.tokenizer)
    padded = pad_vocab_size(tokenizer.vocab_size, d.make_vocab_size_divisible_by,
                            run_config.parallel.tensor_model_parallel_size, d.pad_vocab_size_to)
    run_config = run_config.with_vocab_size(tokenizer.vocab_size, padded)
    if d.eod_mask_loss or d.reset_position_ids or d.reset_attention_mask:
        run_config = dataclasses.replace(run_config, data=dataclasses.replace(d, eod_token_id=tokenizer.eod))
    return run_config
