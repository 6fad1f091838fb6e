"""Expert parallelism on DeepSpeed's pipeline engine: the experts' gradients averaged, and their optimizer
state sharded, over the expert-data-parallel group only.

Every data-parallel rank holds the dense parameters, but an expert-parallel rank holds only its share of each
MoE layer's experts (``megatron.model.moe.experts``): averaging an expert's gradient over the whole
data-parallel group would mix different experts. DeepSpeed's engine already separates such parameters for its
own MoE: a parameter it counts as an MoE parameter is broadcast at start-up, summed (then divided by the
data-parallel size) and, under ZeRO-1 / BF16_Optimizer, partitioned over its expert-data-parallel group; its
grad norm is summed over its expert-parallel group; the optimizer wants such parameters in param groups with
``moe = True`` and ``name = group_name`` (``megatron.engine.optimizer.param_groups``). How DeepSpeed is told
(its private group registries, the parameter marks, the marker module that turns its MoE paths on) is in
``megatron.engine.deepspeed_compat`` (workaround ``expert_parallel``), checked against the pinned version.

Here we mark our expert parameters and register our groups under their name. The data-parallel size is the
right divisor: each expert saw the tokens of all dp ranks' micro-batches, through the all-to-all.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import nn

from megatron.config import ModelConfig
from megatron.engine.deepspeed_compat import (
    check_moe_engine,
    count_expert_grads_once,
    mark_moe_parameter,
    moe_marker,
    register_expert_groups,
)
from megatron.model.moe import is_expert_parallel
from megatron.parallel.state import ParallelState

__all__ = ["expert_group_name", "mark_expert_parameters", "check_expert_parallel_engine"]


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


def expert_group_name(state: ParallelState) -> Optional[str]:
    """The DeepSpeed group name our expert parameters carry (None with EP = 1: no expert parallelism)."""
    return None if state.ep_size == 1 else f"megatron_ep_size_{state.ep_size}"


def mark_expert_parameters(module: nn.Module, config: ModelConfig, state: ParallelState) -> Optional[str]:
    """Before the client optimizer and ``deepspeed.initialize``: mark this rank's expert parameters, register our
    expert-parallel and expert-data-parallel groups under their group name, and add DeepSpeed's MoE marker to
    ``module``. Returns the group name (None with EP = 1: nothing done). Collective when it builds one-rank
    groups."""
    name = expert_group_name(state)
    if name is None:
        return None
    register_expert_groups(name, state.ep_group, _expert_data_group(state), state.tp_size)
    for param in module.parameters():
        if is_expert_parallel(param):
            mark_moe_parameter(param, name)
    module.add_module("expert_parallel_marker", moe_marker(config.moe.num_experts, name))
    return name


def check_expert_parallel_engine(engine, name: Optional[str], state: ParallelState) -> None:
    """After ``deepspeed.initialize``: the engine saw the marker and holds our groups (RuntimeError if not); its
    grad norm counts each TP-duplicated expert parameter once."""
    if name is not None:
        check_moe_engine(engine, name)
        count_expert_grads_once(engine.optimizer, state.tp_rank)
