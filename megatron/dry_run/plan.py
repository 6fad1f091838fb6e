"""What a valid ``RunConfig`` will do, computed without starting it: the pipeline stages, the batch
and its rampup, the run's length in iterations, samples and tokens, and the learning-rate schedule.

Each comes from the code the run itself uses: the engine's split of the layers (``megatron.engine.partition``),
Megatron's rampup calculator (``megatron.training.microbatches``), the loop's stopping rule (a
sample-based run stops once the consumed samples reach ``--train-samples``, the last step may pass
it) and the run's ``LRScheduler``. Every section is a JSON-ready dict.
"""

from __future__ import annotations

import bisect
import collections
import math
from typing import Optional, Sequence

from megatron.config import RunConfig, parallel_dims
from megatron.config.pipeline_layout import describe
from megatron.engine.partition import virtual_stage_bounds
from megatron.model.layout import EMBEDDING, FINAL_NORM, HEAD, TRANSFORMER, pipeline_items
from megatron.parallel.state import group_layout
from megatron.training.lr_schedule import LRScheduler
from megatron.training.microbatches import build_num_microbatches_calculator


def layout_section(rc: RunConfig, item_param_counts: Optional[Sequence[int]] = None) -> dict:
    """TP / PP / DP, and each pipeline stage: its ranks, its pipeline items and its transformer layers; with
    virtual stages (interleaving) also each chunk's. The split is the engine's (``virtual_stage_bounds``: the
    pipeline layout flags where given, else the partition method's), so the planner counts what the run builds.

    item_param_counts: parameters of each pipeline item on one TP rank (``--pp-partition-method parameters``).
    """
    p, m = rc.parallel, rc.model
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size
    sp = p.ds_sequence_parallel_size  # Ulysses: between data and model in the rank order
    cp = p.context_parallel_size  # context parallelism: the same place (never with Ulysses)
    vp = p.num_virtual_stages_per_pipeline_rank
    bounds = virtual_stage_bounds(m, p, item_param_counts)
    items = pipeline_items(m)
    layer_of = {item.index: n for n, item in enumerate(i for i in items if i.kind == TRANSFORMER)}
    ranks = group_layout(tp, pp, dp, sp, cp=cp)

    def contents(first: int, stop: int) -> dict:
        held = items[first:stop]
        layers = [layer_of[item.index] for item in held if item.kind == TRANSFORMER]
        return {"items": [first, stop - 1] if held else None, "num_transformer_layers": len(layers),
                "transformer_layers": [layers[0], layers[-1]] if layers else None,
                "holds": [item.kind for item in held if item.kind in (EMBEDDING, FINAL_NORM, HEAD)]}

    stages = []
    for stage in range(pp):
        chunks = [dict(contents(bounds[s], bounds[s + 1]), virtual_stage=s) for s in range(stage, pp * vp, pp)]
        if vp == 1:
            whole = contents(bounds[stage], bounds[stage + 1])
        else:  # the rank's chunks together: not one run of items or layers (each chunk's are in "chunks")
            whole = {"items": None, "num_transformer_layers": sum(c["num_transformer_layers"] for c in chunks),
                     "transformer_layers": None, "holds": [kind for c in chunks for kind in c["holds"]]}
        stages.append({"stage": stage,
                       "ranks": [ranks.rank_of(stage, 0, 0), ranks.rank_of(stage, dp - 1, tp - 1, sp * cp - 1)],
                       **whole, **({"chunks": chunks} if vp > 1 else {})})
    sizes = {d.field: getattr(p, d.field) for d in parallel_dims.WORLD}  # the world's factors
    out = {"world_size": rc.world_size, **sizes, "sequence_parallel": rc.model.sequence_parallel,
           "pp_partition_method": p.pp_partition_method, "num_pipeline_items": len(items), "stages": stages}
    contents_given = p.stage_contents(m.num_layers, m.mtp_num_layers)
    if contents_given is not None:  # the layout flags: each virtual stage in the layout's letters
        out["pipeline_layout"] = [describe(stage) for stage in contents_given]
    return out


