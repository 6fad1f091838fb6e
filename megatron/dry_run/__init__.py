"""``pretrain_gpt.py --dry-run``: a job checked and planned without starting it.

    python pretrain_gpt.py <the job's flags> --dry-run --world-size 384 [--dry-run-json plan.json]

- ``megatron.arguments.check``: every problem of the flags, files and environment at once;
- ``plan``: the pipeline stages (DeepSpeed's partition rule, ``megatron.engine.partition``), the batch
  and its rampup, the run's iterations, samples and tokens, the learning-rate schedule's key points;
- ``estimate``: the planner's memory per GPU, step time and pipeline schedule (bubble, activations per stage,
  p2p bytes) for this layout, a CP job's ring and an FP8 job's GEMMs and refusal on a GPU without FP8
  (``megatron.planner``);
- ``report``: the whole as one dict, its JSON file, the exit status; ``text``: the printed form.

No process group starts and nothing runs on a GPU (CUDA is only asked whether it is there). Sits at
the level of the entry points: it reads the arguments, the engine (for DeepSpeed's rule only), the
training schedule helpers and the planner.
"""

from megatron.dry_run.report import build_report, dry_run

__all__ = ["dry_run", "build_report"]
