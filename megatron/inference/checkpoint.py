"""Our training checkpoints in one process: read and merge any TP / PP into full weights, and write them back.

A checkpoint saved by DeepSpeed's pipeline engine (``megatron.training.checkpointing``) is

    CKPT/latest                                         the tag of the last complete checkpoint
    CKPT/TAG/complete                                   written once every rank has saved
    CKPT/TAG/layer_XX-model_YY-model_states.pt          pipeline layer XX, tensor-parallel rank YY
    CKPT/TAG/mp_rank_ZZ_model_states.pt                 DeepSpeed's record + our client state (one per TP x PP rank)
    CKPT/TAG/run_state.json                             architecture, layout, tokenizer, progress (JSON)

Pipeline layer XX is a global index, the same for any pipeline size: 0 the embedding, 1..L the
transformer layers, L+1 the final LayerNorm, L+2 the tied output head (a function of layer 0's
weights: DeepSpeed writes no file for it; if a file exists it must equal layer 0's words).

Merging across TP uses the regex lists of ``megatron.model.tp_parameters`` (the same ones the
universal-checkpoint converter gets): replicated tensors are taken from rank 0 after checking that
every rank holds the same values, row-parallel ones are concatenated along dim 1, everything else
(column-parallel incl. the per-head interleaved QKV, and the vocabulary) along dim 0.

The run's record (ModelConfig fields, TP / PP / DP sizes, tokenizer, progress) is read from
``run_state.json``; checkpoints written before that file existed carry it in the client state of
``mp_rank_00_model_states.pt`` instead, which is then read.

Loading is safe: layer files with ``torch.load(weights_only=True)``; an ``mp_rank`` file too, with
numpy's array reconstruction allow-listed (the client state holds numpy's RNG state).

Imports torch, megatron.config, megatron.model and the file names of megatron.training.checkpointing:
never deepspeed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from typing import Any, Optional

import numpy as np
import torch

from megatron.config import ModelConfig
from megatron.training.checkpointing import COMPLETE_MARKER, LATEST, RUN_STATE
from megatron.model.tp_parameters import (ROW_PARALLEL_PARAMETER_PATTERNS, TP_REPLICATED_PARAMETER_PATTERNS,
                                          matches_any)

__all__ = ["CheckpointFormatError", "resolve_tag", "load_run_state", "load_full_state_dict",
           "merge_tp_shards", "split_for_tp", "save_as_training_checkpoint", "converted_client_state",
           "converted_run_state", "pipeline_layer_prefix",
           "model_config_from_dict"]

_LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_MP_RANK_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


class CheckpointFormatError(ValueError):
    """A checkpoint directory that is missing, incomplete or inconsistent."""


def resolve_tag(ckpt_dir: str, tag: Optional[str] = None) -> str:
    """The tag to read: ``tag`` or the one ``latest`` names; refuse a tag without the ``complete`` marker."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointFormatError(f"checkpoint directory {ckpt_dir!r} does not exist; pass the --save directory "
                                    f"of a training run")
    if tag is None:
        latest = os.path.join(ckpt_dir, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointFormatError(f"{ckpt_dir!r} has no '{LATEST}' file: no checkpoint was completed there "
                                        f"(or pass a tag explicitly)")
        with open(latest) as f:
            tag = f.read().strip()
    tag_dir = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointFormatError(f"checkpoint tag {tag!r} is not a directory of {ckpt_dir!r}")
    if not os.path.isfile(os.path.join(tag_dir, COMPLETE_MARKER)):
        raise CheckpointFormatError(f"checkpoint {tag_dir!r} has no '{COMPLETE_MARKER}' marker: its save did not "
                                    f"finish (a crash during the save?); use an earlier tag")
    return tag


def _safe_load(path: str) -> Any:
    # numpy's RNG state (in our client state) pickles as an ndarray: allow exactly what that needs.
    allowed = [np.ndarray, np.dtype, np._core.multiarray._reconstruct, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - name the offending globals, whatever torch raised
        try:
            needs = f"it needs {torch.serialization.get_unsafe_globals_in_checkpoint(path)}"
        except Exception:  # noqa: BLE001 - not even a readable torch file
            needs = "it is not a readable torch file"
        raise CheckpointFormatError(f"{path!r} does not load with torch.load(weights_only=True) ({needs}): "
                                    f"{error}") from error


def load_run_state(ckpt_dir: str, tag: Optional[str] = None) -> dict:
    """The run's record of a checkpoint: ``run_state.json``, or (older checkpoints) the client state
    in ``mp_rank_00_model_states.pt``. Holds 'model_config', 'parallel', 'tokenizer', 'progress'."""
    tag = resolve_tag(ckpt_dir, tag)
    json_path = os.path.join(ckpt_dir, tag, RUN_STATE)
    if os.path.isfile(json_path):
        with open(json_path) as f:
            state = json.load(f)
    else:
        path = os.path.join(ckpt_dir, tag, "mp_rank_00_model_states.pt")
        if not os.path.isfile(path):
            raise CheckpointFormatError(f"{os.path.join(ckpt_dir, tag)!r} has neither {RUN_STATE} nor "
                                        f"mp_rank_00_model_states.pt: not a checkpoint of this project")
        state = _safe_load(path)
    if "model_config" not in state:
        raise CheckpointFormatError(f"the record of {os.path.join(ckpt_dir, tag)!r} has no 'model_config': it was "
                                    f"not written by this project's training loop")
    return state


def model_config_from_dict(fields: dict) -> ModelConfig:
    """A ModelConfig from ``dataclasses.asdict`` output, ignoring fields this version does not know."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in fields.items() if k in known})


def pipeline_layer_prefix(index: int, num_layers: int) -> Optional[str]:
    """GPTModel name prefix of pipeline layer ``index``; None for the tied head (index L+2)."""
    if index == 0:
        return "embedding."
    if 1 <= index <= num_layers:
        return f"layers.{index - 1}."
    if index == num_layers + 1:
        return "final_layernorm."
    if index == num_layers + 2:
        return None
    raise CheckpointFormatError(f"pipeline layer index {index} does not exist in a model of {num_layers} layers "
                                f"(0 embedding, 1..{num_layers} transformer, {num_layers + 1} final LayerNorm, "
                                f"{num_layers + 2} tied head)")


def merge_tp_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """One full tensor from its TP shards (rank order), by the rules of ``megatron.model.tp_parameters``."""
    if len(shards) == 1:
        return shards[0]
    if matches_any(name, TP_REPLICATED_PARAMETER_PATTERNS):
        for rank, shard in enumerate(shards[1:], start=1):
            if shard.shape != shards[0].shape or not torch.equal(shard, shards[0]):
                diff = ((shard.float() - shards[0].float()).abs().max().item()
                        if shard.shape == shards[0].shape else f"shape {list(shard.shape)}")
                raise CheckpointFormatError(
                    f"{name} is replicated across tensor-parallel ranks but rank {rank} differs from rank 0 "
                    f"(max abs diff {diff}); train with --sync-tp-duplicated-parameters or average them first")
        return shards[0]
    dim = 1 if matches_any(name, ROW_PARALLEL_PARAMETER_PATTERNS) else 0
    return torch.cat(shards, dim=dim)


def split_for_tp(name: str, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The inverse of :func:`merge_tp_shards`: ``tp`` shards of a full tensor (copies of replicated ones)."""
    if tp == 1 or matches_any(name, TP_REPLICATED_PARAMETER_PATTERNS):
        return [tensor.clone() for _ in range(tp)]
    dim = 1 if matches_any(name, ROW_PARALLEL_PARAMETER_PATTERNS) else 0
    if tensor.shape[dim] % tp:
        raise ValueError(f"{name} has {tensor.shape[dim]} entries along dim {dim}, not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    return [chunk.clone() for chunk in torch.chunk(tensor, tp, dim=dim)]


def _layer_files(tag_dir: str) -> dict[int, dict[int, str]]:
    """{pipeline layer index: {tp rank: path}} of a tag directory."""
    files: dict[int, dict[int, str]] = {}
    for entry in os.listdir(tag_dir):
        match = _LAYER_FILE.match(entry)
        if match:
            tp_rank = int(match.group(2)) if match.group(2) is not None else 0
            files.setdefault(int(match.group(1)), {})[tp_rank] = os.path.join(tag_dir, entry)
    return files


def _check_layout(files: dict[int, dict[int, str]], num_layers: int, tag_dir: str) -> int:
    """Every layer 0..L+1 present for the same TP ranks 0..tp-1; return tp."""
    expected = set(range(num_layers + 2))
    missing = sorted(expected - set(files))
    if missing:
        raise CheckpointFormatError(f"{tag_dir!r} lacks the files of pipeline layers {missing} (a model of "
                                    f"{num_layers} layers has layers 0..{num_layers + 1}); was every stage saved?")
    tp = len(files[0])
    for index, ranks in sorted(files.items()):
        if sorted(ranks) != list(range(tp)):
            raise CheckpointFormatError(f"pipeline layer {index} in {tag_dir!r} has tensor-parallel ranks "
                                        f"{sorted(ranks)}, layer 0 has {tp}: the checkpoint is incomplete")
    return tp


def load_full_state_dict(ckpt_dir: str, tag: Optional[str] = None
                         ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(ModelConfig, TP=1 GPTModel state dict, run record) of a checkpoint of any TP / PP.

    The word embedding keeps its padded rows (``config.padded_vocab_size``); exporters trim them.
    Tensors keep the dtype they were saved in.
    """
    tag = resolve_tag(ckpt_dir, tag)
    record = load_run_state(ckpt_dir, tag)
    config = model_config_from_dict(record["model_config"])
    tag_dir = os.path.join(ckpt_dir, tag)
    files = _layer_files(tag_dir)
    tp = _check_layout(files, config.num_layers, tag_dir)
    recorded = record.get("parallel", {}).get("tensor_model_parallel_size", tp)
    if recorded != tp:
        raise CheckpointFormatError(f"{tag_dir!r} holds layer files of {tp} tensor-parallel ranks but its run "
                                    f"record says --tensor-model-parallel-size {recorded}")
    state: dict[str, torch.Tensor] = {}
    head: Optional[list[dict]] = None
    for index in sorted(files):
        shards = [_safe_load(files[index][rank]) for rank in range(tp)]
        prefix = pipeline_layer_prefix(index, config.num_layers)
        if prefix is None:
            head = shards
            continue
        for key in shards[0]:
            if any(key not in shard for shard in shards):
                raise CheckpointFormatError(f"{key} of pipeline layer {index} is missing on some TP rank")
            state[prefix + key] = merge_tp_shards(prefix + key, [shard[key] for shard in shards])
    if head is not None:
        words = merge_tp_shards("embedding.word_embeddings.weight", [s["word_embeddings.weight"] for s in head])
        if not torch.equal(words, state["embedding.word_embeddings.weight"]):
            raise CheckpointFormatError("the tied output head's word embedding differs from the input embedding's")
    return config, state, record


def _default_rng_state(seed: int) -> dict:
    """An RNG record as ``checkpointing.rng_state`` writes it, from ``seed`` (a converted checkpoint has no run)."""
    generator = torch.Generator().manual_seed(seed)
    return {"python": random.Random(seed).getstate(), "numpy": np.random.RandomState(seed).get_state(),
            "torch": generator.get_state()}


def _deepspeed_record(mp_world_size: int) -> dict:
    """What DeepSpeed's engine reads from ``mp_rank_XX_model_states.pt`` when it loads a pipeline
    checkpoint without optimizer states (engine._load_checkpoint): 'module' None sends it to the
    layer files; the step counters and world sizes are read unconditionally."""
    return {"module": None, "buffer_names": [], "optimizer": None, "lr_scheduler": None,
            "global_steps": 0, "global_samples": 0, "skipped_steps": 0, "dp_world_size": 1,
            "mp_world_size": mp_world_size}


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


def _layer_state(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix):]: tensor for name, tensor in state_dict.items() if name.startswith(prefix)}


def save_as_training_checkpoint(config: ModelConfig, state_dict: dict[str, torch.Tensor], out_dir: str, tp: int,
                                pp: int, client_state: Optional[dict] = None, run_state: Optional[dict] = None,
                                tag: str = "global_step0") -> str:
    """Write a TP=1 GPTModel state dict as a checkpoint that ``pretrain_gpt.py --load`` reads at TP ``tp``
    and PP ``pp`` (the weights only: load it with --finetune or --no-load-optim). Returns the tag directory.

    Layer files do not depend on PP (their indices are global); PP sets the number of mp_rank files
    DeepSpeed expects (TP x PP). client_state: default :func:`converted_client_state`; run_state
    (run_state.json): default :func:`converted_run_state` without a tokenizer.
    """
    config.validate(tp)
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be a positive integer, got {pp!r}")
    tag_dir = os.path.join(out_dir, tag)
    if os.path.exists(tag_dir) and os.listdir(tag_dir):
        raise ValueError(f"{tag_dir!r} already exists and is not empty; choose another --save directory")
    os.makedirs(tag_dir, exist_ok=True)
    prefixes = [pipeline_layer_prefix(i, config.num_layers) for i in range(config.num_layers + 2)]
    used: set[str] = set()
    for index, prefix in enumerate(prefixes):
        layer = _layer_state(state_dict, prefix)
        if not layer:
            raise ValueError(f"the state dict has no tensors under {prefix!r} (pipeline layer {index})")
        used.update(prefix + key for key in layer)
        shards = {key: split_for_tp(prefix + key, tensor.contiguous(), tp) for key, tensor in layer.items()}
        for rank in range(tp):
            path = os.path.join(tag_dir, f"layer_{index:02d}-model_{rank:02d}-model_states.pt")
            torch.save({key: chunks[rank] for key, chunks in shards.items()}, path)
    if used != set(state_dict):
        raise ValueError(f"state dict entries outside GPTModel's layout: {sorted(set(state_dict) - used)}")
    client = client_state if client_state is not None else converted_client_state()
    for rank in range(tp * pp):
        torch.save({**_deepspeed_record(tp * pp), **client},
                   os.path.join(tag_dir, f"mp_rank_{rank:02d}_model_states.pt"))
    record = run_state if run_state is not None else converted_run_state(config, tp, pp)
    with open(os.path.join(tag_dir, RUN_STATE), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    with open(os.path.join(tag_dir, COMPLETE_MARKER), "w") as f:
        f.write("0\n")
    tmp = os.path.join(out_dir, f"{LATEST}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(tag)
    os.replace(tmp, os.path.join(out_dir, LATEST))
    return tag_dir
