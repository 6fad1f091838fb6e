"""Checkpoints of any TP / PP in one process: merged into full (TP=1) GPTModel weights, and written back.

A checkpoint saved by DeepSpeed's pipeline engine (``megatron.checkpoint.training_io``) holds one
file per pipeline layer and TP rank, ``TAG/layer_XX-model_YY-model_states.pt``; XX is the global
pipeline index of ``megatron.model.layout.pipeline_items`` (the same for any pipeline size). The
tied output head's item owns no parameters: DeepSpeed writes no file for it, and if one exists its
word embedding must equal the input embedding's.

Merging across TP follows ``megatron.model.layout.parameter_layout`` (the same description the
universal-checkpoint info is made from): a replicated tensor is taken from rank 0 after checking
that every rank holds the same values, a split one is concatenated along its partition dim
(row-parallel 1; column-parallel, the per-head interleaved QKV and the vocabulary 0).

Every file is read with ``megatron.checkpoint.safe_load`` (no code runs). Imports torch,
megatron.config and megatron.model: never deepspeed.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch

from megatron.checkpoint.expert_files import (
    check_expert_parallel_size,
    ep_slice,
    expert_file_names,
    read_expert_files,
    write_expert_files,
)
from megatron.checkpoint.integrity import record_checksums, verify_checksums
from megatron.checkpoint.run_state import (
    checkpoint_layout,
    converted_client_state,
    converted_run_state,
    load_run_state,
    model_config_from_dict,
    weight_files,
)
from megatron.checkpoint.safe_load import safe_load
from megatron.checkpoint.tags import COMPLETE_MARKER, LATEST, RUN_STATE, CheckpointFormatError, resolve_tag
from megatron.checkpoint.tp_shards import merge_tp_shards, split_for_tp
from megatron.checkpoint.universal.router_state import ROUTER_BUFFER
from megatron.config import ModelConfig
from megatron.model.layout import local_name_of_file_key, parameter_layout, pipeline_items
from megatron.parallel.fp8_linear import is_fp8_state_key

__all__ = ["load_full_state_dict", "save_as_training_checkpoint", "router_buffer_names"]

_LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")


def _layer_files(tag_dir: str) -> dict[int, dict[int, str]]:
    """{pipeline layer index: {tp rank: path}} of a tag directory."""
    files: dict[int, dict[int, str]] = {}
    for entry in os.listdir(tag_dir):
        match = _LAYER_FILE.match(entry)
        if match:
            tp_rank = int(match.group(2)) if match.group(2) is not None else 0
            files.setdefault(int(match.group(1)), {})[tp_rank] = os.path.join(tag_dir, entry)
    return files


def _check_layout(files: dict[int, dict[int, str]], config: ModelConfig, numbering: str, tag_dir: str) -> int:
    """A file for every pipeline layer that owns parameters, each for the same TP ranks 0..tp-1; return tp."""
    owners = [item.index for item in pipeline_items(config, numbering) if item.prefix is not None]
    missing = sorted(set(owners) - set(files))
    if missing:
        raise CheckpointFormatError(f"{tag_dir!r} lacks the files of pipeline layers {missing} (a model of "
                                    f"{config.num_layers} layers in the {numbering!r} layout has files for layers "
                                    f"{owners}); was every stage saved?")
    tp = len(files[owners[0]])
    for index, ranks in sorted(files.items()):
        if sorted(ranks) != list(range(tp)):
            raise CheckpointFormatError(f"pipeline layer {index} in {tag_dir!r} has tensor-parallel ranks "
                                        f"{sorted(ranks)}, layer 0 has {tp}: the checkpoint is incomplete")
    return tp


def load_full_state_dict(ckpt_dir: str, tag: Optional[str] = None
                         ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(ModelConfig, TP=1 GPTModel state dict, run record) of a checkpoint of any TP / PP.

    The word embedding keeps its padded rows (``config.padded_vocab_size``); exporters trim them.
    Tensors keep the dtype they were saved in; a ZeRO-2 / ZeRO-3 checkpoint gives its fp32 master weights
    (``megatron.checkpoint.zero_files``). Which files are read is the record's ``weight_files``.
    """
    tag = resolve_tag(ckpt_dir, tag, required=True)
    record = load_run_state(ckpt_dir, tag)
    config = model_config_from_dict(record["model_config"])
    numbering = checkpoint_layout(record)
    tag_dir = os.path.join(ckpt_dir, tag)
    kind = weight_files(record)
    if kind != "layer_files":  # DeepSpeed's model engine's files (megatron.engine.model_engine)
        # Imported here: zero_files imports DeepSpeed's classes, which the pipeline engine's files never need.
        from megatron.checkpoint.zero_files import module_states_state_dict, sharded_state_dict  # noqa: PLC0415 (deepspeed, seconds to import: only for the model engine's files)

        problems = verify_checksums(tag_dir, distributed=False)
        if problems:
            raise CheckpointFormatError(f"checkpoint {tag_dir!r} is damaged: " + "; ".join(problems))
        read = sharded_state_dict if kind == "zero_partitions" else module_states_state_dict
        return config, read(tag_dir, config, record.get("parallel", {}).get("tensor_model_parallel_size", 1)), record
    files = _layer_files(tag_dir)
    tp = _check_layout(files, config, numbering, tag_dir)
    read = [os.path.basename(path) for ranks in files.values() for path in ranks.values()]
    ep = record.get("parallel", {}).get("expert_model_parallel_size", 1)
    read += expert_file_names(tag_dir) if ep > 1 else []
    problems = verify_checksums(tag_dir, distributed=False, names=read + ["mp_rank_00_model_states.pt"])
    if problems:
        raise CheckpointFormatError(f"checkpoint {tag_dir!r} is damaged: " + "; ".join(problems))
    items, layout = pipeline_items(config, numbering), parameter_layout(config, numbering)
    recorded = record.get("parallel", {}).get("tensor_model_parallel_size", tp)
    if recorded != tp:
        raise CheckpointFormatError(f"{tag_dir!r} holds layer files of {tp} tensor-parallel ranks but its run "
                                    f"record says --tensor-model-parallel-size {recorded}")
    # --expert-tensor-parallel-size below TP: whole experts, one expert file per (EP rank, expert-TP rank)
    etp = record.get("parallel", {}).get("expert_tensor_parallel_size", tp)
    state: dict[str, torch.Tensor] = {}
    head: Optional[list[dict]] = None
    for index in sorted(files):
        if index >= len(items):
            raise CheckpointFormatError(f"{tag_dir!r} holds a file of pipeline layer {index}, but a model of "
                                        f"{config.num_layers} layers has layers 0..{len(items) - 1}")
        shards = [safe_load(files[index][rank]) for rank in range(tp)]
        prefix = items[index].prefix
        if prefix is None:
            head = shards
            continue
        for key in shards[0]:
            if any(key not in shard for shard in shards):
                raise CheckpointFormatError(f"{key} of pipeline layer {index} is missing on some TP rank")
            name = prefix + local_name_of_file_key(key, numbering)
            if is_fp8_state_key(key):  # an FP8 run's scaling state: how it computed, not the model
                continue
            if key.endswith(ROUTER_BUFFER):  # an MoE router's expert bias (an MTP depth's too): whole on every TP rank
                state[name] = shards[0][key]
                continue
            if name not in layout:
                raise CheckpointFormatError(f"pipeline layer {index} of {tag_dir!r} holds {key!r}, which the "
                                            f"recorded model configuration does not have")
            if etp != tp and layout[name].expert_parallel:  # other whole experts on each TP rank: expert files
                continue
            state[name] = merge_tp_shards(layout[name], [shard[key] for shard in shards])
    if ep > 1:  # the layer files hold EP rank 0's experts: every rank's are in the expert files
        state.update(read_expert_files(tag_dir, config, layout, etp, ep))
    if head is not None:
        for param in (p for p in layout.values() if p.tied_to_head):
            tied = merge_tp_shards(param, [shard[param.file_key] for shard in head])
            if not torch.equal(tied, state[param.name]):
                raise CheckpointFormatError(f"the tied output head's {param.local_name} differs from the input "
                                            f"embedding's")
    return config, state, record


