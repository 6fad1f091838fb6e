"""An MoE checkpoint's experts over expert-parallel ranks, for the single-process tools (converters, exports).

The pipeline engine at EP > 1 (``megatron.engine.expert_parallel``) writes its layer files from data-parallel
rank 0, so they hold expert-parallel rank 0's experts ([E / ep, ...] along dim 0); every (EP, TP, PP)
coordinate writes its own experts to ``EXPERT_FILE`` beside them, ``{"params": {pipeline name: tensor}}``
(``megatron.model.layout.pipeline_name``: ``4.mlp.experts.w1``; its TP shard of this EP rank's experts).
At EP = 1 the layer files hold every expert and there are no expert files.

Here: a full (TP=1, every expert) state dict split into those files, and gathered back from them. A stage's
layers are the pipeline engine's under the default ``--pp-partition-method type:transformer`` (the layer files
do not depend on it; the expert files do, as the training run's own do).

Shape letters: E experts, ep expert-parallel ranks.
"""

from __future__ import annotations

import bisect
import os
import re

import torch

from megatron.checkpoint.safe_load import safe_load
from megatron.checkpoint.tags import CheckpointFormatError
from megatron.checkpoint.tp_shards import merge_tp_shards, split_for_tp
from megatron.config import ModelConfig
from megatron.model.layout import TRANSFORMER, ParameterLayout, model_name, pipeline_items, pipeline_name
from megatron.parallel.pipeline_partition import stage_bounds

__all__ = ["EXPERT_FILE", "DEFAULT_PARTITION", "ep_slice", "write_expert_files", "read_expert_files", "expert_file_names",
           "check_expert_parallel_size"]

EXPERT_FILE = "expert_states_ep_{ep:02d}_tp_{tp:02d}_pp_{pp:02d}.pt"
_EXPERT_FILE = re.compile(r"^expert_states_ep_(\d+)_tp_(\d+)_pp_(\d+)\.pt$")
DEFAULT_PARTITION = "type:transformer"


def check_expert_parallel_size(config: ModelConfig, ep: int) -> None:
    """ValueError unless ``ep`` ranks can share out the model's experts."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--expert-model-parallel-size must be a positive integer, got {ep!r}")
    if ep > 1 and config.moe is None:
        raise ValueError(f"--expert-model-parallel-size {ep} needs an MoE model; this one is dense: use 1")
    if config.moe is not None and config.moe.num_experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {config.moe.num_experts} experts of "
                         f"each MoE layer; use a divisor of {config.moe.num_experts}")


def ep_slice(param: ParameterLayout, tensor: torch.Tensor, ep: int, ep_rank: int) -> torch.Tensor:
    """Expert-parallel rank ``ep_rank``'s experts of a full expert tensor [E, ...] (other tensors unchanged)."""
    if not param.expert_parallel or ep == 1:
        return tensor
    if tensor.shape[0] % ep:
        raise ValueError(f"{param.name} holds {tensor.shape[0]} experts, not divisible by --expert-model-parallel-size "
                         f"{ep}; use a divisor of the expert count")
    return torch.chunk(tensor, ep, dim=0)[ep_rank]


def _stage_of_index(config: ModelConfig, pp: int) -> list[int]:
    """The pipeline stage of every pipeline item (by index) under ``DEFAULT_PARTITION``."""
    items = pipeline_items(config)
    names = ["TransformerLayer" if item.kind == TRANSFORMER else item.kind for item in items]
    bounds = stage_bounds(DEFAULT_PARTITION, names, pp)
    return [bisect.bisect_right(bounds, item.index) - 1 for item in items]


def write_expert_files(tag_dir: str, config: ModelConfig, layout: dict[str, ParameterLayout],
                       state_dict: dict[str, torch.Tensor], tp: int, pp: int, ep: int) -> list[str]:
    """Write every (EP, TP, PP) coordinate's ``EXPERT_FILE`` of a full state dict; returns the file names."""
    stage = _stage_of_index(config, pp)
    experts = [param for param in layout.values() if param.expert_parallel]
    written = []
    for ep_rank in range(ep):
        shards = {param.name: split_for_tp(param, ep_slice(param, state_dict[param.name], ep, ep_rank).contiguous(),
                                           tp) for param in experts}
        for tp_rank in range(tp):
            for pp_rank in range(pp):
                params = {pipeline_name(param): shards[param.name][tp_rank] for param in experts
                          if stage[param.pipeline_index] == pp_rank}
                name = EXPERT_FILE.format(ep=ep_rank, tp=tp_rank, pp=pp_rank)
                torch.save({"params": params}, os.path.join(tag_dir, name))
                written.append(name)
    return written


def read_expert_files(tag_dir: str, config: ModelConfig, layout: dict[str, ParameterLayout], tp: int,
                      ep: int) -> dict[str, torch.Tensor]:
    """{GPTModel name: every expert [E, ...], TP-merged} of an EP = ``ep`` checkpoint's expert files."""
    found: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (ep rank, tp rank) -> pipeline name -> shard
    for entry in sorted(os.listdir(tag_dir)):
        match = _EXPERT_FILE.match(entry)
        if match:
            ep_rank, tp_rank = int(match.group(1)), int(match.group(2))
            found.setdefault((ep_rank, tp_rank), {}).update(safe_load(os.path.join(tag_dir, entry))["params"])
    expected = {(e, t) for e in range(ep) for t in range(tp)}
    if set(found) != expected:
        raise CheckpointFormatError(f"{tag_dir!r} holds expert files of (EP, TP) ranks {sorted(found)}; a checkpoint "
                                    f"of --expert-model-parallel-size {ep} and TP {tp} has {sorted(expected)}")
    by_name = {(ep_rank, tp_rank): {model_name(key, config): tensor for key, tensor in params.items()}
               for (ep_rank, tp_rank), params in found.items()}
    out = {}
    for param in (p for p in layout.values() if p.expert_parallel):
        missing = [coord for coord in sorted(expected) if param.name not in by_name[coord]]
        if missing:
            raise CheckpointFormatError(f"{param.name} is missing from the expert files of (EP, TP) ranks {missing} "
                                        f"in {tag_dir!r}")
        out[param.name] = torch.cat([merge_tp_shards(param, [by_name[(e, t)][param.name] for t in range(tp)])
                                     for e in range(ep)], dim=0)  # [E, ...]
    return out


def expert_file_names(tag_dir: str) -> list[str]:
    """The expert files in ``tag_dir`` (none at EP = 1)."""
    return sorted(entry for entry in os.listdir(tag_dir) if _EXPERT_FILE.match(entry))
