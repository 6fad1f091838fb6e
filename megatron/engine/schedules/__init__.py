"""The pipeline schedules' engines: each schedule of the registry (``megatron.config.schedules``) run on DeepSpeed's
PipelineEngine, and which engine runs which schedule (``ENGINE_CLASSES``).

    interleaved        interleaved virtual pipeline stages: ``InterleavedPipelineModule`` (the rank's v chunks of
                       layers) and ``InterleavedPipelineEngine`` (asynchronous p2p between virtual stages)
    interleaved_order  interleaved 1F1B (Megatron-LM's virtual stages) as a DeepSpeed ``PipeSchedule``:
                       ``compute_order``, ``InterleavedSchedule``
    zero_bubble        ZB-H1 (``--enable-zbh1-pipeline``): ``ZeroBubbleH1Schedule`` (a ``TrainSchedule`` with
                       ``WeightPass``), ``ZeroBubblePipelineEngine`` and its set-up ``enable_zero_bubble``
    streams            ``schedule_streams``: a DeepSpeed ``PipeSchedule`` class -> each stage's instruction names,
                       what the registry's timeline simulator (``megatron.config.schedules.idle_slots``) replays

How a schedule is chosen and run: ``megatron.config.schedules.schedule_name(rc)`` picks the registry entry from the
run's flags; ``megatron.engine.initialize.build_engine`` looks it up in ``ENGINE_CLASSES`` and has
``deepspeed.initialize`` build that class (``deepspeed_compat.pipeline_engine_class``), then runs its set-up.
DeepSpeed's ``PipelineEngine.train_batch`` then runs the engine's ``_train_schedule()`` through ``_exec_schedule``.

Adding a schedule (ZB-V, DualPipeV): one ``Schedule`` entry in megatron/config/schedules.py, one module here (its
``PipeSchedule`` and engine class), one ``ENGINE_CLASSES`` line below, one flag.
"""

from __future__ import annotations

from megatron.engine.schedules.interleaved import InterleavedPipelineEngine
from megatron.engine.schedules.zero_bubble import ZeroBubblePipelineEngine, enable_zero_bubble

__all__ = ["ENGINE_CLASSES"]

# registry name (megatron.config.schedules) -> (the pipeline engine class that runs it, None: DeepSpeed's own;
# what sets up the engine deepspeed.initialize built, None: nothing)
ENGINE_CLASSES = {"1f1b": (None, None), "zbh1": (ZeroBubblePipelineEngine, enable_zero_bubble),
                  "interleaved": (InterleavedPipelineEngine, None)}