def router_buffer_names(config: ModelConfig) -> list[str]:
    """The GPTModel names of the routers' expert biases (``--moe-router-enable-expert-bias``): buffers, not in the
    parameter layout, that layer files and full state dicts carry beside the parameters."""
    moe = config.moe
    if moe is None or not moe.router_enable_expert_bias:
        return []
    depths = [f"mtp.layers.{k}.transformer_layer.{ROUTER_BUFFER}" for k in range(config.mtp_num_layers)
              if moe.is_moe_layer(config.num_layers + k)]
    return [f"layers.{i}.{ROUTER_BUFFER}" for i in range(config.num_layers) if moe.is_moe_layer(i)] + depths


def _deepspeed_record(mp_world_size: int) -> dict:
    """What DeepSpeed's engine reads from ``mp_rank_XX_model_states.pt`` when it loads a pipeline
    checkpoint without optimizer states (engine._load_checkpoint): 'module' None sends it to the
    layer files; the step counters and world sizes are read unconditionally."""
    return {"module": None, "buffer_names": [], "optimizer": None, "lr_scheduler": None,
            "global_steps": 0, "global_samples": 0, "skipped_steps": 0, "dp_world_size": 1,
            "mp_world_size": mp_world_size}


def _layer_state(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix):]: tensor for name, tensor in state_dict.items() if name.startswith(prefix)}


