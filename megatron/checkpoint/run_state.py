"""The run's record of a checkpoint, readable without DeepSpeed: what a resume and the tools check.

``run_state.json`` (beside DeepSpeed's files) holds the ModelConfig fields, the TP / PP / DP sizes,
the tokenizer, the progress counters, the params dtype and the sequence length. Checkpoints written
before that file existed carry the same record in the client state of ``mp_rank_00_model_states.pt``,
which is then read (safely). ``check_model_config`` names the first architecture field a run and a
checkpoint disagree on. A converted checkpoint (not from training) gets a record of iteration 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
from typing import Any, Optional

import numpy as np
import torch

from megatron.checkpoint.safe_load import safe_load
from megatron.checkpoint.tags import RUN_STATE, CheckpointFormatError, resolve_tag
from megatron.config import ModelConfig, RunConfig, parallel_dims
from megatron.config.mla import MLAConfig
from megatron.config.model import swiglu_default_ffn_size
from megatron.config.moe import MoEConfig
from megatron.config.pipeline_layout import describe
from megatron.config.run import deepspeed_engine_for
from megatron.model.layout import LAYOUT, LEGACY_LAYOUT

__all__ = ["build_run_state", "checkpoint_layout", "record_from_megatron_args", "megatron_args",
           "MEGATRON_CHECKPOINT_VERSION", "load_run_state", "model_config_from_dict", "check_model_config",
           "rotary_scaling_change", "YARN_FIELDS", "ARCHITECTURE_FIELDS", "converted_client_state",
           "converted_run_state", "UNIVERSAL_ENGINE", "reader_for",
           "weight_files", "SAVING_ENGINE", "WEIGHT_FILES", "WEIGHT_FILE_KINDS"]


def _record(model: dict, parallel: dict, tokenizer: dict, progress: dict, seq_length: int) -> dict:
    """The one shape of a checkpoint's record (run_state.json), whoever made the checkpoint."""
    return {"model_config": model, "progress": dict(progress), "parallel": parallel, "tokenizer": tokenizer,
            "params_dtype": model["params_dtype"], "seq_length": seq_length, "checkpoint_layout": LAYOUT}


def _parallel(tp: int, pp: int, dp: Optional[int], **others: int) -> dict:
    """The record's sizes (``megatron.config.parallel_dims.recorded_sizes``): tp, pp and a known dp always, the
    other dimensions (by short name) when > 1."""
    return parallel_dims.recorded_sizes(dict(others, tp=tp, pp=pp, dp=dp))


def build_run_state(rc: RunConfig, progress: dict[str, int]) -> dict:
    """The ``run_state.json`` record of a training run at ``progress`` (the loop's counters)."""
    # every size that decides which files a rank reads (parallel_dims' on_resume): TP / PP the weight files,
    # dp x sp x cp the ZeRO shards, EP one expert file per EP rank, virtual stages which layers a shard holds
    parallel = parallel_dims.recorded_sizes(rc.parallel.sizes())
    parallel["zero_stage"] = rc.deepspeed_zero_stage  # 2 and 3 write DeepSpeed's model-engine files
    if rc.parallel.expert_tp != rc.parallel.tensor_model_parallel_size:  # the expert files' "tp" (absent: TP)
        parallel["expert_tensor_parallel_size"] = rc.parallel.expert_tp
    layout = pipeline_layout_of(rc)
    if layout is not None:  # the pipeline layout flags' stages (absent: --pp-partition-method's split)
        parallel["pipeline_layout"] = layout
    record = _record(dataclasses.asdict(rc.model), parallel, dataclasses.asdict(rc.data.tokenizer), progress,
                     rc.data.seq_length)
    # How the checkpoint was written, so that no reader re-derives it from the flags (weight_files).
    record[SAVING_ENGINE] = rc.deepspeed_engine
    record[WEIGHT_FILES] = weight_files(record)
    return record


MEGATRON_CHECKPOINT_VERSION = 3.0  # what Megatron-LM / Megatron-DeepSpeed write as 'checkpoint_version'


def pipeline_layout_of(rc: RunConfig) -> Optional[str]:
    """The run's (virtual) stages as the pipeline layout flags place them, in the layout's letters
    (``E,t*3|t,L``); None without those flags. Which layers each rank's files and optimizer shards hold."""
    stages = rc.parallel.stage_contents(rc.model.num_layers, rc.model.mtp_num_layers)
    return None if stages is None else "|".join(describe(stage) for stage in stages)


