"""The pipeline schedule's run rules: which layouts interleaved virtual stages (Megatron-LM's
``--num-virtual-stages-per-pipeline-rank``) can run, each refused with the fix before any process starts.

The schedule itself is ``megatron.engine.schedules.interleaved``; it reads ``check_interleaved_layout`` from here.
"""

from __future__ import annotations

from megatron.config.combinations import check_combinations


def check_interleaved_layout(num_layers: int, pp: int, num_virtual_stages: int, num_micro_batches: int) -> None:
    """Raise ValueError naming the fix for a layout the interleaved schedule cannot run (v = 1: any)."""
    if num_virtual_stages == 1:
        return
    if num_virtual_stages < 1:
        raise ValueError(f"--num-virtual-stages-per-pipeline-rank {num_virtual_stages} must be >= 1")
    chunks = pp * num_virtual_stages
    if num_layers % chunks:
        raise ValueError(
            f"--num-layers {num_layers} does not divide into --pipeline-model-parallel-size {pp} x "
            f"{num_virtual_stages} virtual stages = {chunks} chunks of equal size: choose --num-layers a multiple "
            f"of {chunks}, or virtual stages that divide {num_layers} / {pp} layers per rank")
    check_interleaved_micro_batches(pp, num_virtual_stages, num_micro_batches)


def check_interleaved_micro_batches(pp: int, num_virtual_stages: int, num_micro_batches: int) -> None:
    """Training steps of the interleaved schedule need a multiple of p micro-batches (v = 1: any)."""
    if num_virtual_stages > 1 and num_micro_batches % pp:
        raise ValueError(
            f"the interleaved schedule runs groups of --pipeline-model-parallel-size {pp} micro-batches through "
            f"each chunk, but a step has {num_micro_batches} micro-batches (--global-batch-size / "
            f"(--micro-batch-size x data-parallel size)): make it a multiple of {pp}, or drop the virtual stages")


def check_interleaved_run(rc) -> None:
    """The whole run's combinations with virtual stages: the layout, then what the schedule does not yet support."""
    v = rc.parallel.num_virtual_stages_per_pipeline_rank
    if v == 1:
        return
    pp = rc.parallel.pipeline_model_parallel_size
    flag = f"--num-virtual-stages-per-pipeline-rank {v}"
    if pp == 1:
        raise ValueError(f"{flag} interleaves chunks over pipeline ranks, and --pipeline-model-parallel-size is 1 "
                         f"(no bubble to fill): use --pipeline-model-parallel-size 2 or more, or drop the flag")
    # ZeRO-2/3 and Ulysses need one pipeline stage (RunConfig refuses them with PP > 1 before this); what the
    # schedule does not support yet: the table in megatron.config.combinations
    check_combinations(rc, "interleaved")
    micro_batches = rc.batch.num_micro_batches(rc.parallel.data_parallel_size)
    # the layout flags place the chunks' layers
    if rc.parallel.stage_contents(rc.model.num_layers, rc.model.mtp_num_layers) is not None:
        check_interleaved_micro_batches(pp, v, micro_batches)
        return
    check_interleaved_layout(rc.model.num_layers, pp, v, micro_batches)
