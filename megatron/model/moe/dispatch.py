"""Token dispatch and combine: the T * k (token, expert) choices sorted by expert, sent to the ranks holding
those experts (expert parallelism: an all-to-all over the EP group), and the experts' outputs brought back and
summed per token with the routing weights.

    dispatch:  tokens [T, h] -> per choice, sorted by expert [N, h] -> all-to-all -> this rank's experts'
               tokens, grouped by local expert [M, h] (+ counts per local expert), and their routing weights [M]
    experts:   y = act(x W1^T) * weight, then W2 (the weight applied in the activation, Megatron-LM's order)
    combine:   [M, h] -> all-to-all back -> [N, h] -> out[t] = sum over t's kept choices of y

With a capacity factor, each expert keeps at most C = ceil(T * k / E * factor) of its choices per micro-batch
(policy ``probs``: its C highest-weight ones; ``position``: the first C in token order, token-major then
choice); dropped choices add nothing (their weight is not redistributed), as in Megatron-LM.

The all-gather dispatcher (``--moe-token-dispatcher-type allgather``, Megatron-LM's MoEAllGatherTokenDispatcher,
``allgather_experts``) computes the same outputs another way: every rank of the EP group all-gathers the group's
tokens, weights and choices, runs its local experts on the gathered choices routed to them, sums each token's
weighted outputs from its local experts, and a reduce-scatter over the group adds the ranks' partial sums and hands
each rank its own tokens' rows (backward: the adjoints, reduce-scatter of the gathered gradients and all-gather).
The capacity is applied on each rank's own tokens before the gather, as in the all-to-all path.

Overlap (``alltoall_experts``; ``--overlap-moe-expert-parallel-comm``, ``--moe-shared-expert-overlap``): the
micro-batch's tokens in two parts, each part's exchanges started without waiting, so one part's rows travel while the
other's experts compute, and the shared expert runs while the dispatch travels. Megatron-LM's flag pairs two
micro-batches instead (its combined 1F1B schedule runs one's forward beside another's backward); splitting inside
the layer needs no schedule of its own, so it runs under every pipeline schedule here. The outputs are the same
sums; the experts' GEMMs run on two blocks of rows instead of one (their weight gradients sum in another order).

Memory: the rows move with ``unpermute`` and ``scatter_add``, whose backward keeps only the index (torch's
out-of-place ``index_copy`` and ``index_add`` keep a whole [rows, h] tensor each for backward: two more sets of the
k rows of every token per MoE layer). The routing weights travel with the rows and are applied inside the experts'
activation (``experts._WeightedActivation``, which keeps only its input), so their gradient needs no copy of the
returned rows: what the routing keeps for backward is the dispatched rows (the experts' first GEMM's input; FP8
under --fp8-format), as in Megatron-LM (megatron.planner.memory counts them; tests/model/test_recompute_modules.py
measures them).

Shape letters: T tokens, k choices per token, E experts (El = E / ep on this rank), h hidden, N choices this
rank sends (kept ones), M choices this rank's experts receive.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from megatron.config.moe import MoEConfig
from megatron.model.moe.router import Routing
from megatron.parallel.all_to_all import all_to_all, all_to_all_counts, start_all_to_all, wait_all_to_all
from megatron.parallel.mappings import gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region
from megatron.parallel.state import group_rank, group_size

__all__ = ["DispatchPlan", "expert_capacity", "kept_choices", "plan_dispatch", "local_expert_order", "dispatch", "combine",
           "alltoall_experts", "ep_rank_experts", "allgather_experts", "unpermute", "scatter_add"]


def expert_capacity(num_tokens: int, config: MoEConfig) -> Optional[int]:
    """C, the most choices one expert keeps per micro-batch (None: dropless)."""
    if config.expert_capacity_factor is None:
        return None
    return math.ceil(num_tokens * config.router_topk / config.num_experts * config.expert_capacity_factor)


def _rank_within_expert(expert: torch.Tensor, priority: torch.Tensor) -> torch.Tensor:
    """For each choice: how many choices of the same expert come before it by ``priority`` (lower first)."""
    by_priority = torch.argsort(priority, stable=True)
    order = by_priority[torch.argsort(expert[by_priority], stable=True)]  # by expert, then priority
    counts = torch.bincount(expert)
    starts = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device) - starts[expert[order]]
    return rank


def kept_choices(routing: Routing, config: MoEConfig) -> torch.Tensor:
    """[T * k] bool: which choices (token-major) the capacity keeps; all of them when dropless."""
    expert = routing.expert_index.flatten()
    capacity = expert_capacity(routing.expert_index.shape[0], config)
    if capacity is None:
        return torch.ones_like(expert, dtype=torch.bool)
    if config.token_drop_policy == "probs":
        priority = -routing.weight.detach().flatten()
    else:
        priority = torch.arange(expert.numel(), device=expert.device, dtype=torch.float32)
    return _rank_within_expert(expert, priority) < capacity


@dataclasses.dataclass
class DispatchPlan:
    """Where every kept choice goes and comes back from; built once per forward, read by dispatch and combine."""

    order: torch.Tensor           # [N]: flattened choice indices sorted by expert (kept ones)
    token: torch.Tensor           # [N]: the token of each sorted choice
    weight: torch.Tensor          # [N] fp32: its combine weight (differentiable: the router learns through it)
    send_splits: list[int]        # choices sent to each EP rank
    recv_splits: list[int]        # choices received from each EP rank
    local_order: torch.Tensor     # [M]: received rows regrouped by local expert (source rank order within)
    local_counts: torch.Tensor    # [El]: choices per local expert, in the regrouped order


def plan_dispatch(routing: Routing, config: MoEConfig, ep_group=None, chunk: Optional[tuple[int, int]] = None,
                  keep: Optional[torch.Tensor] = None) -> DispatchPlan:
    """The plan for ``routing`` on this rank of ``ep_group`` (None: one rank holding every expert). ``chunk``:
    (first, stop), the tokens this plan moves (None: all); ``keep``: ``kept_choices`` of the whole micro-batch,
    computed once for its chunks (the capacity is the micro-batch's; None: computed here)."""
    num_tokens, k = routing.expert_index.shape
    first, stop = chunk if chunk is not None else (0, num_tokens)
    ep = group_size(ep_group)
    local_experts = config.num_experts // ep
    keep = (kept_choices(routing, config) if keep is None else keep)[first * k:stop * k]
    expert = routing.expert_index.flatten()[first * k:stop * k]  # [T * k] (this chunk's choices)
    sort_key = torch.where(keep, expert, torch.full_like(expert, config.num_experts))  # dropped ones last
    order = torch.argsort(sort_key, stable=True)[:int(keep.sum())] + first * k  # [N]
    counts = torch.bincount(expert[keep], minlength=config.num_experts)  # [E]
    received = all_to_all_counts(counts.view(ep, local_experts), ep_group)  # [ep, El]: from each source rank
    return DispatchPlan(
        order=order, token=order // k, weight=routing.weight.flatten()[order],
        send_splits=counts.view(ep, local_experts).sum(1).tolist(), recv_splits=received.sum(1).tolist(),
        local_order=local_expert_order(received), local_counts=received.sum(0))


def local_expert_order(counts: torch.Tensor) -> torch.Tensor:
    """counts [g, El]: the rows each of g sources sends each local expert, arriving grouped by (source, local
    expert) -> [M], the order that groups them by local expert (the sources in order within)."""
    sources, local = counts.shape
    expert_of_row = torch.arange(local, device=counts.device).repeat(sources).repeat_interleave(counts.flatten())
    return torch.argsort(expert_of_row, stable=True)


def dispatch(tokens: torch.Tensor, plan: DispatchPlan, ep_group=None,
             dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [T, h] -> this rank's experts' inputs [M, h], grouped by local expert (``plan.local_counts``), and
    their routing weights [M] in ``dtype`` (None: the tokens')."""
    return _arrived(_dispatch_start(tokens, plan, ep_group, overlap=False, dtype=dtype), plan)


def combine(expert_output: torch.Tensor, plan: DispatchPlan, num_tokens: int, ep_group=None,
            dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The experts' weighted outputs [M, h] (``dispatch``'s order) -> [T, h]: each token's sum of its choices,
    computed in ``dtype`` (``--moe-router-dtype``; None: the outputs' own) and returned in the outputs' dtype."""
    back = _combine_start(expert_output, plan, ep_group, overlap=False)
    return _combined([back], [plan], num_tokens, dtype)


def alltoall_experts(tokens: torch.Tensor, routing: Routing, config: MoEConfig, experts, ep_group=None,
                     dtype: Optional[torch.dtype] = None, chunks: int = 1, overlap: bool = False,
                     meanwhile: Optional[Callable[[], torch.Tensor]] = None):
    """The all-to-all dispatcher: tokens [T, h] -> (each token's weighted sum of its kept choices' expert outputs
    [T, h], the number of kept choices, ``meanwhile()``'s result). ``experts(rows [M, h] grouped by local expert,
    counts [El], weights [M])`` runs this rank's experts, the routing weights applied (``GroupedExperts.forward``);
    ``dtype`` is the weights' and ``combine``'s.

    ``chunks``: the tokens split in this many contiguous parts, each dispatched, run through the experts and
    combined on its own (the capacity is still the micro-batch's; a token's choices stay in its part, so its sum
    adds the same terms in the same order). ``overlap``: every exchange started without waiting and waited for
    where its rows are needed, so part i + 1's dispatch and part i's combine travel while part i's experts
    compute, and ``meanwhile`` (the shared expert) runs while the dispatches travel; the backward overlaps the
    same way round (``start_all_to_all``). Without it the exchanges block and ``meanwhile`` runs first."""
    num_tokens = tokens.shape[0]
    keep = kept_choices(routing, config)
    bounds = [num_tokens * i // chunks for i in range(chunks + 1)]
    plans = [plan_dispatch(routing, config, ep_group, (first, stop), keep) for first, stop in zip(bounds, bounds[1:])]
    sent = [_dispatch_start(tokens, plan, ep_group, overlap, dtype) for plan in plans]
    side = meanwhile() if meanwhile is not None else None
    back = []
    for plan, exchanges in zip(plans, sent):
        rows, weight = _arrived(exchanges, plan)
        back.append(_combine_start(experts(rows, plan.local_counts, weight), plan, ep_group, overlap))
    return _combined(back, plans, num_tokens, dtype), int(keep.sum()), side


def unpermute(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The rows put back where ``rows.index_select(0, order)`` took them from: out[order[i]] = rows[i] (``order`` a
    permutation). An index_select by the inverse permutation: its backward keeps the index only."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return rows.index_select(0, inverse)


class _ScatterAdd(torch.autograd.Function):
    """base.index_add(0, index, rows), whose backward keeps the index only (torch's keeps ``rows``)."""

    @staticmethod
    def forward(ctx, base: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        return base.index_add(0, index, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad, None, grad.index_select(0, index)


def scatter_add(base: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """base [T, h] with rows [N, h] added at rows index [N] (each token's weighted choices summed)."""
    return _ScatterAdd.apply(base, index, rows)


def _dispatch_start(tokens: torch.Tensor, plan: DispatchPlan, ep_group, overlap: bool,
                    dtype: Optional[torch.dtype] = None):
    """tokens [T, h] -> the exchanges of this plan's rows and their routing weights (in ``dtype``; None: the
    tokens') to their experts' ranks (started, or done)."""
    sent = tokens.index_select(0, plan.token)  # [N, h], sorted by expert
    weight = plan.weight.to(tokens.dtype if dtype is None else dtype)[:, None]  # [N, 1]
    return tuple(_send(x, ep_group, plan.recv_splits, plan.send_splits, overlap) for x in (sent, weight))


def _arrived(exchanges, plan: DispatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatched rows [M, h] and their weights [M] once there, regrouped by local expert."""
    rows, weight = (wait_all_to_all(*exchange) for exchange in exchanges)  # by (source, local expert)
    return rows.index_select(0, plan.local_order), weight[:, 0].index_select(0, plan.local_order)


def _combine_start(expert_output: torch.Tensor, plan: DispatchPlan, ep_group, overlap: bool):
    """The experts' outputs [M, h] -> the exchange bringing them back to their tokens' ranks."""
    received = unpermute(expert_output, plan.local_order)  # by source
    return _send(received, ep_group, plan.send_splits, plan.recv_splits, overlap)


def _send(rows: torch.Tensor, ep_group, output_splits: list[int], input_splits: list[int], overlap: bool):
    """The exchange of ``rows`` over ``ep_group`` as (rows, in flight): started (``overlap``), or done (None)."""
    if overlap:
        return start_all_to_all(rows, ep_group, output_splits, input_splits)
    return all_to_all(rows, ep_group, output_splits, input_splits), None


def _combined(exchanges, plans: list[DispatchPlan], num_tokens: int, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The returned (weighted) rows of every part ([N, h] each, sorted by expert) -> [T, h], each token's sum, in
    ``dtype`` (None: the rows')."""
    summed = None
    for exchange, plan in zip(exchanges, plans):
        back = wait_all_to_all(*exchange)
        rows = back.to(back.dtype if dtype is None else dtype)  # [N, h]
        if summed is None:
            summed = rows.new_zeros(num_tokens, back.shape[-1])
        summed = scatter_add(summed, plan.token, rows)  # [T, h]
    return summed.to(back.dtype)


def ep_rank_experts(config: MoEConfig, ep_group=None) -> range:
    """The global indices of the experts this rank of ``ep_group`` holds (a contiguous block)."""
    local = config.num_experts // group_size(ep_group)
    start = group_rank(ep_group) * local
    return range(start, start + local)


def allgather_experts(tokens: torch.Tensor, routing: Routing, config: MoEConfig, experts, ep_group,
                      dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The all-gather dispatcher (module docstring): tokens [T, h] -> [T, h], each token's weighted sum of its kept
    choices' expert outputs. ``experts(rows [M, h] grouped by local expert, counts [El], weights [M])`` runs this rank's experts;
    every rank of ``ep_group`` holds the same number of tokens T. ``dtype``: that of the weighted sum of this
    rank's experts' outputs (``combine``'s)."""
    num_tokens, k = routing.expert_index.shape
    local = ep_rank_experts(config, ep_group)
    keep = kept_choices(routing, config).view(num_tokens, k)
    chosen = torch.where(keep, routing.expert_index, torch.full_like(routing.expert_index, -1))  # dropped: -1
    all_tokens = gather_from_sequence_parallel_region(tokens, ep_group)  # [ep T, h]; backward: reduce-scatter
    all_weight = gather_from_sequence_parallel_region(routing.weight, ep_group).flatten()  # [ep T k]
    all_expert = gather_from_sequence_parallel_region(chosen, ep_group).flatten()  # [ep T k]
    mine = (all_expert >= local.start) & (all_expert < local.stop)
    sort_key = torch.where(mine, all_expert, torch.full_like(all_expert, config.num_experts))  # others last
    order = torch.argsort(sort_key, stable=True)[:int(mine.sum())]  # [M]: this rank's choices by expert
    token = order // k
    counts = torch.bincount(all_expert[order] - local.start, minlength=len(local))  # [El]
    weight = all_weight[order].to(tokens.dtype if dtype is None else dtype)  # [M]
    out = experts(all_tokens.index_select(0, token), counts, weight)  # [M, h], weighted
    rows = out.to(out.dtype if dtype is None else dtype)
    partial = scatter_add(rows.new_zeros(all_tokens.shape), token, rows).to(out.dtype)  # [ep T, h]: ours
    return reduce_scatter_to_sequence_parallel_region(partial, ep_group)  # [T, h]: summed over the group
