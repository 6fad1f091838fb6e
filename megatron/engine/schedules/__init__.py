"""The pipeline schedules' engines: each schedule of the registry (``megatron.config.schedules``) run on DeepSpeed's
PipelineEngine, and which engine runs which schedule (``ENGINE_CLASSES``).

    interleaved        interleaved 1F1B (Megatron-LM's virtual stages): its order as a DeepSpeed ``PipeSchedule``
                       (``compute_order``, ``InterleavedSchedule``), ``InterleavedPipelineModule`` (the rank's v
                       chunks of layers) and ``InterleavedPipelineEngine`` (asynchronous p2p between virtual stages)
    zero_bubble        ZB-H1 (``--enable-zbh1-pipeline``): ``ZeroBubbleH1Schedule`` (a ``TrainSchedule`` with
                       ``WeightPass``), ``ZeroBubblePipelineEngine`` and its set-up ``enable_zero_bubble``
    streams            ``schedule_streams``: a DeepSpeed ``PipeSchedule`` class -> each stage's instruction names,
                       what the registry's timeline simulator (``megatron.config.schedules.idle_slots``) replays
                       at the entry's ``unit_costs``

How a schedule is chosen and run: ``megatron.config.schedules.schedule_name(rc)`` picks the registry entry from the
run's flags; ``megatron.engine.initialize.build_engine`` looks it up in ``ENGINE_CLASSES`` and has
``deepspeed.initialize`` build that class (``deepspeed_compat.pipeline_engine_class``), then runs its set-up.
DeepSpeed's ``PipelineEngine.train_batch`` then runs the engine's ``_train_schedule()`` through ``_exec_schedule``.

Adding a schedule (ZB-V, DualPipeV): one ``Schedule`` entry in megatron/config/schedules.py, one module here (its
``PipeSchedule`` and engine class), one ``ENGINE_CLASSES`` line below, one flag.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from deepspeed.runtime.pipe.schedule import TrainSchedule

from megatron.engine.schedules.interleaved import InterleavedPipelineEngine, InterleavedSchedule
from megatron.engine.schedules.zero_bubble import ZeroBubbleH1Schedule, ZeroBubblePipelineEngine, enable_zero_bubble

__all__ = ["ScheduleEngine", "ENGINE_CLASSES"]


class ScheduleEngine(NamedTuple):
    """How the engine runs one schedule of the registry."""

    engine_class: Optional[type]          # the PipelineEngine subclass; None: DeepSpeed's own PipelineEngine
    set_up: Optional[Callable]            # (the engine deepspeed.initialize built) -> the engine; None: nothing
    schedule_class: type                  # the DeepSpeed PipeSchedule its _train_schedule() runs


# registry name (megatron.config.schedules) -> its engine
ENGINE_CLASSES = {
    "1f1b": ScheduleEngine(None, None, TrainSchedule),
    "zbh1": ScheduleEngine(ZeroBubblePipelineEngine, enable_zero_bubble, ZeroBubbleH1Schedule),
    "interleaved": ScheduleEngine(InterleavedPipelineEngine, None, InterleavedSchedule),
}