class RunSteps:
    """The run's optimizer steps: each step's global batch and the samples consumed before it.

    The rampup's steps are walked one by one with the run's own calculator; after it, every step has
    the full global batch, so the rest is arithmetic.
    """

    def __init__(self, rc: RunConfig):
        b, t = rc.batch, rc.training
        self.global_batch_size = b.global_batch_size
        calculator = build_num_microbatches_calculator(b, rc.parallel.data_parallel_size)
        self.ramp_batches: list[int] = []    # global batch of each rampup step
        self.ramp_consumed = [0]             # samples consumed after 0, 1, ... rampup steps
        while b.rampup_batch_size is not None:
            calculator.update(self.ramp_consumed[-1])
            size = calculator.get_current_global_batch_size()
            if size == self.global_batch_size:
                break
            self.ramp_batches.append(size)
            self.ramp_consumed.append(self.ramp_consumed[-1] + size)
        self.num_iterations = t.train_iters if t.train_iters is not None else self.iterations_for(t.train_samples)
        if t.train_tokens is not None:  # Megatron-DeepSpeed's token budget: whichever ends first
            self.num_iterations = min(self.num_iterations,
                                      self.iterations_for(-(-t.train_tokens // rc.data.seq_length)))

    @property
    def num_ramp_iterations(self) -> int:
        return len(self.ramp_batches)

    def consumed_after(self, iterations: int) -> int:
        """Samples consumed by the end of iteration ``iterations``."""
        ramp = min(iterations, self.num_ramp_iterations)
        return self.ramp_consumed[ramp] + (iterations - ramp) * self.global_batch_size

    def iterations_for(self, samples: float) -> int:
        """The first iteration by whose end at least ``samples`` samples are consumed."""
        if samples <= self.ramp_consumed[-1]:
            return bisect.bisect_left(self.ramp_consumed, samples)
        return self.num_ramp_iterations + math.ceil((samples - self.ramp_consumed[-1]) / self.global_batch_size)

    def batch_sizes(self) -> list[tuple[int, int, int]]:
        """(global batch, first iteration, samples consumed before it) for each size the run steps through."""
        out = []
        for step, size in enumerate(self.ramp_batches + [self.global_batch_size]):
            if not out or out[-1][0] != size:
                out.append((size, step + 1, self.ramp_consumed[min(step, self.num_ramp_iterations)]))
        return out


    def steps_per_batch_size(self) -> list[tuple[int, int]]:
        """(global batch, number of the run's steps at it)."""
        ramp = self.ramp_batches[:self.num_iterations]
        counts = collections.Counter(ramp)
        counts[self.global_batch_size] += self.num_iterations - len(ramp)
        return [(size, n) for size, n in counts.items() if n]


def batch_section(rc: RunConfig, steps: RunSteps) -> dict:
    """Micro-batch, global batch and micro-batches per step; the rampup's schedule when there is one."""
    b, dp = rc.batch, rc.parallel.data_parallel_size
    per_micro_step = b.micro_batch_size * dp
    out = {"micro_batch_size": b.micro_batch_size, "data_parallel_size": dp, "samples_per_micro_step": per_micro_step,
           "global_batch_size": b.global_batch_size, "num_micro_batches": b.num_micro_batches(dp), "rampup": None}
    if b.rampup_batch_size is not None:
        start, increment, ramp_samples = b.rampup_batch_size
        num_increments = (b.global_batch_size - start) // increment
        sizes = steps.batch_sizes()
        out["rampup"] = {
            "start": start, "increment": increment, "rampup_samples": ramp_samples, "num_increments": num_increments,
            "samples_per_increment": ramp_samples / num_increments,
            "start_num_micro_batches": start // per_micro_step,
            "full_batch_iteration": sizes[-1][1], "full_batch_consumed_samples": sizes[-1][2],
            "steps": [{"global_batch_size": size, "num_micro_batches": size // per_micro_step,
                       "first_iteration": first, "consumed_samples": consumed} for size, first, consumed in sizes],
        }
    return out


def run_section(rc: RunConfig, steps: RunSteps) -> dict:
    """The run's length: iterations, samples and tokens it trains on."""
    t, seq = rc.training, rc.data.seq_length
    consumed = steps.consumed_after(steps.num_iterations)
    return {"train_samples": t.train_samples, "train_iters": t.train_iters, "seq_length": seq,
            "iterations": steps.num_iterations, "rampup_iterations": steps.num_ramp_iterations,
            "consumed_samples": consumed, "tokens": consumed * seq}


def lr_section(rc: RunConfig, steps: RunSteps) -> dict:
    """The schedule's key points: end of warmup, end of decay, end of the run, with the rate at each."""
    warmup, decay = rc.lr_schedule_in_samples()
    end = steps.consumed_after(steps.num_iterations)
    points = []
    for name, samples in (("warmup end", warmup), ("decay end", decay), ("end of training", end)):
        lr = LRScheduler.from_run_config(None, rc).step(samples)  # the run's scheduler, counting samples
        points.append({"point": name, "samples": samples, "iteration": steps.iterations_for(samples), "lr": lr})
    return {"decay_style": rc.lr_schedule.lr_decay_style, "lr": rc.optimizer.lr, "min_lr": rc.optimizer.min_lr,
            "warmup_samples": warmup, "decay_samples": decay, "points": points}
