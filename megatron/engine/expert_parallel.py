"""Expert parallelism on DeepSpeed's pipeline engine: the experts' gradients averaged over the
expert-data-parallel group only.

Every data-parallel rank holds the dense parameters, but an expert-parallel rank holds only its share of each
MoE layer's experts (``megatron.model.moe.experts``): averaging an expert's gradient over the whole
data-parallel group would mix different experts. DeepSpeed's engine (the pinned version's ``buffered_allreduce_fallback``,
what its pipeline engine runs at ZeRO-0) already separates such parameters: one marked ``allreduce = False``
with a ``group_name`` is summed over ``deepspeed.utils.groups._get_expert_data_parallel_group(group_name)`` and
divided by the data-parallel size, once ``engine.has_moe_layers`` is set; DeepSpeed sets that only for its own
MoE modules, so here we mark our expert parameters and register our expert-data-parallel group under that name.
The data-parallel size is the right divisor: each expert saw the tokens of all dp ranks' micro-batches, through
the all-to-all. ZeRO-1 and BF16_Optimizer keep their own MoE bookkeeping and are refused with EP > 1 for now
(``megatron.config.moe.check_moe_run``).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from deepspeed.utils import groups

from megatron.model.moe import is_expert_parallel
from megatron.parallel.state import ParallelState

__all__ = ["mark_expert_parameters", "reduce_experts_over_their_group"]


def _expert_data_group(state: ParallelState):
    """Our expert-data-parallel group; a real one-rank group where it has one rank (DeepSpeed would read None as
    WORLD). Collective over the world when it builds those."""
    if state.expert_dp_group is not None:
        return state.expert_dp_group
    mine = None
    for rank in range(dist.get_world_size()):
        group = dist.new_group([rank])
        if rank == dist.get_rank():
            mine = group
    return mine


def mark_expert_parameters(module, state: ParallelState) -> Optional[str]:
    """Before ``deepspeed.initialize``: mark this rank's expert parameters and register our expert-data-parallel
    group under their group name, so that the engine's initial broadcast copies each expert only from a rank
    holding the same one (and the reduction finds the group). Returns the group name (None with EP = 1: nothing
    to do). Collective when it builds one-rank groups."""
    if state.ep_size == 1:
        return None
    name = f"megatron_ep_size_{state.ep_size}"
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = _expert_data_group(state)
    for param in module.parameters():
        if is_expert_parallel(param):
            param.allreduce = False  # deepspeed.moe.utils.is_moe_param
            param.group_name = name
    return name


def reduce_experts_over_their_group(engine, name: Optional[str]) -> None:
    """After ``deepspeed.initialize``: turn on the engine's separate reduction of the marked parameters."""
    if name is not None:
        engine.has_moe_layers = True
        assert engine.expert_data_parallel_group[name] is groups._EXPERT_DATA_PARALLEL_GROUP[name]
