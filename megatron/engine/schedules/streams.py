"""A DeepSpeed ``PipeSchedule`` as instruction streams: each stage's instruction names for one training step, what
the registry's timeline simulator replays (``megatron.config.schedules.timeline`` / ``idle_slots``).

    streams = schedule_streams(TrainSchedule, stages=4, micro_batches=8)   one list of instruction names per stage
    idle_slots(streams, REGISTRY["1f1b"].unit_costs)                       -> [9, 9, 9, 9]

An instruction of a schedule with chunks (interleaved: ``chunk`` among its arguments) is ``(name, chunk)``, so the
simulator pairs each receive with the send of the right virtual stage.
"""

from __future__ import annotations

__all__ = ["schedule_streams"]


def _instruction(cmd):
    return (cmd.name, cmd.kwargs["chunk"]) if "chunk" in cmd.kwargs else cmd.name


def schedule_streams(schedule_class, stages: int, micro_batches: int, **kwargs) -> list[list]:
    """Every stage's instructions for one step of ``schedule_class`` (a DeepSpeed ``PipeSchedule``; ``kwargs`` go
    to its constructor, e.g. ``num_virtual_stages``)."""
    return [[_instruction(cmd) for step in schedule_class(micro_batches=micro_batches, stages=stages, stage_id=stage,
                                                          **kwargs).steps()
             for cmd in step] for stage in range(stages)]
