"""Keeping the parameters replicated across tensor-parallel ranks equal (--sync-tp-duplicated-parameters).

Replicated means not tagged ``tensor_model_parallel`` by the parallel layers (LayerNorms,
row-parallel biases, learned positions). ``megatron.model.layout`` describes every parameter's
split for the checkpoint converters; this module acts on live modules.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron.parallel.state import group_size

__all__ = ["tp_duplicated_parameters", "sync_tp_duplicated_parameters"]


def tp_duplicated_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter replicated across TP ranks, i.e. not tagged
    ``tensor_model_parallel`` by the parallel layers nor ``distinct_per_tp_rank`` (an MoE layer's experts with
    --expert-tensor-parallel-size 1: other experts on every TP rank). In ``named_parameters`` order."""
    return [(name, param) for name, param in module.named_parameters()
            if not getattr(param, "tensor_model_parallel", False) and not getattr(param, "distinct_per_tp_rank", False)]


def sync_tp_duplicated_parameters(module: nn.Module, tp_group) -> int:
    """Average every TP-replicated parameter of ``module`` across ``tp_group`` in place.

    Replicated parameters receive identical gradients, but non-deterministic kernels or bf16
    rounding can still let them drift apart; DeepSpeed's universal-checkpoint converter then
    refuses the checkpoint. (--sync-tp-duplicated-parameters.) Collective: every rank of the group
    must call it with the same module structure. One fp32 all-reduce for all of them. Returns the
    number of parameters averaged (0 and no communication when the group has one rank).
    """
    tp_size = group_size(tp_group)
    params = [param for _, param in tp_duplicated_parameters(module)]
    if tp_size == 1 or not params:
        return 0
    with torch.no_grad():
        flat = torch.cat([param.detach().float().reshape(-1) for param in params])  # [sum of numels]
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=tp_group)
        flat /= tp_size
        offset = 0
        for param in params:
            numel = param.numel()
            param.copy_(flat[offset:offset + numel].view_as(param))
            offset += numel
    return len(params)
