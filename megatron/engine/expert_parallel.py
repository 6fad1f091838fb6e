"""Expert parallelism on DeepSpeed's pipeline engine (ZeRO-0/1, BF16_Optimizer) and on its model engine
(ZeRO-2, ``megatron.engine.model_engine``): the experts' gradients averaged, and their optimizer state sharded, over
the expert-data-parallel group only.

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

Checkpoints: DeepSpeed's regular files (layer files, ZeRO shards) are written as without MoE, the layer files by
data-parallel rank 0 only, so they hold EP rank 0's experts. Each EP rank's experts (and, without ZeRO, their
optimizer state, which DeepSpeed also keeps from data-parallel rank 0 only) go to ``EXPERT_FILE`` beside them,
one per (EP, expert-TP, PP) coordinate (the same on every sequence rank; its "tp" is the expert-tensor-parallel
rank, the TP rank unless --expert-tensor-parallel-size is below TP), written by expert-data-parallel rank 0, and
are loaded back after DeepSpeed's load
(``attach_expert_checkpoints``). Under ZeRO-1 / BF16_Optimizer the optimizer shards are per data-parallel rank, experts included.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.checkpoint.expert_files import EXPERT_FILE
from megatron.config import ModelConfig
from megatron.engine.deepspeed_compat import (
    check_moe_engine,
    count_expert_grads_once,
    mark_moe_parameter,
    moe_marker,
    plain_checkpoint_files,
    register_expert_groups,
)
from megatron.model.moe import is_expert_parallel
from megatron.parallel.state import ParallelState

__all__ = ["expert_group_name", "mark_expert_parameters", "check_expert_parallel_engine", "EXPERT_FILE",
           "attach_expert_checkpoints"]



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
    register_expert_groups(name, state.ep_group, _expert_data_group(state), state.etp_size)
    for param in module.parameters():
        if is_expert_parallel(param):
            mark_moe_parameter(param, name)
    module.add_module("expert_parallel_marker", moe_marker(config.moe.num_experts, name))
    return name


def check_expert_parallel_engine(engine, name: Optional[str], state: ParallelState) -> None:
    """After ``deepspeed.initialize``: the engine saw the marker and holds our groups (RuntimeError if not); its
    grad norm counts each TP-duplicated expert parameter once; its checkpoints hold every EP rank's experts."""
    if name is not None:
        check_moe_engine(engine, name)
        count_expert_grads_once(engine.optimizer, state.etp_rank)
        attach_expert_checkpoints(engine, state)


def _expert_file(tag_dir: str, state: ParallelState) -> str:
    return os.path.join(tag_dir, EXPERT_FILE.format(ep=state.ep_rank, tp=state.etp_rank, pp=state.pp_rank))


def _experts(engine) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in engine.module.named_parameters() if is_expert_parallel(p)]


def _optimizer_state(engine):
    """The torch optimizer's per-parameter state where DeepSpeed keeps it whole (no ZeRO), else None."""
    if engine.zero_optimization():
        return None
    return getattr(engine.optimizer, "optimizer", engine.optimizer).state


def save_expert_states(engine, tag_dir: str, state: ParallelState) -> None:
    """Write this rank's experts (and without ZeRO their optimizer state) to its ``EXPERT_FILE``: one writer per
    expert-data-parallel group (its rank 0: the first data-parallel replica of this EP rank, sequence rank 0; the
    other CP / Ulysses ranks hold the same experts)."""
    if state.edp_rank or state.seq_rank:
        return
    experts = _experts(engine)
    record = {"params": {name: p.detach().clone() for name, p in experts}}
    optimizer_state = _optimizer_state(engine)
    if optimizer_state is not None:
        record["optimizer"] = {name: optimizer_state[p] for name, p in experts if p in optimizer_state}
    torch.save(record, _expert_file(tag_dir, state))


@torch.no_grad()
def load_expert_states(engine, tag_dir: str, state: ParallelState, load_optimizer_states: bool) -> None:
    """Overwrite this rank's experts (which DeepSpeed loaded from EP rank 0's layer files) from its
    ``EXPERT_FILE``; their optimizer state too where DeepSpeed keeps it whole."""
    record = torch.load(_expert_file(tag_dir, state), map_location="cpu", weights_only=True)
    optimizer_state = _optimizer_state(engine) if load_optimizer_states else None
    for name, param in _experts(engine):
        param.copy_(record["params"][name])
        if optimizer_state is not None and name in record.get("optimizer", {}):
            optimizer_state[param] = record["optimizer"][name]


def attach_expert_checkpoints(engine, state: ParallelState) -> None:
    """Make ``engine.save_checkpoint`` / ``load_checkpoint`` write and read DeepSpeed's regular files plus our
    expert files (see the module docstring); called for EP > 1 only."""
    save, load = engine.save_checkpoint, engine.load_checkpoint
    deepspeed_engine = getattr(engine, "engine", engine)  # ZeRO-2: the DeepSpeedEngine inside a ModelEngine

    def save_checkpoint(save_dir, tag=None, **kwargs):
        with plain_checkpoint_files(deepspeed_engine):
            written = save(save_dir, tag=tag, **kwargs)
        save_expert_states(engine, os.path.join(save_dir, str(tag)), state)
        return written

    def load_checkpoint(load_dir, tag=None, load_optimizer_states=True, **kwargs):
        with plain_checkpoint_files(deepspeed_engine):
            path, client_state = load(load_dir, tag=tag, load_optimizer_states=load_optimizer_states, **kwargs)
        if path is not None and not deepspeed_engine.load_universal_checkpoint():  # universal: experts in zero/
            load_expert_states(engine, os.path.join(load_dir, str(tag)), state, load_optimizer_states)
        return path, client_state

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint
