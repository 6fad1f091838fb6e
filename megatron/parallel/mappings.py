"""Autograd-aware collectives over the tensor-parallel (TP) group.

Each public function is a ``torch.autograd.Function`` whose backward is the adjoint of its forward:

    copy_to_tensor_model_parallel_region           forward: identity       backward: all-reduce
    reduce_from_tensor_model_parallel_region       forward: all-reduce     backward: identity
    scatter_to_tensor_model_parallel_region        forward: split last     backward: all-gather last
    gather_from_tensor_model_parallel_region       forward: all-gather last backward: split last
    scatter_to_sequence_parallel_region            forward: split first    backward: all-gather first
    gather_from_sequence_parallel_region           forward: all-gather first backward: reduce-scatter first
    gather_replicated_sequence_region              forward: all-gather first backward: split first
    reduce_scatter_to_sequence_parallel_region     forward: reduce-scatter first backward: all-gather first

The group is always passed explicitly. A group of ``None`` (or of one rank) makes every function the
identity, never a collective over WORLD. Nothing here modifies its input in place: all-reduces run
on a private contiguous copy, because the caller's tensor (or a gradient that autograd hands to two
consumers, as ``a + b`` does) may still be needed elsewhere.

Shape letters: s sequence, b micro-batch, h hidden; ``tp`` the TP group size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.parallel.state import group_rank, group_size

__all__ = [
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "gather_replicated_sequence_region",
]


# ---- raw collectives (no autograd) ---------------------------------------------------------------
def _all_gather_single(output: torch.Tensor, input_: torch.Tensor, group) -> None:
    # torch >= 2.13 names it all_gather_single; older releases only have all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input_, group=group)


def _reduce_scatter_single(output: torch.Tensor, input_: torch.Tensor, group) -> None:
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(output, input_, group=group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over the group, in a new contiguous tensor (``x`` itself is left alone)."""
    if group_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the last dimension: [..., h] -> [..., h/tp]."""
    world = group_size(group)
    if world == 1:
        return x
    if x.size(-1) % world != 0:
        raise ValueError(f"cannot split the last dimension {x.size(-1)} (shape {tuple(x.shape)}) "
                         f"across {world} tensor-parallel ranks; it must be a multiple of {world}")
    chunk = x.size(-1) // world
    return x.narrow(-1, group_rank(group) * chunk, chunk).contiguous()  # [..., h/tp]


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension: [..., h/tp] -> [..., h]."""
    world = group_size(group)
    if world == 1:
        return x
    # Gather along dim 0 (the only layout every backend accepts: one contiguous block per rank),
    # then move the rank axis next to the last dimension.
    gathered = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x.contiguous(), group)  # [tp*s, ..., h/tp]
    stacked = gathered.view((world,) + tuple(x.shape))  # [tp, s, ..., h/tp]
    return torch.cat(stacked.unbind(0), dim=-1)  # [s, ..., h]


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the first dimension: [s, b, h] -> [s/tp, b, h]."""
    world = group_size(group)
    if world == 1:
        return x
    if x.size(0) % world != 0:
        raise ValueError(f"cannot split the first (sequence) dimension {x.size(0)} (shape "
                         f"{tuple(x.shape)}) across {world} tensor-parallel ranks; use a sequence "
                         f"length that is a multiple of {world}")
    chunk = x.size(0) // world
    return x.narrow(0, group_rank(group) * chunk, chunk).contiguous()  # [s/tp, b, h]


def _gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's x along the first dimension: [s/tp, b, h] -> [s, b, h]."""
    world = group_size(group)
    if world == 1:
        return x
    out = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group)  # [s, b, h]
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks, keeping this rank's slice of the first dimension: [s, b, h] -> [s/tp, b, h]."""
    world = group_size(group)
    if world == 1:
        return x
    if x.size(0) % world != 0:
        raise ValueError(f"cannot reduce-scatter the first (sequence) dimension {x.size(0)} across "
                         f"{world} tensor-parallel ranks; use a sequence length that is a multiple "
                         f"of {world}")
    out = torch.empty((x.size(0) // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.contiguous(), group)  # [s/tp, b, h]
    return out


# ---- autograd functions --------------------------------------------------------------------------
class _CopyToTensorModelParallelRegion(torch.autograd.Function):
    """forward: identity, backward: all-reduce over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_reduce(grad_output, ctx.group), None


class _ReduceFromTensorModelParallelRegion(torch.autograd.Function):
    """forward: all-reduce over the TP group, backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToTensorModelParallelRegion(torch.autograd.Function):
    """forward: split the last dim (keep this rank's chunk), backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_last_dim(grad_output, ctx.group), None


class _GatherFromTensorModelParallelRegion(torch.autograd.Function):
    """forward: all-gather the last dim, backward: split the last dim (keep this rank's chunk)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """forward: split the first dim (keep this rank's chunk), backward: all-gather the first dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """forward: all-gather the first dim, backward: reduce-scatter the first dim.

    The backward sums because the gathered activation feeds a column-parallel matmul on every rank:
    each rank holds a partial gradient of the full sequence.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_first_dim(grad_output, ctx.group), None


class _GatherReplicatedSequenceRegion(torch.autograd.Function):
    """forward: all-gather the first dim, backward: split the first dim (keep this rank's chunk).

    For a gathered activation that every rank then processes whole and identically (replicated weights, or a
    tensor-parallel block whose input gradient is already all-reduced): each rank's gradient of the full sequence
    is already the whole one, so summing them (a reduce-scatter) would count it tp times.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_first_dim(grad_output, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """forward: reduce-scatter the first dim, backward: all-gather the first dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_first_dim(grad_output, ctx.group), None


# ---- public API ------------------------------------------------------------------------------------
def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: identity, backward: all-reduce over the TP group (input of a column-parallel layer)."""
    if group_size(group) == 1:
        return x
    return _CopyToTensorModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: all-reduce over the TP group, backward: identity (output of a row-parallel layer)."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTensorModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: [..., h] -> this rank's [..., h/tp], backward: all-gather along the last dim."""
    if group_size(group) == 1:
        return x
    return _ScatterToTensorModelParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: all-gather [..., h/tp] -> [..., h], backward: keep this rank's slice of the last dim."""
    if group_size(group) == 1:
        return x
    return _GatherFromTensorModelParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: [s, b, h] -> this rank's [s/tp, b, h], backward: all-gather along the first dim."""
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: all-gather [s/tp, b, h] -> [s, b, h], backward: reduce-scatter along the first dim."""
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: reduce-scatter [s, b, h] -> [s/tp, b, h], backward: all-gather along the first dim."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def gather_replicated_sequence_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: all-gather [s/tp, b, h] -> [s, b, h], backward: keep this rank's slice of the first dim (every rank
    computes the same full gradient after it: the MoE layer under sequence parallelism)."""
    if group_size(group) == 1:
        return x
    return _GatherReplicatedSequenceRegion.apply(x, group)
