"""The autograd all-to-all with uneven splits that expert parallelism exchanges tokens with.

    all_to_all(x, group, output_splits, input_splits)   forward: all-to-all   backward: all-to-all back

Rank i sends rows ``x[sum(input_splits[:j]) : ... + input_splits[j]]`` to rank j and receives
``output_splits[j]`` rows from rank j, in rank order. Its adjoint is the same exchange with the splits swapped.
gloo and NCCL both implement ``all_to_all_single`` with uneven splits. A group of ``None`` is one rank: the
identity.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron.parallel.state import group_size

__all__ = ["all_to_all", "all_to_all_counts"]


def _exchange(x: torch.Tensor, group, output_splits: Sequence[int], input_splits: Sequence[int]) -> torch.Tensor:
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all, backward: all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _exchange(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad_output):
        return _exchange(grad_output, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def all_to_all(x: torch.Tensor, group, output_splits: Sequence[int], input_splits: Sequence[int]) -> torch.Tensor:
    """x [n, ...] -> [sum(output_splits), ...]: rows exchanged over ``group`` (see the module docstring)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits))


def all_to_all_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [g, c] (what this rank sends each of the g ranks) -> [g, c] (what each rank sends this one)."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
