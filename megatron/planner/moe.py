"""The mixture-of-experts part of the planner: expert parameters per rank, the all-to-all bytes of a step, and
the layout rules expert parallelism adds.

Experts per rank. An MoE layer holds E routed experts of width f (each h -> f -> h; SwiGLU: three f x h matrices,
else two), a router [E, h] (replicated over every rank) and optionally a shared expert (a dense MLP). Expert
parallelism (EP = e) gives each EP rank E / e whole experts; tensor parallelism then splits every expert along f
exactly as the dense MLP is split (``megatron.model.moe.experts``): one rank of one MoE layer holds

    (E / e) * (m * f * h / t  [+ (m - 1) * f / t  fc1 bias]  [+ h  fc2 bias, replicated over TP])

with m = 3 for SwiGLU, else 2. The expert-data-parallel group (the DP / e ranks holding the same experts) is
what ZeRO-1 / BF16_Optimizer shards the experts' fp32 masters and Adam states over, and where their gradients
are averaged: ``megatron.planner.memory`` counts them with that divisor, the rest of the stage with DP.

All-to-all bytes. Each MoE layer of each micro-batch exchanges its T = s * b tokens' k choices twice in the
forward (dispatch: the rows each rank sends to the experts' ranks; combine: the experts' outputs back) and twice
in the backward (each exchange's adjoint, the same rows the other way); a recomputed forward exchanges both
again. The rows are h wide, in the activations' dtype (w bytes). One rank hands ``all_to_all_single``

    dispatch N + combine M rows, forward and backward:  2 * (N + M) * h * w bytes per MoE layer and micro-batch

where N = the choices it routes (T * k, dropless; fewer when a capacity drops some) and M = the choices its
experts receive. Both are exact given the routing (``exchange_bytes``); the planner's figure (``layer_bytes``)
takes the dropless, balanced expectation M = N = T * k, and of each exchange the (e - 1) / e that leaves the
rank (the rest is a rank's rows to its own experts): cross-rank bytes = T * k * h * w * (e - 1) / e per exchange.
With a capacity factor c, M <= (E / e) * ceil(T * k / E * c) per source rank (a bound, not an expectation).
Every forward also exchanges the per-expert counts: E int64 values (8 * E bytes), no backward.
With TP > 1 every TP rank of an EP group exchanges the same rows (tokens enter the MoE layer replicated over TP),
so the bytes are per rank regardless of t.

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

__all__ = ["MoEShape", "expert_params_per_rank", "moe_layer_params", "exchange_bytes", "layer_bytes",
           "step_all_to_all_bytes", "check_expert_layout"]

EXCHANGES_PER_PASS = 3  # dispatch (the rows and their routing weights) and combine


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The sizes of an MoE model's routed experts (the rest of the model is its ``ModelShape``)."""

    num_experts: int
    topk: int
    expert_ffn: int                      # each routed expert's width f
    layer_pattern: tuple[bool, ...]      # one per layer: True = MoE MLP, False = dense MLP
    shared_expert_ffn: int = 0           # width of an always-on dense MLP beside the experts (0: none)
    capacity_factor: Optional[float] = None  # None: dropless

    def __post_init__(self):
        if self.num_experts < 1 or self.topk < 1 or self.expert_ffn < 1:
            raise ValueError(f"experts {self.num_experts}, top-k {self.topk} and expert width {self.expert_ffn} "
                             f"must be positive")
        if self.topk > self.num_experts:
            raise ValueError(f"top-k {self.topk} is larger than the {self.num_experts} experts; route each token to "
                             f"at most {self.num_experts}")
        if not any(self.layer_pattern):
            raise ValueError("the MoE layer pattern marks no layer as MoE; mark at least one or plan a dense model")

    @property
    def num_moe_layers(self) -> int:
        return sum(self.layer_pattern)

    def stage_moe_layers(self, layers_per_stage: Sequence[int]) -> list[int]:
        """MoE layers on each pipeline stage, the stages holding consecutive layers in order."""
        out, start = [], 0
        for n in layers_per_stage:
            out.append(sum(self.layer_pattern[start:start + n]))
            start += n
        return out


def mlp_params(hidden: int, ffn: int, swiglu: bool, bias: bool, tp: int = 1) -> int:
    """One dense MLP (or one expert) on one TP rank: the f-wide matrices and fc1 bias split, the fc2 bias not."""
    fc1 = 2 * ffn if swiglu else ffn
    return (fc1 * hidden + ffn * hidden + (fc1 if bias else 0)) // tp + (hidden if bias else 0)


