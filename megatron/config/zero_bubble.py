"""What the ZB-H1 pipeline schedule (``--enable-zbh1-pipeline``, megatron/engine/schedules/zero_bubble.py) needs of a run:
refused before any process starts, each message naming the values and the fix."""

from __future__ import annotations

from megatron.config.combinations import check_combinations

__all__ = ["check_zero_bubble_run"]

_FLAG = "--enable-zbh1-pipeline"


def check_zero_bubble_run(rc) -> None:
    """The layouts and settings ZB-H1 runs with here (``rc``: a ``RunConfig``)."""
    p = rc.parallel
    if p.enable_zbh1_exact_semantics and not p.enable_zbh1_pipeline:
        raise ValueError(f"--enable-zbh1-exact-semantics has no effect without {_FLAG}; add {_FLAG} or drop it")
    if not p.enable_zbh1_pipeline:
        return
    if not p.enable_zbh1_exact_semantics:
        raise ValueError(f"{_FLAG} runs here only with exact semantics: the gradient clipping and the optimizer step "
                         f"come after every deferred weight-gradient pass, so the step is 1F1B's step. Add "
                         f"--enable-zbh1-exact-semantics")
    check_combinations(rc, "ZB-H1")  # the model engine, CP, torch.compile: megatron.config.combinations
    if not rc.bf16 and rc.deepspeed_zero_stage > 0:
        raise ValueError(f"{_FLAG} in fp32 needs --zero-stage 0: fp32 ZeRO-1 (DeepSpeedZeroOptimizer) collects "
                         f"gradients from autograd hooks, which a deferred weight gradient never reaches. Use "
                         f"--zero-stage 0, or --bf16 (BF16_Optimizer shards the fp32 master weights as ZeRO-1 does)")
    stages, micro_batches = p.pipeline_model_parallel_size, _fewest_micro_batches(rc)
    if micro_batches < stages:
        raise ValueError(f"{_FLAG} with --pipeline-model-parallel-size {stages} needs at least {stages} micro-batches "
                         f"per step, got {micro_batches} = global batch / (--micro-batch-size "
                         f"{rc.batch.micro_batch_size} x data-parallel size {p.data_parallel_size}): only then do the "
                         f"deferred weight passes fill the bubble to (p - 1)(F + B - W). Raise --global-batch-size (and "
                         f"any --rampup-batch-size start) to {stages * rc.batch.micro_batch_size * p.data_parallel_size} "
                         f"or lower --micro-batch-size")


def _fewest_micro_batches(rc) -> int:
    """Micro-batches per step at the smallest global batch the run uses (a rampup's start, else the global)."""
    unit = rc.batch.micro_batch_size * rc.parallel.data_parallel_size
    rampup = rc.batch.rampup_batch_size
    return (rampup[0] if rampup is not None else rc.batch.global_batch_size) // unit
