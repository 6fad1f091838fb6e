"""Tensor-parallel shards of one parameter: merged into the full tensor, and split again.

How a parameter is split is ``megatron.model.layout.ParameterLayout``'s: a replicated tensor is taken from
rank 0 after checking that every rank holds the same values, a split one is concatenated along its
partition dim. A leaf module: every checkpoint reader (the pipeline engine's layer files, DeepSpeed's ZeRO
files) and generation's TP loading use it, and it imports none of them.
"""

from __future__ import annotations

import torch

from megatron.checkpoint.tags import CheckpointFormatError
from megatron.model.layout import ParameterLayout

__all__ = ["merge_tp_shards", "split_for_tp"]


def merge_tp_shards(param: ParameterLayout, shards: list[torch.Tensor]) -> torch.Tensor:
    """One full tensor from its TP shards (rank order), as ``param``'s layout says."""
    if len(shards) == 1:
        return shards[0]
    if param.replicated:
        for rank, shard in enumerate(shards[1:], start=1):
            if shard.shape != shards[0].shape or not torch.equal(shard, shards[0]):
                diff = ((shard.float() - shards[0].float()).abs().max().item()
                        if shard.shape == shards[0].shape else f"shape {list(shard.shape)}")
                raise CheckpointFormatError(
                    f"{param.name} is replicated across tensor-parallel ranks but rank {rank} differs from rank 0 "
                    f"(max abs diff {diff}); train with --sync-tp-duplicated-parameters or average them first")
        return shards[0]
    return torch.cat(shards, dim=param.partition_dim)


def split_for_tp(param: ParameterLayout, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The inverse of :func:`merge_tp_shards`: ``tp`` shards of a full tensor (copies of replicated ones)."""
    if tp == 1 or param.replicated:
        return [tensor.clone() for _ in range(tp)]
    dim = param.partition_dim
    if tensor.shape[dim] % tp:
        raise ValueError(f"{param.name} has {tensor.shape[dim]} entries along dim {dim}, not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    return [chunk.clone() for chunk in torch.chunk(tensor, tp, dim=dim)]