def _plain(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def megatron_args(rc: RunConfig, progress: dict[str, int]) -> argparse.Namespace:
    """Megatron's ``args`` record for the mp_rank files: every flag of the run under its Megatron name
    (the config fields are the flag names), plus the derived values Megatron's own checkpoint tools
    read (tensor / pipeline / data-parallel sizes, padded vocabulary, iteration, consumed samples).
    Plain values only, so ``megatron.checkpoint.safe_load`` reads it."""
    args = {}
    for part in dataclasses.fields(rc):
        value = getattr(rc, part.name)
        if dataclasses.is_dataclass(value):
            args.update({f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)})
    args.update(dataclasses.asdict(rc.data.tokenizer))
    args.pop("tokenizer", None)
    data_path = [str(x) for pair in rc.data.data_path for x in pair] or None
    args.update(data_path=data_path, world_size=rc.world_size, bf16=rc.bf16, fp16=rc.fp16,
                iteration=progress["iteration"], consumed_train_samples=progress["consumed_samples"],
                consumed_train_tokens=progress["consumed_tokens"], deepspeed=True)
    return argparse.Namespace(**args)


UNIVERSAL_ENGINE = "universal_engine"  # set by ds_to_universal.py: the engine whose names the zero/ folders use


SAVING_ENGINE = "saving_engine"  # RunConfig.deepspeed_engine of the run that saved
WEIGHT_FILES = "weight_files"  # where its weights are: one of WEIGHT_FILE_KINDS
WEIGHT_FILE_KINDS = {
    "layer_files": "the pipeline engine's layer_XX-model_YY-model_states.pt, one per pipeline layer and TP rank",
    "module_states": "the model engine's mp_rank_YY_model_states.pt at ZeRO-0/1: each TP rank's module",
    "zero_partitions": "the model engine's ZeRO-2/3 optimizer states: the fp32 masters, partitioned",
}


def reader_for(record: dict, universal: bool = False) -> str:
    """The DeepSpeed engine that reads a checkpoint: "model" (the model engine, GPTModel's names: ZeRO-2/3
    and every DeepSpeed-Ulysses run) or "pipeline". The one answer every resume check, converter and reader asks.

    A regular checkpoint is read by the engine that saved it (recorded at save time; records before that: the
    run side's rule, ``megatron.config.run.deepspeed_engine_for``, on the recorded sizes). A universal one
    (``universal``) by the engine its parameter folders are named for (ds_to_universal.py --target-engine;
    conversions before that was recorded kept the saving run's)."""
    if universal and UNIVERSAL_ENGINE in record:
        return record[UNIVERSAL_ENGINE]
    if SAVING_ENGINE in record:
        return record[SAVING_ENGINE]
    parallel = record.get("parallel", {})
    return deepspeed_engine_for(parallel.get("zero_stage", 0), parallel.get("ds_sequence_parallel_size", 1))


def weight_files(record: dict) -> str:
    """Which files of a checkpoint hold its weights (a key of WEIGHT_FILE_KINDS), as recorded at save time;
    every reader of weights asks this (records before it: derived from the saving engine and ZeRO stage)."""
    if WEIGHT_FILES in record:
        kind = record[WEIGHT_FILES]
        if kind not in WEIGHT_FILE_KINDS:
            raise CheckpointFormatError(f"the checkpoint's record names weight files {kind!r}, which this version "
                                        f"does not read (it reads {sorted(WEIGHT_FILE_KINDS)})")
        return kind
    if reader_for(record) == "pipeline":
        return "layer_files"
    return "zero_partitions" if record.get("parallel", {}).get("zero_stage", 0) >= 2 else "module_states"


def checkpoint_layout(record: dict) -> str:
    """The pipeline numbering a checkpoint's layer files use (records before it existed: the legacy one)."""
    return record.get("checkpoint_layout", LEGACY_LAYOUT)


def load_run_state(ckpt_dir: str, tag: Optional[str] = None) -> dict:
    """The run's record of a checkpoint: ``run_state.json``, or (older checkpoints) the client state
    in ``mp_rank_00_model_states.pt``, or (a checkpoint written by Megatron-DeepSpeed) what its
    ``args`` say. Holds 'model_config', 'parallel', 'tokenizer', 'progress'."""
    tag = resolve_tag(ckpt_dir, tag, required=True)
    json_path = os.path.join(ckpt_dir, tag, RUN_STATE)
    if os.path.isfile(json_path):
        with open(json_path) as f:
            state = json.load(f)
    else:
        path = os.path.join(ckpt_dir, tag, "mp_rank_00_model_states.pt")
        if not os.path.isfile(path):
            raise CheckpointFormatError(f"{os.path.join(ckpt_dir, tag)!r} has neither {RUN_STATE} nor "
                                        f"mp_rank_00_model_states.pt: not a checkpoint of this project")
        state = safe_load(path)
        if "model_config" not in state and "args" in state:
            state = record_from_megatron_args(state["args"], state.get("iteration", 0), path)
    if "model_config" not in state:
        raise CheckpointFormatError(f"the record of {os.path.join(ckpt_dir, tag)!r} has no 'model_config': it was "
                                    f"not written by this project's training loop")
    return state


