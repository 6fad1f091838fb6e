"""The interleaved schedule's instruction stream, without processes: its bubble against the closed form, side
by side with DeepSpeed's 1F1B, and that its sends and receives pair up.

The bubble is counted from the executed stream by the registry's timeline simulator
(``megatron.config.schedules.timeline``): each rank's instructions, in order, on one timeline (one slot per chunk
forward, two per chunk backward), a receive waiting for the send of the neighbouring virtual stage; a rank's idle
slots are the step's length minus its busy slots.
"""

from collections import Counter

import pytest
from deepspeed.runtime.pipe import schedule as ds_schedule

from megatron.config.schedules import REGISTRY, timeline
from megatron.engine.schedules.interleaved import (
    BACKWARD,
    FORWARD,
    InterleavedSchedule,
    compute_order,
    num_warmup_forwards,
    passes_of,
)
from megatron.engine.schedules.streams import schedule_streams

LAYOUTS = [(2, 2, 2), (2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 8), (3, 2, 6), (4, 3, 8), (4, 4, 8), (1, 2, 3)]


def _streams(pp, v, m):
    if v == 1:
        return schedule_streams(ds_schedule.TrainSchedule, pp, m)
    return schedule_streams(InterleavedSchedule, pp, m, num_virtual_stages=v)


def simulate(streams, v):
    """The registry's timeline at the schedule's unit costs (F 1, B 2 per chunk)."""
    return timeline(streams, REGISTRY["interleaved" if v > 1 else "1f1b"].unit_costs)


@pytest.mark.parametrize("pp,v,m", LAYOUTS)
def test_idle_slots_equal_the_closed_form_and_beat_1f1b(pp, v, m):
    interleaved, one_f_one_b = simulate(_streams(pp, v, m), v), simulate(_streams(pp, 1, m), 1)
    # Each chunk is 1/v of a stage: F costs 1 slot and B 2 at chunk size, v and 2v for a whole stage.
    busy = m * v * 3
    assert interleaved.busy == [busy] * pp
    assert interleaved.idle == [(pp - 1) * 3] * pp, interleaved  # the (p - 1)(t_f + t_b) / v fill and drain
    fraction = (pp - 1) / (v * m + pp - 1)
    for r in range(pp):
        assert interleaved.idle_fraction(r) == pytest.approx(fraction, abs=1e-12)
    # 1F1B on the same model: whole-stage passes (F = 1, B = 2 slots here), bubble (p - 1) / (m + p - 1).
    assert one_f_one_b.idle == [(pp - 1) * 3] * pp
    assert one_f_one_b.idle_fraction(0) == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    if pp > 1:  # the time for the same work: v x the slots of one chunk-sized 1F1B pass
        assert interleaved.makespan < v * one_f_one_b.makespan


@pytest.mark.parametrize("pp,v,m", LAYOUTS)
def test_every_pass_once_and_every_message_paired(pp, v, m):
    sent, received = Counter(), Counter()
    for rank in range(pp):
        steps = list(InterleavedSchedule(m, pp, rank, v).steps())
        passes = Counter(passes_of(steps))
        assert passes == Counter({(kind, c): m for kind in (FORWARD, BACKWARD) for c in range(v)})
        loads = [cmd.buffer_id for step in steps for cmd in step if isinstance(cmd, ds_schedule.LoadMicroBatch)]
        assert loads == (list(range(m)) if rank in (0, pp - 1) else []), rank
        for cmd in (cmd for step in steps for cmd in step):
            stage = cmd.kwargs.get("chunk", 0) * pp + rank
            if isinstance(cmd, ds_schedule.SendActivation):
                sent[("act", stage + 1)] += 1
            elif isinstance(cmd, ds_schedule.RecvActivation):
                received[("act", stage)] += 1
            elif isinstance(cmd, ds_schedule.SendGrad):
                sent[("grad", stage - 1)] += 1
            elif isinstance(cmd, ds_schedule.RecvGrad):
                received[("grad", stage)] += 1
        assert isinstance(steps[-1][-1], ds_schedule.OptimizerStep)
    assert sent == received and sum(sent.values()) == 2 * m * (pp * v - 1)


def test_order_follows_megatron():
    # PP = 2, v = 2, 4 micro-batches, rank 0: micro-batches 0, 1 through chunk 0, then through chunk 1, ...
    order = compute_order(2, 2, 4, 0)
    assert num_warmup_forwards(2, 2, 4, 0) == 4 and num_warmup_forwards(2, 2, 4, 1) == 2
    assert order[:6] == [(FORWARD, 0, 0), (FORWARD, 0, 1), (FORWARD, 1, 0), (FORWARD, 1, 1), (FORWARD, 0, 2),
                         (BACKWARD, 1, 0)]
    assert order[-1] == (BACKWARD, 0, 3)


def test_refuses_micro_batches_not_a_multiple_of_stages_but_evaluates_any():
    with pytest.raises(ValueError, match="make it a multiple of 2"):
        list(InterleavedSchedule(3, 2, 0, 2).steps())
    streams = schedule_streams(InterleavedSchedule, 2, 3, num_virtual_stages=2, forward_only=True)
    assert simulate(streams, 2).busy == [6, 6]  # every forward, no deadlock