def save_as_training_checkpoint(config: ModelConfig, state_dict: dict[str, torch.Tensor], out_dir: str, tp: int,
                                pp: int, client_state: Optional[dict] = None, run_state: Optional[dict] = None,
                                tag: str = "global_step0", ep: int = 1) -> str:
    """Write a TP=1 GPTModel state dict as a checkpoint that ``pretrain_gpt.py --load`` reads at TP ``tp``
    and PP ``pp`` (the weights only: load it with --finetune or --no-load-optim). Returns the tag directory.

    Layer files do not depend on PP (their indices are global); PP sets the number of mp_rank files
    DeepSpeed expects (TP x PP). client_state: default :func:`converted_client_state`; run_state
    (run_state.json): default :func:`converted_run_state` without a tokenizer. ep: an MoE model's
    expert-parallel size; above 1 the layer files hold EP rank 0's experts and each (EP, TP, PP) coordinate's
    are in its expert file (``megatron.checkpoint.expert_files``), as the pipeline engine writes them.
    """
    config.validate(tp)
    check_expert_parallel_size(config, ep)
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be a positive integer, got {pp!r}")
    tag_dir = os.path.join(out_dir, tag)
    if os.path.exists(tag_dir) and os.listdir(tag_dir):
        raise ValueError(f"{tag_dir!r} already exists and is not empty; choose another --save directory")
    layout = parameter_layout(config)
    unknown = sorted(set(state_dict) - set(layout) - set(router_buffer_names(config)))
    if unknown:
        raise ValueError(f"state dict entries outside GPTModel's layout: {unknown}")
    os.makedirs(tag_dir, exist_ok=True)
    for item in pipeline_items(config):
        if item.prefix is None:
            continue  # the tied head: DeepSpeed writes no file for it
        index, prefix = item.index, item.prefix
        layer = _layer_state(state_dict, prefix)
        if not layer:
            raise ValueError(f"the state dict has no tensors under {prefix!r} (pipeline layer {index})")
        shards = {layout[prefix + key].file_key: split_for_tp(
            layout[prefix + key], ep_slice(layout[prefix + key], tensor, ep, 0).contiguous(), tp)
            for key, tensor in layer.items() if not key.endswith(ROUTER_BUFFER)}
        for key in [k for k in layer if k.endswith(ROUTER_BUFFER)]:  # expert biases: whole on every TP rank
            shards[key] = [layer[key].contiguous()] * tp
        for rank in range(tp):
            path = os.path.join(tag_dir, f"layer_{index:02d}-model_{rank:02d}-model_states.pt")
            torch.save({key: chunks[rank] for key, chunks in shards.items()}, path)
    if ep > 1:
        write_expert_files(tag_dir, config, layout, state_dict, tp, pp, ep)
    client = client_state if client_state is not None else converted_client_state()
    for rank in range(tp * pp):
        torch.save({**_deepspeed_record(tp * pp), **client},
                   os.path.join(tag_dir, f"mp_rank_{rank:02d}_model_states.pt"))
    record = run_state if run_state is not None else converted_run_state(config, tp, pp, ep=ep)
    with open(os.path.join(tag_dir, RUN_STATE), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    record_checksums(tag_dir, distributed=False)
    with open(os.path.join(tag_dir, COMPLETE_MARKER), "w") as f:
        f.write("0\n")
    tmp = os.path.join(out_dir, f"{LATEST}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(tag)
    os.replace(tmp, os.path.join(out_dir, LATEST))
    return tag_dir