def expert_params_per_rank(moe: MoEShape, hidden: int, swiglu: bool, bias: bool, tp: int = 1, ep: int = 1) -> int:
    """The routed experts of ONE MoE layer held by one (TP, EP) rank (module docstring)."""
    return moe.num_experts // ep * mlp_params(hidden, moe.expert_ffn, swiglu, bias, tp)


def moe_layer_params(dense_layer_params: int, dense_mlp_params: int, moe: MoEShape, hidden: int, swiglu: bool,
                     bias: bool, tp: int = 1, ep: int = 1, etp: int = 0) -> tuple[int, int]:
    """(non-expert, expert) parameters of one MoE layer on one rank: the dense layer without its MLP, plus the
    router [E, h] and the shared expert; and this rank's routed experts (split over ``etp`` ranks; 0: tp)."""
    shared = mlp_params(hidden, moe.shared_expert_ffn, swiglu, bias, tp) if moe.shared_expert_ffn else 0
    dense = dense_layer_params - dense_mlp_params + moe.num_experts * hidden + shared
    return dense, expert_params_per_rank(moe, hidden, swiglu, bias, etp or tp, ep)


def exchange_bytes(sent_rows: int, received_rows: int, hidden: int, bytes_per_element: int, *, num_experts: int,
                   recompute: bool = False) -> int:
    """Bytes one rank hands ``all_to_all_single`` for ONE MoE layer and micro-batch, given its routing: it sent
    ``sent_rows`` choices and its experts received ``received_rows`` (forward dispatch N + combine M, the
    backward the same, a recomputed forward again), the routing weights travelling with the rows (counted as the
    calls' output buffers, as ``comm_count`` records them: M arrive with the experts' rows per forward, N gradients
    come back in the backward; at the activations' width, 2 bytes short each under --moe-router-dtype fp32 in
    bf16), plus the forward's count exchange (E int64)."""
    forwards = 2 if recompute else 1
    rows = (forwards + 1) * (sent_rows + received_rows)
    weights = forwards * received_rows + sent_rows
    return (rows * hidden + weights) * bytes_per_element + forwards * 8 * num_experts


def layer_bytes(moe: MoEShape, tokens: int, hidden: int, bytes_per_element: int, ep: int,
                recompute: bool = False) -> dict:
    """The planner's all-to-all figures for ONE MoE layer and micro-batch of ``tokens`` tokens on one rank:
    ``handed`` (what the rank hands the calls, dropless and balanced: N = M = T * k), ``cross_rank`` (the
    (e - 1) / e of it that leaves the rank), ``calls``; a capacity factor bounds ``handed`` by the capacity."""
    if ep == 1:
        return {"handed": 0, "cross_rank": 0.0, "calls": 0}
    rows = tokens * moe.topk
    if moe.capacity_factor is not None:  # each expert keeps at most C choices of this rank's tokens
        rows = min(rows, moe.num_experts * math.ceil(tokens * moe.topk / moe.num_experts * moe.capacity_factor))
    forwards = 2 if recompute else 1
    handed = exchange_bytes(rows, rows, hidden, bytes_per_element, num_experts=moe.num_experts, recompute=recompute)
    data = handed - forwards * 8 * moe.num_experts
    return {"handed": handed, "cross_rank": data * (ep - 1) / ep,
            "calls": (forwards + 1) * EXCHANGES_PER_PASS + forwards}


def step_all_to_all_bytes(moe: MoEShape, seq_length: int, micro_batch_size: int, num_micro_batches: int,
                          hidden: int, bytes_per_element: int, ep: int, moe_layers_on_stage: int,
                          recompute: bool = False) -> dict:
    """``layer_bytes`` for a whole step of one rank: every MoE layer of its stage, every micro-batch."""
    one = layer_bytes(moe, seq_length * micro_batch_size, hidden, bytes_per_element, ep, recompute)
    times = moe_layers_on_stage * num_micro_batches
    return {key: value * times for key, value in one.items()}


def check_expert_layout(moe: MoEShape, ep: int, tp: int = 1) -> None:
    """What expert parallelism needs of the experts (``Layout`` checks EP against DP and Ulysses, as the run does):
    ValueError naming the values and the fix."""
    if moe.num_experts % ep:
        raise ValueError(f"{moe.num_experts} experts are not divisible by expert-parallel size {ep}; each EP rank "
                         f"holds an equal share: use a divisor of {moe.num_experts}")
    if moe.expert_ffn % tp or (moe.shared_expert_ffn and moe.shared_expert_ffn % tp):
        raise ValueError(f"expert width {moe.expert_ffn} (shared {moe.shared_expert_ffn}) is not divisible by TP "
                         f"{tp}; use a TP size that divides it")
