"""The run's record of a checkpoint, readable without DeepSpeed: what a resume and the tools check.

``run_state.json`` (beside DeepSpeed's files) holds the ModelConfig fields, the TP / PP / DP sizes,
the tokenizer, the progress counters, the params dtype and the sequence length. Checkpoints written
before that file existed carry the same record in the client state of ``mp_rank_00_model_states.pt``,
which is then read (safely). ``check_model_config`` names the first architecture field a run and a
checkpoint disagree on. A converted checkpoint (not from training) gets a record of iteration 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Any, Optional

import numpy as np
import torch

from megatron.checkpoint.safe_load import safe_load
from megatron.checkpoint.tags import RUN_STATE, CheckpointFormatError, resolve_tag
from megatron.config import ModelConfig, RunConfig

__all__ = ["build_run_state", "load_run_state", "model_config_from_dict", "check_model_config",
           "ARCHITECTURE_FIELDS", "converted_client_state", "converted_run_state"]


def build_run_state(rc: RunConfig, progress: dict[str, int]) -> dict:
    """The ``run_state.json`` record of a training run at ``progress`` (the loop's counters)."""
    p = rc.parallel
    return {"model_config": dataclasses.asdict(rc.model), "progress": dict(progress),
            "parallel": {"tensor_model_parallel_size": p.tensor_model_parallel_size,
                         "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                         "data_parallel_size": p.data_parallel_size},
            "tokenizer": dataclasses.asdict(rc.data.tokenizer), "params_dtype": rc.model.params_dtype, "seq_length": rc.data.seq_length}


def load_run_state(ckpt_dir: str, tag: Optional[str] = None) -> dict:
    """The run's record of a checkpoint: ``run_state.json``, or (older checkpoints) the client state
    in ``mp_rank_00_model_states.pt``. Holds 'model_config', 'parallel', 'tokenizer', 'progress'."""
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
    if "model_config" not in state:
        raise CheckpointFormatError(f"the record of {os.path.join(ckpt_dir, tag)!r} has no 'model_config': it was "
                                    f"not written by this project's training loop")
    return state


def model_config_from_dict(fields: dict) -> ModelConfig:
    """A ModelConfig from ``dataclasses.asdict`` output, ignoring fields this version does not know."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in fields.items() if k in known})


# Fields that must agree between a checkpoint and the run loading it (the others may change:
# dropout, init std, seed...). The padded vocabulary may grow when a universal checkpoint is loaded
# on a layout that pads more; it may never shrink.
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                       "position_embedding_type", "embed_layernorm", "layernorm_epsilon", "max_position_embeddings")


def check_model_config(saved: dict[str, Any], current: dict[str, Any], universal: bool = False) -> None:
    """Raise ValueError naming the first architecture field that differs."""
    for name in ARCHITECTURE_FIELDS:
        if name in saved and saved[name] != current.get(name):
            raise ValueError(f"the checkpoint was trained with {name} = {saved[name]!r} but this run has "
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
                        extra: Optional[dict] = None) -> dict:
    """The ``run_state.json`` record of a converted checkpoint (what --load checks the flags against)."""
    state = {"model_config": dataclasses.asdict(config), "progress": dict(_ZERO_PROGRESS),
             "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                          "data_parallel_size": 1},
             "tokenizer": tokenizer or {}, "params_dtype": config.params_dtype, "seq_length": config.seq_length}
    state.update(extra or {})
    return state
