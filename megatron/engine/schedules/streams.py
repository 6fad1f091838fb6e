"""The pipeline bubble, counted from instruction streams: each stage's idle slots in one training step.

    streams = schedule_streams(TrainSchedule, stages=4, micro_batches=8)   one list of instructions per stage
    idle_slots(streams, ONE_F_ONE_B_COSTS)                                  -> [9, 9, 9, 9]

The count replays the streams as the engine runs them, each stage in its own order: a compute instruction takes
its cost in slots (unit costs: forward F = input-gradient pass B = weight-gradient pass W = 1; 1F1B's
``BackwardPass`` is B + W = 2), a receive waits for the matching send of the neighbour (the k-th receive of
activations on stage s for the k-th send on s - 1; gradients from s + 1), a send never waits. A stage's idle slots
are the step's length (when the last stage finishes) minus its busy slots. On CPU, where time is noisy, this is
how the bubble is measured; ``analytic_idle_slots`` gives the papers' formulas to compare with.
"""

from __future__ import annotations

from typing import Sequence

from deepspeed.runtime.pipe.schedule import TrainSchedule

from megatron.config import schedules as registry
from megatron.engine.schedules.zero_bubble import ZeroBubbleH1Schedule

__all__ = ["ONE_F_ONE_B_COSTS", "ZERO_BUBBLE_COSTS", "SCHEDULES", "schedule_streams", "idle_slots",
           "analytic_idle_slots"]

ONE_F_ONE_B_COSTS = {"ForwardPass": 1, "BackwardPass": 2}                  # backward = B + W
ZERO_BUBBLE_COSTS = {"ForwardPass": 1, "BackwardPass": 1, "WeightPass": 1}  # backward = B; W apart

# registry name (megatron.config.schedules) -> (DeepSpeed schedule class, unit costs of its instructions)
SCHEDULES = {"1f1b": (TrainSchedule, ONE_F_ONE_B_COSTS), "zbh1": (ZeroBubbleH1Schedule, ZERO_BUBBLE_COSTS)}

_RECV_FROM = {"RecvActivation": ("SendActivation", -1), "RecvGrad": ("SendGrad", +1)}


def schedule_streams(schedule_class, stages: int, micro_batches: int) -> list[list[str]]:
    """Every stage's instruction names for one step of ``schedule_class`` (a DeepSpeed ``PipeSchedule``)."""
    return [[cmd.name for step in schedule_class(micro_batches=micro_batches, stages=stages, stage_id=stage).steps()
             for cmd in step] for stage in range(stages)]


def idle_slots(streams: Sequence[Sequence[str]], costs: dict[str, int]) -> list[int]:
    """Per stage, the slots it waits during the step the ``streams`` (one per stage, in execution order) make."""
    stages = len(streams)
    clock, position = [0] * stages, [0] * stages
    sent: list[dict[str, list[int]]] = [{"SendActivation": [], "SendGrad": []} for _ in range(stages)]
    received = [{"RecvActivation": 0, "RecvGrad": 0} for _ in range(stages)]
    while any(position[s] < len(streams[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while position[s] < len(streams[s]):
                name = streams[s][position[s]]
                if name in _RECV_FROM:
                    send, offset = _RECV_FROM[name]
                    times = sent[s + offset][send]
                    if received[s][name] >= len(times):
                        break  # the neighbour has not sent it yet
                    clock[s] = max(clock[s], times[received[s][name]])
                    received[s][name] += 1
                elif name in sent[s]:
                    sent[s][name].append(clock[s])
                clock[s] += costs.get(name, 0)
                position[s] += 1
                moved = True
        if not moved:
            raise ValueError(f"the streams deadlock at positions {position}: a receive without its send")
    busy = [sum(costs.get(name, 0) for name in stream) for stream in streams]
    return [max(clock) - b for b in busy]


def analytic_idle_slots(schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> int:
    """Idle slots per stage and step at unit costs (a slot F + B + W = 3), from the registry's bubble
    (``megatron.config.schedules``): 1F1B (p - 1)(F + B + W) = 3(p - 1); ZB-H1 (Qi et al. 2023)
    (p - 1)(F + B - W) = p - 1, which needs micro_batches >= stages."""
    entry = registry.get(schedule)
    if entry.micro_batches_at_least_stages and micro_batches < stages:
        raise ValueError(f"{entry.label}'s bubble needs micro-batches >= stages, got {micro_batches} < {stages}")
    return round(3 * entry.bubble_slots(stages, virtual_stages, weight_share=1 / 3))
