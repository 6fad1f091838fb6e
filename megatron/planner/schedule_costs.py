"""Pipeline schedules in the planner: what each one costs in bubble, activation memory and p2p traffic.

p stages (pipeline ranks), m micro-batches per step, v virtual stages (chunks of layers) per rank; one "slot" is a
stage's forward + backward of one micro-batch: F + B + W, with B the input-gradient pass and W the weight-gradient
pass (1F1B runs B + W as one backward).

  1f1b         DeepSpeed's TrainSchedule. Bubble (p - 1) slots per step: (p - 1) / m of the ideal time. Stage i
               holds the activations of min(p - i, m) micro-batches at its peak (after the last warm-up forward).
  zbh1         ZB-H1 (Qi et al. 2023; megatron/engine/schedules/zero_bubble.py): 1F1B's order with W deferred into the
               cool-down. The schedule realises (p - 1)(F + B - W) idle per stage (tests/engine/
               test_zero_bubble_schedule.py counts it from the instruction streams): (p - 1) / 3 slots at F = B = W.
               Activations in flight are 1F1B's, and stage i also keeps the inputs and output gradients of the
               linears of the W passes waiting: i of them beside its p - i micro-batches in flight (after a
               forward), i + 1 beside p - i - 1 (after a backward, until the next step's W). So the peak is
               max((p - i) A + i W, (p - i - 1) A + (i + 1) W), A and W the stage's bytes of one micro-batch's
               activations and of one W pass: "memory neutral" only where W <= A, which recomputation breaks
               (A is then the layers' inputs, W is not). Needs m >= p.
  interleaved  Megatron-LM's interleaved 1F1B (Narayanan et al. 2021), v chunks of L / (p v) layers per rank.
               Bubble (p - 1) / v slots: (p - 1) / (v m) of the ideal time. Rank r runs Megatron's
               2 (p - r - 1) + (v - 1) p warm-up forwards of single chunks, then one forward and one backward
               alternately, so at its peak (the first steady forward) it holds n_r = 2 (p - r - 1) + (v - 1) p + 1
               chunk-micro-batches (capped at v m): n_r / v = p + (p - 2r - 1) / v micro-batches of its whole
               stage's layers, p + (p - 1) / v on rank 0 (1F1B: p), p - (p - 1) / v on the last (1F1B: 1).
               Every micro-batch crosses p v - 1 chunk boundaries instead of p - 1: each rank sends v times
               1F1B's p2p bytes. Needs L divisible by p v and m by p.

The schedules themselves (names, flags, rules, warm-up, in-flight, bubble and p2p formulas) are the registry
``megatron.config.schedules``; this module states the planner's costs with them. Pure arithmetic: the engine's
schedules (megatron/engine) are checked against these counts in tests/planner.
"""

from __future__ import annotations

from typing import Optional

from megatron.config.schedules import LABELS, SCHEDULES, check_layout, get

__all__ = ["SCHEDULES", "LABELS", "check_schedule", "bubble_slots", "bubble_fraction", "warmup_chunk_forwards",
           "in_flight", "first_chunk_in_flight", "peak_units", "p2p_bytes_per_step"]


def check_schedule(schedule: str, pp: int, num_micro_batches: int, num_layers: Optional[int], virtual_stages: int = 1,
                   precision: str = "bf16", zero_stage: int = 1) -> None:
    """ValueError naming the values and the fix when ``schedule`` cannot run this layout (the registry's rules:
    ``megatron.config.schedules.check_layout``). The name and ``virtual_stages`` themselves are checked by
    ``Layout``."""
    check_layout(schedule, pp, num_micro_batches, num_layers, virtual_stages, precision, zero_stage)


def bubble_slots(schedule: str, pp: int, virtual_stages: int = 1, weight_share: float = 1 / 3) -> float:
    """Idle slots per stage and step; ``weight_share``: W / (F + B + W) of a slot (ZB-H1 only)."""
    return get(schedule).bubble_slots(pp, virtual_stages, weight_share)


def bubble_fraction(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int = 1,
                    weight_share: float = 1 / 3) -> float:
    """The bubble's share of the step (idle / (busy + idle)) at the given W share."""
    idle = bubble_slots(schedule, pp, virtual_stages, weight_share)
    return idle / (num_micro_batches + idle)


def warmup_chunk_forwards(pp: int, virtual_stages: int, num_micro_batches: int, stage: int) -> int:
    """Megatron-LM's interleaved warm-up on rank ``stage``: chunk forwards before its first backward."""
    return get("interleaved").warmup_forwards(pp, num_micro_batches, stage, virtual_stages)


def in_flight(schedule: str, pp: int, num_micro_batches: int, stage: int, virtual_stages: int = 1) -> float:
    """Micro-batches' activations of the stage's whole set of layers held at its peak (interleaved: chunk
    micro-batches / v)."""
    return get(schedule).in_flight(pp, num_micro_batches, stage, virtual_stages)


def first_chunk_in_flight(pp: int, num_micro_batches: int, virtual_stages: int) -> int:
    """Interleaved: the most micro-batches waiting for backward in rank 0's first chunk (the embedding's). Forward k
    runs chunk (k // p) % v, backward k chunk v - 1 - (k // p) % v; replayed over Megatron's order."""
    v, total = virtual_stages, num_micro_batches * virtual_stages
    warmup = warmup_chunk_forwards(pp, v, num_micro_batches, 0)
    held = most = sum(1 for k in range(warmup) if (k // pp) % v == 0)
    for k in range(total - warmup):
        held += (warmup + k) // pp % v == 0
        most = max(most, held)
        held -= k // pp % v == v - 1
    return most


def peak_units(schedule: str, pp: int, num_micro_batches: int, stage: int, activations: float,
               weight_pass: float, virtual_stages: int = 1) -> float:
    """The stage's peak of saved activations (``activations``: one micro-batch through all its layers) plus the
    deferred W passes' inputs (``weight_pass``: one micro-batch's, ZB-H1 only)."""
    held = in_flight(schedule, pp, num_micro_batches, stage, virtual_stages) * activations
    entry = get(schedule)
    if not entry.defers_weight_passes:
        return held
    # after a forward: i W passes waiting; after a backward: one micro-batch fewer, one W more
    waiting = min(stage, num_micro_batches)
    return max(held + waiting * weight_pass,
               held - activations + entry.deferred_weight_passes(num_micro_batches, stage) * weight_pass)


def p2p_bytes_per_step(schedule: str, pp: int, num_micro_batches: int, tensor_bytes: float, virtual_stages: int = 1,
                       tp: int = 1) -> dict:
    """Bytes sent between pipeline stages in one step, ``tensor_bytes`` the [s, b, h] activation (and gradient)
    of one micro-batch: by the busiest rank (an activation and a gradient per micro-batch and chunk boundary it
    owns; DeepSpeed sends 1/t of it from each TP rank) and by the whole pipeline of one DP replica."""
    if pp == 1:
        return {"per_rank": 0.0, "pipeline": 0.0}
    v = get(schedule).p2p_factor(virtual_stages)
    return {"per_rank": 2 * num_micro_batches * v * tensor_bytes / tp,
            "pipeline": 2 * num_micro_batches * (pp * v - 1) * tensor_bytes}