def record_from_megatron_args(args: argparse.Namespace, iteration: int, path: str) -> dict:
    """Our record of a checkpoint Megatron-DeepSpeed wrote (BLOOM's numbering, no run_state.json),
    from its ``args``; CheckpointFormatError naming what is missing."""
    a = vars(args)
    needed = ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size", "seq_length",
              "tensor_model_parallel_size", "pipeline_model_parallel_size")
    missing = [name for name in needed if a.get(name) is None]
    if missing:
        raise CheckpointFormatError(f"{path!r}: Megatron's args lack {missing}; cannot tell the model it holds")
    position = a.get("position_embedding_type") or "absolute"
    position = getattr(position, "name", position)  # Megatron keeps an enum there
    model = {name: a[name] for name in needed[:5]}
    model.update(ffn_hidden_size=a.get("ffn_hidden_size"), max_position_embeddings=a.get("max_position_embeddings"),
                 position_embedding_type=str(position), embed_layernorm=bool(a.get("embed_layernorm", False)),
                 layernorm_epsilon=a.get("layernorm_epsilon", 1e-5), init_method_std=a.get("init_method_std", 0.02),
                 params_dtype="bf16" if a.get("bf16") else "fp16" if a.get("fp16") else "fp32")
    if a.get("kv_channels") not in (None, a["hidden_size"] // a["num_attention_heads"]):
        model.update(kv_channels=a["kv_channels"])  # Megatron sets it to hidden / heads when not given
    tokenizer = {name: a.get(name) for name in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model",
                                                  "tokenizer_name_or_path")}
    progress = dict(_ZERO_PROGRESS, iteration=int(iteration),
                    consumed_samples=int(a.get("consumed_train_samples") or 0),
                    consumed_tokens=int(a.get("consumed_train_tokens") or 0))
    parallel = _parallel(a["tensor_model_parallel_size"], a["pipeline_model_parallel_size"], None)
    return dict(_record(model, parallel, tokenizer, progress, a["seq_length"]), written_by="Megatron-DeepSpeed")


