"""The top-k router: which experts each token goes to, with what weight, and the losses that balance them.

For T tokens and E experts, in fp32 whatever the parameters' dtype (a softmax over experts is as sensitive as
the one over the vocabulary; fp64 with ``--moe-router-dtype fp64``):

    logits = x @ W_r^T                                   [T, E]
    scores = softmax(logits) | sigmoid(logits)           [T, E]
    chosen = top-k of (scores + bias), optionally only among the group_topk best groups (a group's
             score: the sum of its k / group_topk best scores; DeepSeek-V3)
    weights = scores[chosen], divided by their sum (softmax unless pre_softmax; sigmoid when k > 1),
              times the scaling factor
    aux     = coeff * E * sum_e f_e * P_e                (Switch Transformer eq. 4-6; f_e the fraction of the
              T * k top-k-by-score choices that went to expert e (without the bias and group limit, which
              only steer: DeepSeek-V3 eq. 19, Megatron-LM), P_e the mean of its (sum-normalised) score)
    seq aux = coeff * E * mean_j sum_e f_je * P_je       (DeepSeek-V2 eq. 12-14, --moe-router-load-balancing-type
              seq_aux_loss: f and P as above, over the tokens of sequence j only, averaged over the b sequences)
    z       = coeff * mean_t logsumexp(logits_t)^2        (ST-MoE eq. 5)

With the micro-batch's tokens split over n ranks (context parallelism, Ulysses), each rank computes its part of
all three: f_e (f_je) from the choices counted over the n ranks, P_e and the z mean over its own tokens divided by n, so the
parts sum to the losses of the whole micro-batch, and so do their gradients.

``--moe-router-force-load-balancing`` (Megatron-LM's benchmark knob, its RandomSTE): the logits are replaced by
standard normal draws, so the choices are balanced in expectation whatever the tokens, and the gradient passes
straight through to the router's logits (``RandomLogits``). The draws come from the default generator, which every
rank of a TP group seeds alike and advances alike: TP ranks routing the same tokens (without sequence parallelism)
route them alike, and activation recomputation (torch's checkpoint restores the generator) replays them.

The bias (aux-loss-free balancing, DeepSeek-V3) only steers the choice, never the weights; it is not a
parameter: after each optimizer step it moves by ``rate * sign(mean load - load)`` (``update_expert_bias``).

Shape letters: T tokens of the micro-batch (s * b), E experts, k experts per token, h hidden.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config.moe import MoEConfig
from megatron.parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.parallel.weight_grad_store import defer_weight_grad, linear

__all__ = ["Routing", "TopKRouter", "RandomLogits", "route", "balance_choices", "aux_loss", "seq_aux_loss",
           "sequence_counts", "z_loss", "new_expert_bias", "router_dtype", "combine_dtype"]


class _RouterGatingLinear(torch.autograd.Function):
    """logits = x W^T computed in ``dtype`` (the router's), keeping x in its own dtype for backward and casting it
    again there (as Megatron-LM's RouterGatingLinearFunction): in a bf16 run the router's fp32 copy of its input (4
    bytes per element, beside the input the shared expert keeps anyway) is not kept. The products are those of
    ``linear(x.to(dtype), W)``. With a ZB-H1 ``store``, the weight gradient is deferred to it."""

    @staticmethod
    def forward(ctx, x, weight, dtype, store):
        ctx.save_for_backward(x)
        ctx.weight, ctx.dtype, ctx.store = weight, dtype, store  # the parameter itself (_LinearDeferredWeightGrad)
        return F.linear(x.to(dtype), weight.to(dtype))

    @staticmethod
    def backward(ctx, grad_output):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight.to(grad_output.dtype)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            if ctx.store is not None:
                defer_weight_grad(ctx.store, weight, x.to(ctx.dtype), grad_output)
            else:
                grad_weight = grad_output.t().matmul(x.to(ctx.dtype)).to(weight.dtype)  # [E, h]
        return grad_input, grad_weight, None, None


def router_dtype(config: MoEConfig) -> torch.dtype:
    """The dtype the router computes in: fp64 with ``--moe-router-dtype fp64``, else fp32."""
    return torch.float64 if config.router_dtype == "fp64" else torch.float32


def combine_dtype(config: MoEConfig) -> torch.dtype | None:
    """The dtype of the combine's weighted sum: ``--moe-router-dtype``'s (None: the activations')."""
    return None if config.router_dtype is None else router_dtype(config)


@dataclasses.dataclass
class Routing:
    """What the router decided for T tokens (k choices each)."""

    expert_index: torch.Tensor   # [T, k] int64: the experts chosen, best first
    weight: torch.Tensor         # [T, k] fp32: their combine weights
    scores: torch.Tensor         # [T, E] fp32: every expert's score (the aux loss reads them)
    logits: torch.Tensor         # [T, E] fp32


def _group_limited(routing_scores: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """routing_scores [T, E] with the experts outside each token's ``group_topk`` best groups set to -inf."""
    groups, group_topk = config.router_num_groups, config.router_group_topk
    per_group = routing_scores.unflatten(-1, (groups, -1))  # [T, G, E/G]
    group_score = per_group.topk(config.router_topk // group_topk, dim=-1).values.sum(-1)  # [T, G]
    best = group_score.topk(group_topk, dim=-1).indices  # [T, group_topk]
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
    return per_group.masked_fill(~keep[..., None], float("-inf")).flatten(-2)  # [T, E]


class RandomLogits(torch.autograd.Function):
    """--moe-router-force-load-balancing: standard normal logits of the same shape (the default generator), the
    gradient handed to the original logits unchanged (a straight-through estimator, Megatron-LM's RandomSTE)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def route(logits: torch.Tensor, config: MoEConfig, expert_bias: torch.Tensor | None = None) -> Routing:
    """The routing of logits [T, E] (any dtype; computed in fp32, or fp64 with ``--moe-router-dtype fp64``)."""
    logits = logits.to(router_dtype(config))
    scores = torch.softmax(logits, -1) if config.router_score_function == "softmax" else torch.sigmoid(logits)
    routing_scores = scores if expert_bias is None else scores + expert_bias
    if config.router_num_groups is not None:
        routing_scores = _group_limited(routing_scores, config)
    expert_index = routing_scores.topk(config.router_topk, dim=-1).indices  # [T, k]
    weight = scores.gather(1, expert_index)  # [T, k]
    softmax = config.router_score_function == "softmax"
    if (softmax and not config.router_pre_softmax) or (not softmax and config.router_topk > 1):
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
    if config.router_topk_scaling_factor is not None:
        weight = weight * config.router_topk_scaling_factor
    return Routing(expert_index, weight, scores, logits)


def balance_choices(routing: Routing, config: MoEConfig) -> torch.Tensor:
    """[T, k]: the choices the balancing losses count (f_e), the top-k of the scores alone, as DeepSeek-V3 (eq. 19)
    and Megatron-LM count them: the expert bias and the group limit steer the routing, not the balance measured.
    Without either they are the routed choices themselves."""
    if not config.router_enable_expert_bias and config.router_num_groups is None:
        return routing.expert_index
    return routing.scores.topk(config.router_topk, dim=-1).indices


def tokens_per_expert(expert_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the T * k choices went to each expert: [T, k] -> [E] int64."""
    return torch.bincount(expert_index.flatten(), minlength=num_experts)


def _balance_scores(routing: Routing, config: MoEConfig) -> torch.Tensor:
    """[T, E]: the scores P_e averages (sigmoid scores, which do not sum to 1, normalised per token)."""
    if config.router_score_function == "sigmoid":
        return routing.scores / (routing.scores.sum(-1, keepdim=True) + 1e-20)
    return routing.scores


def aux_loss(routing: Routing, config: MoEConfig, counts: torch.Tensor | None = None, shards: int = 1) -> torch.Tensor:
    """The load-balancing loss (a scalar, 0 when its coefficient is).

    With the micro-batch's tokens split over ``shards`` ranks of equal shares (context parallelism, Ulysses: the
    token-sharding group), ``counts`` [E] are the choices per expert summed over those ranks (default: this rank's)
    and the result is this rank's part (Megatron-LM's form): f_e from the whole micro-batch's choices, P_e's sum over
    this rank's tokens only, so that the ranks' parts add up to the whole micro-batch's loss, value and gradient."""
    num_tokens, num_experts = routing.scores.shape
    scores = _balance_scores(routing, config)
    if counts is None:
        counts = tokens_per_expert(balance_choices(routing, config), num_experts)
    fraction = counts.float() / (num_tokens * shards * config.router_topk)
    mean_score = scores.mean(0)  # [E]
    if shards > 1:  # this rank's share of the whole micro-batch's mean
        mean_score = mean_score / shards
    return config.aux_loss_coeff * num_experts * (fraction * mean_score).sum()


def sequence_counts(expert_index: torch.Tensor, num_experts: int, batch: int) -> torch.Tensor:
    """How many of each sequence's choices went to each expert: [T, k] -> [b, E] int64, for T = s * b tokens laid
    out sequence-position-major (token t = i * b + j is position i of sequence j, the [s, b, h] activations'
    order)."""
    sequence = torch.arange(expert_index.shape[0], device=expert_index.device) % batch  # [T]
    flat = (sequence[:, None] * num_experts + expert_index).flatten()  # [T * k]: (sequence, expert) pairs
    return torch.bincount(flat, minlength=batch * num_experts).view(batch, num_experts)


def seq_aux_loss(routing: Routing, config: MoEConfig, batch: int, counts: torch.Tensor | None = None,
                 shards: int = 1) -> torch.Tensor:
    """DeepSeek-V2's sequence-wise balance loss (a scalar, 0 when ``seq_aux_loss_coeff`` is): the aux loss of each
    of the ``batch`` sequences of the T = s * b tokens (``sequence_counts``' layout), averaged over them.

    Split over ``shards`` ranks each holding s / shards positions of every sequence (context parallelism,
    Ulysses), ``counts`` [b, E] are the choices per sequence and expert summed over those ranks and the result is
    this rank's part, as in ``aux_loss``: the parts add up to the whole micro-batch's loss, value and gradient."""
    num_tokens, num_experts = routing.scores.shape
    positions = num_tokens // batch  # this rank's s / shards
    if counts is None:
        counts = sequence_counts(balance_choices(routing, config), num_experts, batch)
    fraction = counts.float() / (positions * shards * config.router_topk)  # [b, E]
    mean_score = _balance_scores(routing, config).view(positions, batch, num_experts).mean(0) / shards  # [b, E]
    return config.seq_aux_loss_coeff * num_experts * (fraction * mean_score).sum() / batch


def z_loss(routing: Routing, config: MoEConfig, shards: int = 1) -> torch.Tensor:
    """The router z-loss (a scalar): keeps the logits small. Split over ``shards`` ranks of equal token shares:
    this rank's part (the coefficient divided by ``shards``, as Megatron-LM does)."""
    return config.z_loss_coeff / shards * torch.logsumexp(routing.logits, -1).square().mean()


def new_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's update: under-loaded experts (below the mean load) up by ``rate``, over-loaded down."""
    load = load.float()
    return bias + rate * torch.sign(load.mean() - load)


class TopKRouter(nn.Module):
    """logits = x W_r^T over all E experts, W_r [E, h] replicated on every rank (every rank routes its own tokens).

    Args:
        config: the MoE configuration.
        hidden_size: h.
        init_method: fills the fp32 [E, h] weight.
        tp_group: set where the TP ranks route other tokens (expert tensor parallelism 1 with sequence
            parallelism): the weight enters through copy-to-TP (its gradient summed over the group) and is tagged
            ``sequence_parallel`` (``Norm``'s pattern). None: every TP rank routes the same tokens.

    Buffers: ``expert_bias`` [E] fp32 (with ``router_enable_expert_bias``; kept fp32 whatever the module's dtype,
    since updates of 1e-3 vanish in bf16) and ``tokens_per_expert`` [E] (the choices counted since the last bias
    update, training only; not saved).
    """

    def __init__(self, config: MoEConfig, hidden_size: int, init_method, tp_group=None):
        super().__init__()
        self.config, self.tp_group = config, tp_group
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size, dtype=torch.float32))
        init_method(self.weight)
        self.weight.sequence_parallel = tp_group is not None
        self.weight_grad_store = None  # ZB-H1: where the weight gradient is deferred
        self.replaying = False  # set by MoELayer while --recompute-modules moe replays the layer: nothing counted
        enabled = config.router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(config.num_experts) if enabled else None)
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.int64) if enabled
                             else None, persistent=False)

    def _apply(self, fn, recurse=True):
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None:  # moves with the module, stays fp32
            self.expert_bias = bias.to(device=self.weight.device)
        return self

    def forward(self, tokens: torch.Tensor) -> Routing:
        """tokens [T, h] -> Routing."""
        # in --moe-router-dtype (fp32 unless fp64: linear casts the weight); under ZB-H1 its gradient is deferred
        # (weight_grad_store.py)
        # with a tp_group the gradient is summed over TP in the backward pass (copy-to-TP), hence not deferred
        if self.tp_group is None:
            weight, store = self.weight, self.weight_grad_store
        else:
            weight, store = copy_to_tensor_model_parallel_region(self.weight, self.tp_group), None
        dtype = router_dtype(self.config)
        if torch.is_grad_enabled() and tokens.dtype != dtype:  # keeps the tokens, not their cast copy
            logits = _RouterGatingLinear.apply(tokens, weight, dtype, store)  # [T, E]
        else:
            logits = linear(tokens.to(dtype), weight, None, store)  # [T, E]
        if self.config.router_force_load_balancing:
            logits = RandomLogits.apply(logits)
        routing = route(logits, self.config, self.expert_bias)
        if self.expert_bias is not None and self.training and not self.replaying:
            self.tokens_per_expert += tokens_per_expert(routing.expert_index.detach(), self.config.num_experts)
        return routing
