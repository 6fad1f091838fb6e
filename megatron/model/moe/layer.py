"""MoELayer: the mixture-of-experts MLP, a drop-in for the dense ParallelMLP ([s, b, h] -> [s, b, h]).

    routing = router(x)                                  top-k experts and weights per token (router.py)
    y = combine(experts(dispatch(x)))                    all-to-all over the EP group and back (dispatch.py:
                                                         alltoall_experts, its exchanges overlapped with the
                                                         experts' and the shared expert's computation when asked;
                                                         or all-gather and reduce-scatter: allgather_experts)
      + shared_expert(x)                                 an always-on dense MLP (--moe-shared-expert-...)

Sequence parallelism (TP with --sequence-parallel): each TP rank holds s/tp of the tokens. In a training run with
the alltoall dispatcher (``groups.routes_tp_shards``; Megatron-LM's order) each TP rank routes its own s/tp tokens,
exchanges them over EP, and the experts (split over TP along f) gather the TP ranks' rows and reduce-scatter their
partial outputs back (``GroupedExperts.forward_tp_shards``); the router weight enters through copy-to-TP and the
TP (x CP or Ulysses) ranks of the micro-batch are the token-sharding group, as with expert tensor parallelism 1
below. Otherwise (the allgather dispatcher, a layer built without a ParallelState) the layer gathers the tokens over
TP on entry (its backward keeps this rank's slice: every TP rank then runs the routed path on the same full tokens and
computes the same full gradient) and hands back this rank's slice. The shared expert, a ParallelMLP built for
sequence parallelism, works on the local slice either way. Context parallelism and Ulysses (``groups.tokens``, the
token-sharding group): each rank routes its own tokens; the aux (or sequence-wise aux) and z losses are this
rank's parts of the whole micro-batch's (``router.aux_loss``, ``router.seq_aux_loss``; the choices per expert, and
per sequence and expert, summed over the group) and the statistics count 1 / n of
a forward per rank. The expert capacity is per rank, on its own tokens (as in Megatron-LM).

Expert tensor parallelism 1 under TP with sequence parallelism (``--expert-tensor-parallel-size 1``,
``groups.experts_span_tp``; Megatron-LM's all-to-all order): nothing is gathered; each TP rank routes its own s/tp
tokens and exchanges them over the EP group (which then spans TP ranks) with whole (unsplit) experts. The router
weight is replicated over TP while its ranks see other tokens: it enters through copy-to-TP (backward: its gradient
summed over TP, ``Norm``'s sequence-parallel pattern, tagged ``sequence_parallel``), and the TP group is the
token-sharding group of the losses and statistics.

The balancing losses (aux, sequence-wise aux, z) are not returned: like Megatron-LM's MoEAuxLossAutoScaler, the layer hands them
to autograd through its output (``AuxLossScaler``), so they train the router on every pipeline stage without
travelling with the activations. Their gradient is ``aux_loss_scale`` (set it to 1 / the micro-batches per step
with ``set_aux_loss_scale``, which is how the language-model loss is scaled), so the optimized objective is
mean over micro-batches of (lm loss + aux + z). The last values are kept in ``last_aux_loss``; every training
forward adds its aux and z losses, dropped choices and per-expert load to ``stats`` (read by ``moe.stats``).

Shape letters: s sequence, b micro-batch, h hidden, T = s * b tokens.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.model.initialization import normal_init, output_layer_std
from megatron.model.moe.dispatch import allgather_experts, alltoall_experts, ep_rank_experts, kept_choices
from megatron.model.moe.experts import GroupedExperts
from megatron.model.moe.router import (
    TopKRouter,
    aux_loss,
    balance_choices,
    combine_dtype,
    new_expert_bias,
    seq_aux_loss,
    sequence_counts,
    tokens_per_expert,
    z_loss,
)
from megatron.parallel.mappings import gather_replicated_sequence_region, scatter_to_sequence_parallel_region
from megatron.parallel.random import tracked_checkpoint_func
from megatron.parallel.recompute import recompute_enabled
from megatron.parallel.state import LayerGroups, group_size

__all__ = ["MoELayer", "AuxLossScaler", "set_aux_loss_scale", "update_expert_biases", "moe_layers", "STATS_FIELDS"]

STATS_FIELDS = 5  # forwards, aux loss, z loss, dropped choices, choices; then the load of each expert


class AuxLossScaler(torch.autograd.Function):
    """forward: the output unchanged; backward: the output's gradient, and ``scale`` for the (scalar) loss."""

    @staticmethod
    def forward(ctx, output, loss, scale):
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


