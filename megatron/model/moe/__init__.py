"""Mixture of experts: the MoE MLP that replaces the dense MLP in the layers ``ModelConfig.moe`` marks.

    router     top-k routing (softmax / sigmoid scores, group-limited, expert bias), the aux and z losses
    dispatch   tokens sorted by expert, capacity dropping, the all-to-all over the expert-parallel group
    experts    this rank's experts as one batched matmul, tensor-parallel along the expert width
    layer      MoELayer (the MLP), the aux-loss scale, the expert-bias update after an optimizer step
    stats      one iteration's load balance, aux / z losses and dropped fraction, for the logs

Imports torch, megatron.config and megatron.parallel only, like the rest of megatron.model.
"""

from megatron.model.moe.experts import GroupedExperts, is_expert_parallel
from megatron.model.moe.layer import MoELayer, moe_layers, set_aux_loss_scale, update_expert_biases
from megatron.model.moe.router import Routing, TopKRouter, route

__all__ = ["MoELayer", "GroupedExperts", "TopKRouter", "Routing", "route", "is_expert_parallel", "moe_layers",
           "set_aux_loss_scale", "update_expert_biases"]