def model_config_from_dict(fields: dict) -> ModelConfig:
    """A ModelConfig from ``dataclasses.asdict`` output, ignoring fields this version does not know."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    kept = {k: v for k, v in fields.items() if k in known}
    # FP8 is how the run computed, not what the model is: a model rebuilt from the checkpoint (export, serving,
    # evaluation) computes in its own dtype, and its layers drop the saved FP8 scaling state when they load
    kept.pop("fp8", None)
    if isinstance(kept.get("moe"), dict):  # MoE: its own dataclass (JSON made its layer pattern a list)
        moe = {k: v for k, v in kept["moe"].items() if k in {f.name for f in dataclasses.fields(MoEConfig)}}
        kept["moe"] = MoEConfig(**dict(moe, layer_pattern=tuple(moe["layer_pattern"])))
    if isinstance(kept.get("mla"), dict):  # multi-head latent attention: its own dataclass
        mla_fields = {f.name for f in dataclasses.fields(MLAConfig)}
        kept["mla"] = MLAConfig(**{k: v for k, v in kept["mla"].items() if k in mla_fields})
    if "recompute_modules" in kept:  # --recompute-modules (JSON made the tuple a list; the config is hashed)
        kept["recompute_modules"] = tuple(kept["recompute_modules"])
    return ModelConfig(**kept)


# Fields that must agree between a checkpoint and the run loading it (the others may change:
# dropout, init std, seed...). The padded vocabulary may grow when a universal checkpoint is loaded
# on a layout that pads more; it may never shrink.
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                       "position_embedding_type", "embed_layernorm", "layernorm_epsilon", "max_position_embeddings",
                       "num_key_value_heads", "normalization", "swiglu", "add_bias_linear", "add_qkv_bias",
                       "untie_embeddings_and_output_weights", "mla", "apply_layernorm_1p", "kv_channels")


# YaRN (ModelConfig's yarn_* fields) is not an architecture field: a long-context phase resumes a checkpoint trained
# without it (Megatron-LM's DeepSeek-V3 / Qwen3 recipes), so a change is a note, not an error
YARN_FIELDS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
               "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")


def rotary_scaling_change(saved: dict[str, Any], current: dict[str, Any]) -> Optional[str]:
    """A line saying how this run's YaRN differs from the checkpoint's, or None where they agree (a factor of 1,
    or a checkpoint written before the fields, is plain rotary)."""
    def yarn(fields: dict) -> Optional[tuple]:
        return None if fields.get(YARN_FIELDS[0]) in (None, 1.0) else tuple(fields.get(name) for name in YARN_FIELDS)

    def words(y: Optional[tuple]) -> str:
        return "plain rotary positions" if y is None else (
            f"YaRN x{y[0]:g} of {y[1]} positions (beta {y[2]:g} / {y[3]:g}, mscale {y[4]:g} / {y[5]:g}"
            f"{'' if y[6] else ', unrounded'})")

    before, now = yarn(saved), yarn(current)
    if before == now:
        return None
    return (f"note: the checkpoint was trained with {words(before)}, this run uses {words(now)} (a long-context "
            f"phase changes them on purpose; otherwise set --position-embedding-type / --rope-type and the YaRN flags "
            f"as the checkpoint's)")


def check_model_config(saved: dict[str, Any], current: dict[str, Any], universal: bool = False) -> None:
    """Raise ValueError naming the first architecture field that differs (a default and the value it
    stands for are the same: ffn_hidden_size None is 4 x hidden, or swiglu's width; learned positions None
    are seq_length; num_key_value_heads None is one per query head; kv_channels None, or absent from a checkpoint
    written before the field, is hidden / heads)."""
    def effective(fields: dict, name: str):
        value = fields.get(name)
        if name == "ffn_hidden_size" and value is None:
            return swiglu_default_ffn_size(fields["hidden_size"]) if fields.get("swiglu") else 4 * fields["hidden_size"]
        if name == "num_key_value_heads" and value is None:
            return fields.get("num_attention_heads")
        if name == "kv_channels" and value is None:
            return fields["hidden_size"] // fields["num_attention_heads"]
        if name == "max_position_embeddings":
            learned = fields.get("position_embedding_type") == "absolute"
            return (value if value is not None else fields.get("seq_length")) if learned else None
        return value

    for name in ARCHITECTURE_FIELDS:
        if (name in saved or name == "kv_channels") and effective(saved, name) != effective(current, name):
            raise ValueError(f"the checkpoint was trained with {name} = {saved.get(name)!r} but this run has "
                             f"{current.get(name)!r}: the architectures differ; fix --{name.replace('_', '-')} "
                             f"or load another checkpoint")
    saved_vocab, vocab = saved.get("padded_vocab_size"), current.get("padded_vocab_size")
    if saved_vocab is not None and (vocab < saved_vocab if universal else vocab != saved_vocab):
        raise ValueError(f"the checkpoint's padded vocabulary has {saved_vocab} rows, this run's {vocab}: set "
                         f"--pad-vocab-size-to {saved_vocab} (or a --make-vocab-size-divisible-by that gives it)")


def _default_rng_state(seed: int) -> dict:
    """An RNG record as ``checkpointing.rng_state`` writes it, from ``seed`` (a converted checkpoint has no run)."""
    generator = torch.Generator().manual_seed(seed)
    return {"python": random.Random(seed).getstate(), "numpy": np.random.RandomState(seed).get_state(),
            "torch": generator.get_state()}


_ZERO_PROGRESS = {"iteration": 0, "consumed_samples": 0, "consumed_tokens": 0, "skipped_iterations": 0,
                  "nonfinite_iterations": 0}


def converted_client_state(seed: int = 1234) -> dict:
    """Our client state (in the mp_rank files) for a checkpoint that did not come from training:
    iteration 0, nothing consumed, an RNG state seeded with ``seed``. The learning-rate record holds
    only ``num_steps`` 0, so a run loading it without --finetune keeps its own schedule flags."""
    return {"progress": dict(_ZERO_PROGRESS), "lr_scheduler": {"num_steps": 0}, "rng": _default_rng_state(seed),
            "client_state_version": 1, "iteration": 0}


def converted_run_state(config: ModelConfig, tp: int, pp: int, *, tokenizer: Optional[dict] = None,
                        extra: Optional[dict] = None, ep: int = 1) -> dict:
    """The ``run_state.json`` record of a converted checkpoint (what --load checks the flags against): the
    pipeline engine's layer files, as ``megatron.checkpoint.single_process.save_as_training_checkpoint`` writes them;
    with ``ep`` > 1 (MoE) one expert file per expert-parallel rank beside them, for ``ep`` data-parallel ranks."""
    parallel = _parallel(tp, pp, ep, ep=ep)  # MoE: ep data-parallel ranks, one expert file per EP rank
    state = _record(dataclasses.asdict(config), parallel, tokenizer or {}, _ZERO_PROGRESS, config.seq_length)
    state.update({SAVING_ENGINE: "pipeline", WEIGHT_FILES: "layer_files"})
    state.update(extra or {})
    return state