class MoELayer(nn.Module):
    """Routed experts (this rank's share: ``num_experts / ep`` of them), tensor-parallel over ``tp_group``.

    Args:
        config: the model configuration (``config.moe`` set).
        groups: ``LayerGroups`` (None: one rank on every axis): ``tp`` the tensor-parallel group (each expert's
            matrices split; with ``config.sequence_parallel`` the tokens too, gathered here), ``ep`` the
            expert-model-parallel group the tokens are exchanged over (None: every expert here), ``tokens`` the
            ranks holding other tokens of the same samples (context parallelism, Ulysses; the losses' parts).
        layer_number: 0-based layer index (the weights' names, hence their initial values, depend on it).
        shared_expert: an always-on MLP added to the experts' output (None: none).
    """

    def __init__(self, config: ModelConfig, groups: Optional[LayerGroups] = None, layer_number: int = 0,
                 shared_expert: Optional[nn.Module] = None):
        super().__init__()
        groups = groups if groups is not None else LayerGroups()
        tp_group, ep_group = groups.tp, groups.ep
        moe = config.moe
        if moe.num_experts % group_size(ep_group):
            raise ValueError(f"--num-experts {moe.num_experts} is not divisible by --expert-model-parallel-size "
                             f"{group_size(ep_group)}; use a divisor of the expert count")
        self.config, self.ep_group, self.tp_group, self.tokens_group = moe, ep_group, tp_group, groups.tokens
        self.experts_span_tp = groups.experts_span_tp and group_size(tp_group) > 1
        # each TP rank routes its own tokens to TP-split experts (Megatron-LM's order under sequence parallelism)
        self.routes_tp_shards = groups.routes_tp_shards and group_size(tp_group) > 1 and not self.experts_span_tp
        if (self.experts_span_tp or self.routes_tp_shards) and not config.sequence_parallel:
            raise ValueError("routing each TP rank's own tokens (--expert-tensor-parallel-size 1, or the all-to-all "
                             "order under sequence parallelism) needs --sequence-parallel: every TP rank must hold "
                             "other tokens")
        if self.routes_tp_shards and moe.token_dispatcher_type != "alltoall":
            raise ValueError("routing each TP rank's own tokens to TP-split experts is the alltoall dispatcher's "
                             "order; the allgather dispatcher gathers the tokens over TP on entry")
        # else gather the TP ranks' sequence-parallel tokens on entry (experts split over TP as the dense layers)
        self.sequence_parallel = (config.sequence_parallel and group_size(tp_group) > 1 and not self.experts_span_tp
                                  and not self.routes_tp_shards)
        prefix = f"layers.{layer_number}.mlp"
        std, seed, out_std = config.init_method_std, config.seed, output_layer_std(config)
        self.router = TopKRouter(moe, config.hidden_size, normal_init(std, seed, f"{prefix}.router.weight"),
                                 tp_group=tp_group if self.experts_span_tp or self.routes_tp_shards else None)
        self.experts = GroupedExperts(
            config.hidden_size, config.expert_ffn_size, ep_rank_experts(moe, ep_group), swiglu=config.swiglu,
            bias=config.add_bias_linear, tp_group=None if self.experts_span_tp else tp_group,
            w1_init=lambda e: normal_init(std, seed, f"{prefix}.experts.{e}.dense_h_to_4h.weight"),
            w2_init=lambda e: normal_init(out_std, seed, f"{prefix}.experts.{e}.dense_4h_to_h.weight"))
        if self.experts_span_tp:  # each TP rank holds other (whole) experts: not TP-duplicated (replicated.py), and
            for param in self.experts.parameters():  # DeepSpeed's grad norms count them on every model-parallel rank
                param.distinct_per_tp_rank = param.model_parallel = True
        self.shared_expert = shared_expert
        # --recompute-modules: moe (the whole layer; then nothing inside is recomputed on its own), shared_experts,
        # moe_act (the experts' activation, GroupedExperts.recompute_activation)
        parts = config.recompute_modules
        self.recompute_modules = ("moe",) if "moe" in parts else tuple(m for m in parts if m in ("shared_experts",
                                                                                                 "moe_act"))
        self.experts.recompute_activation = "moe_act" in self.recompute_modules
        self.replaying = False  # inside the backward's replay of a recomputed layer: count nothing
        self.layer_number = layer_number
        self.aux_loss_scale = 1.0
        self.last_aux_loss: Optional[torch.Tensor] = None
        # summed over the training forwards since ``take_stats``: [forwards, aux, z, dropped, choices, load[E]]
        self.stats = torch.zeros(STATS_FIELDS + moe.num_experts, dtype=torch.float64)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, h] -> [s, b, h] (sequence parallel: [s/tp, b, h] -> [s/tp, b, h], with
        ``experts_span_tp`` routed as they are).

        --recompute-modules moe: the whole layer runs in a checkpoint (only its input kept); the backward runs it
        again, exchanges included: the same routing (the router's random draws replayed from the saved generator
        state), the same all-to-all sizes on every EP rank, each at the same point of its backward. The replay
        counts nothing (statistics, the expert-bias counts)."""
        if "moe" in self.recompute_modules and recompute_enabled(self):
            forwards = []

            def run(x):
                self.replaying = self.router.replaying = bool(forwards)
                forwards.append(1)
                try:
                    return self._forward(x)
                finally:
                    self.replaying = self.router.replaying = False

            return tracked_checkpoint_func(None)(run, hidden)
        return self._forward(hidden)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = hidden
        if self.sequence_parallel:
            hidden = gather_replicated_sequence_region(hidden, self.tp_group)  # [s, b, h]
        s, b, h = hidden.shape
        tokens = hidden.reshape(s * b, h)  # [T, h]
        routing = self.router(tokens)
        shared = None
        if self.config.token_dispatcher_type == "allgather" and group_size(self.ep_group) > 1:
            output = allgather_experts(tokens, routing, self.config, self.experts, self.ep_group,
                                       combine_dtype(self.config)).view(s, b, h)
            kept = None
        else:
            meanwhile = None  # the shared expert, while the tokens travel (--moe-shared-expert-overlap)
            if self.shared_expert is not None and self.config.shared_expert_overlap:
                meanwhile = functools.partial(self.shared_expert, local)
            chunks = 2 if self.config.overlap_expert_parallel_comm and group_size(self.ep_group) > 1 else 1
            experts = self.experts.forward_tp_shards if self.routes_tp_shards else self.experts
            output, kept, shared = alltoall_experts(
                tokens, routing, self.config, experts, self.ep_group, combine_dtype(self.config), chunks=chunks,
                overlap=meanwhile is not None or chunks > 1, meanwhile=meanwhile)
            output = output.view(s, b, h)
        if self.sequence_parallel:
            output = scatter_to_sequence_parallel_region(output, self.tp_group)  # [s/tp, b, h]
        if self.shared_expert is not None and shared is None:
            if "shared_experts" in self.recompute_modules and recompute_enabled(self):
                shared = tracked_checkpoint_func(None)(self.shared_expert, local)  # [s, b, h]; no dropout inside
            else:
                shared = self.shared_expert(local)
        if self.shared_expert is not None:
            output = output + shared
        if not self.training:
            return output
        shards, num_experts = group_size(self.tokens_group), self.config.num_experts
        per_sequence = self.config.seq_aux_loss_coeff > 0
        counts = seq_counts = None
        if shards > 1:  # the choices of the whole micro-batch (every shard's), for f_e (and per sequence, f_je)
            counted = balance_choices(routing, self.config).detach()
            counts = tokens_per_expert(counted, num_experts)
            if per_sequence:
                counts = torch.cat([counts, sequence_counts(counted, num_experts, b).flatten()])
            torch.distributed.all_reduce(counts, group=self.tokens_group)
            counts, seq_counts = counts[:num_experts], counts[num_experts:].view(-1, num_experts)
        aux, z = aux_loss(routing, self.config, counts, shards), z_loss(routing, self.config, shards)
        if per_sequence:
            aux = aux + seq_aux_loss(routing, self.config, b, seq_counts, shards)
        if kept is None:
            kept = int(kept_choices(routing, self.config).sum())
        if not self.replaying:
            self._count(routing, kept, aux, z, 1.0 / shards)
        if self.config.aux_loss_coeff > 0 or self.config.seq_aux_loss_coeff > 0 or self.config.z_loss_coeff > 0:
            loss = aux + z
            if not self.replaying:
                self.last_aux_loss = loss.detach()
            output = AuxLossScaler.apply(output, loss, self.aux_loss_scale)
        return output

    @torch.no_grad()
    def _count(self, routing, kept: int, aux: torch.Tensor, z: torch.Tensor, forward: float) -> None:
        """``kept``: the choices the capacity kept; ``forward``: this rank's share of the micro-batch (1 / the
        token-sharding group's size)."""
        choices = routing.expert_index.numel()  # T * k
        load = torch.bincount(routing.expert_index.flatten(), minlength=self.config.num_experts)  # [E]
        self.stats[:STATS_FIELDS] += torch.tensor([forward, float(aux), float(z), choices - kept, choices],
                                                  dtype=torch.float64)
        self.stats[STATS_FIELDS:] += load.to(self.stats)

    def take_stats(self) -> torch.Tensor:
        """The statistics summed since the last call ([forwards, aux, z, dropped, choices, load[E]]), reset."""
        stats, self.stats = self.stats, torch.zeros_like(self.stats)
        return stats


def moe_layers(module: nn.Module) -> list[MoELayer]:
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """The gradient every MoE layer below ``module`` gives its balancing losses (1 / micro-batches per step)."""
    for layer in moe_layers(module):
        layer.aux_loss_scale = scale


@torch.no_grad()
def update_expert_biases(module: nn.Module, data_group=None) -> int:
    """After an optimizer step: every router's expert bias moved by its rate towards balance, from the choices
    counted since the last update, summed over ``data_group`` (every rank that saw other tokens with this stage's
    routers: data-parallel, expert-parallel and sequence (CP, Ulysses) ranks; TP ranks route the same tokens).
    Collective over the group when any router has a bias. Returns the number of routers updated."""
    routers = [m.router for m in moe_layers(module) if m.router.expert_bias is not None]
    if not routers:
        return 0
    counts = torch.stack([r.tokens_per_expert for r in routers])  # [routers, E]
    if group_size(data_group) > 1:
        torch.distributed.all_reduce(counts, group=data_group)
    for router, load in zip(routers, counts):
        router.expert_bias.copy_(new_expert_bias(router.expert_bias, load, router.config.router_bias_update_rate))
        router.tokens_per_expert.zero_()
    return len(routers)
