"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages) as a DeepSpeed ``PipeSchedule``.

Each of the p pipeline ranks holds v chunks; chunk c of rank r is virtual stage c*p + r, so a micro-batch
passes every rank v times (rank p-1's chunk c hands its activations to rank 0's chunk c+1). The k-th
forward of a rank runs chunk (k // p) % v on micro-batch (k // (p*v)) * p + k % p: groups of p micro-batches
go through chunk 0, then the same group through chunk 1, and so on; backwards walk the chunks the other way.
A rank first runs ``num_warmup_forwards`` forwards (Megatron's (p - r - 1) * 2 + (v - 1) * p, the registry's), then
alternates one forward and one backward, then drains the remaining backwards.

``compute_order`` gives that order for one rank (pure Python); ``InterleavedSchedule`` turns it into DeepSpeed
instructions for ``megatron.engine.schedules.interleaved.InterleavedPipelineEngine``; ``passes_of`` reads the
(kind, chunk) passes back from a rank's stream. The registry's timeline simulator
(``megatron.config.schedules.timeline``, over ``megatron.engine.schedules.streams.schedule_streams``) counts each
rank's idle slots, which the registry states in closed form ((p - 1) / v idle slots,
``megatron.planner.schedule_costs.bubble_fraction``): (p - 1) / (v * m + p - 1) of every rank's step, with F and B
passes of one chunk taking t_f / v and t_b / v of a whole stage's time.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from deepspeed.runtime.pipe import schedule as ds_schedule

from megatron.config.pipeline_schedule import check_interleaved_micro_batches
from megatron.config.schedules import REGISTRY

INTERLEAVED = REGISTRY["interleaved"]
FORWARD, BACKWARD = "F", "B"


def num_warmup_forwards(pp: int, num_virtual_stages: int, num_micro_batches: int, rank: int) -> int:
    """Forwards rank ``rank`` runs before its first backward (Megatron-LM's count, capped at all of them: the
    registry's, ``megatron.config.schedules``)."""
    return INTERLEAVED.warmup_forwards(pp, num_micro_batches, rank, num_virtual_stages)


def _chunk_and_micro_batch(k: int, pp: int, v: int, kind: str) -> tuple[int, int]:
    chunk = (k // pp) % v
    return (chunk if kind == FORWARD else v - 1 - chunk), (k // (pp * v)) * pp + k % pp


def compute_order(pp: int, num_virtual_stages: int, num_micro_batches: int, rank: int,
                  forward_only: bool = False) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s passes in order: (FORWARD or BACKWARD, chunk, micro-batch)."""
    v, m = num_virtual_stages, num_micro_batches
    total = m * v
    if forward_only and m % pp:  # evaluation of any micro-batch count: each one through every chunk in turn
        return [(FORWARD, chunk, micro_batch) for micro_batch in range(m) for chunk in range(v)]
    check_interleaved_micro_batches(pp, v, m)
    forwards = [(FORWARD, *_chunk_and_micro_batch(k, pp, v, FORWARD)) for k in range(total)]
    if forward_only:
        return forwards
    backwards = [(BACKWARD, *_chunk_and_micro_batch(k, pp, v, BACKWARD)) for k in range(total)]
    warmup = num_warmup_forwards(pp, v, m, rank)
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup:]


class WaitSends(ds_schedule.PipeInstruction):
    """Wait until every activation and gradient this rank sent has been received."""


class InterleavedSchedule(ds_schedule.PipeSchedule):
    """``compute_order`` as DeepSpeed instructions, one step per pass; ``chunk`` rides on every buffer op.

    Buffer slot of (chunk, micro-batch): chunk * m + micro-batch. Receives are posted at their instruction
    and waited for by the pass that reads them; sends are waited for by ``WaitSends`` (so no rank blocks on
    a peer that is itself waiting: the order is a valid topological order of the whole pipeline's passes).
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, num_virtual_stages: int,
                 forward_only: bool = False):
        super().__init__(micro_batches, stages, stage_id)
        self.num_virtual_stages = num_virtual_stages
        self.forward_only = forward_only

    def num_pipe_buffers(self) -> int:
        return self.num_virtual_stages * self.micro_batches

    def _slot(self, chunk: int, micro_batch: int) -> int:
        return chunk * self.micro_batches + micro_batch

    def _loads_data(self, chunk: int) -> bool:
        """Rank 0 loads inputs at chunk 0; rank p-1 loads labels at its last chunk (both at once when p = 1)."""
        if self.stage_id == 0 and chunk == 0:
            return True
        return self.stage_id == self.stages - 1 and self.stages > 1 and chunk == self.num_virtual_stages - 1

    def steps(self):
        p, v = self.stages, self.num_virtual_stages
        order = compute_order(p, v, self.micro_batches, self.stage_id, self.forward_only)
        for kind, chunk, micro_batch in order:
            slot = self._slot(chunk, micro_batch)
            virtual_stage = chunk * p + self.stage_id
            first, last = virtual_stage == 0, virtual_stage == p * v - 1
            if kind == FORWARD:
                cmds = [ds_schedule.LoadMicroBatch(micro_batch)] if self._loads_data(chunk) else []
                cmds += [] if first else [ds_schedule.RecvActivation(slot, chunk=chunk)]
                cmds.append(ds_schedule.ForwardPass(slot, chunk=chunk))
                cmds += [] if last else [ds_schedule.SendActivation(slot, chunk=chunk)]
            else:
                cmds = [] if last else [ds_schedule.RecvGrad(slot, chunk=chunk)]
                cmds.append(ds_schedule.BackwardPass(slot, chunk=chunk))
                cmds += [] if first else [ds_schedule.SendGrad(slot, chunk=chunk)]
            yield cmds
        cmds = [WaitSends()]
        if not self.forward_only:
            cmds += [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]
        yield cmds


def passes_of(stream: Iterable[Sequence]) -> list[tuple[str, int]]:
    """The (FORWARD or BACKWARD, chunk) passes of one rank's instruction stream, in order (chunk 0 for a
    schedule without chunks, such as DeepSpeed's ``TrainSchedule``)."""
    kinds = {ds_schedule.ForwardPass: FORWARD, ds_schedule.BackwardPass: BACKWARD}
    return [(kinds[type(cmd)], getattr(cmd, "chunk", 0)) for step in stream for cmd in step if type(cmd) in kinds]
