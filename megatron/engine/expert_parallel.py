"""Expert parallelism on DeepSpeed's pipeline engine: the experts' gradients averaged, and their optimizer
state sharded, over the expert-data-parallel group only.

Every data-parallel rank holds the dense parameters, but an expert-parallel rank holds only its share of each
MoE layer's experts (``megatron.model.moe.experts``): averaging an expert's gradient over the whole
data-parallel group would mix different experts. DeepSpeed's engine already separates such parameters for its
own MoE: a parameter marked ``allreduce = False`` with a ``group_name`` is broadcast at start-up, summed (then
divided by the data-parallel size) and, under ZeRO-1 / BF16_Optimizer, partitioned over
``deepspeed.utils.groups._get_expert_data_parallel_group(group_name)``; its grad norm is summed over
``_get_expert_parallel_group(group_name)``; the optimizer wants such parameters in param groups with
``moe = True`` and ``name = group_name`` (``megatron.engine.optimizer.param_groups``). The engine turns all this
on (``has_moe_layers``) when it finds an instance of its ``deepspeed.moe.layer.MoE`` among the modules, before
it builds the optimizer: ``ExpertParallelMarker`` is such an instance, parameter-free, never called.

Here we mark our expert parameters and register our groups under their name. The data-parallel size is the
right divisor: each expert saw the tokens of all dp ranks' micro-batches, through the all-to-all.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.utils import groups
from torch import nn

from megatron.config import ModelConfig
from megatron.model.moe import is_expert_parallel
from megatron.parallel.state import ParallelState

__all__ = ["ExpertParallelMarker", "expert_group_name", "mark_expert_parameters", "check_expert_parallel_engine"]


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


class ExpertParallelMarker(DeepSpeedMoE):
    """Tells DeepSpeed's engine that the model has expert-parallel layers (see the module docstring). Holds nothing
    and is never called: ``deepspeed.moe.layer.MoE.__init__`` (which would build DeepSpeed's own experts and
    groups) is skipped."""

    def __init__(self, num_experts: int, group_name: str):
        nn.Module.__init__(self)
        self.num_experts, self.expert_group_name = num_experts, group_name

    def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
        """The engine asks each MoE to create its groups: ours are made (``mark_expert_parameters``)."""

    def forward(self, *inputs):
        raise AssertionError("ExpertParallelMarker is a marker for DeepSpeed's engine, not a layer")


def expert_group_name(state: ParallelState) -> Optional[str]:
    """The DeepSpeed group name our expert parameters carry (None with EP = 1: no expert parallelism)."""
    return None if state.ep_size == 1 else f"megatron_ep_size_{state.ep_size}"


def mark_expert_parameters(module: nn.Module, config: ModelConfig, state: ParallelState) -> Optional[str]:
    """Before the client optimizer and ``deepspeed.initialize``: mark this rank's expert parameters, register our
    expert-parallel and expert-data-parallel groups under their group name, and add the marker to ``module``.
    Returns the group name (None with EP = 1: nothing done). Collective when it builds one-rank groups."""
    name = expert_group_name(state)
    if name is None:
        return None
    groups._EXPERT_PARALLEL_GROUP[name] = state.ep_group
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = _expert_data_group(state)
    for param in module.parameters():
        if is_expert_parallel(param):
            param.allreduce = False  # deepspeed.moe.utils.is_moe_param
            param.group_name = name
    module.add_module("expert_parallel_marker", ExpertParallelMarker(config.moe.num_experts, name))
    return name


def check_expert_parallel_engine(engine, name: Optional[str]) -> None:
    """After ``deepspeed.initialize``: the engine saw the marker and holds our groups."""
    if name is not None:
        assert engine.has_moe_layers and engine.expert_data_parallel_group[name] is \
            groups._EXPERT_DATA_PARALLEL_GROUP[name], "DeepSpeed's engine did not take up the expert-parallel groups"
