"""The ZB-H1 schedule generator, replayed without processes: its bubble against 1F1B's and the analytic ones.

``megatron.config.schedules.idle_slots`` replays each stage's instruction stream at unit costs (F = B = W = 1, 1F1B's
backward B + W = 2), receives waiting for their sends; the idle slots per stage are compared with
(p - 1)(F + B + W) for 1F1B and (p - 1)(F + B - W) for ZB-H1 (Qi et al. 2023).
"""

import pytest
from deepspeed.runtime.pipe.schedule import TrainSchedule

from megatron.config.schedules import ONE_F_ONE_B_COSTS, ZERO_BUBBLE_COSTS, analytic_idle_slots, idle_slots
from megatron.engine.schedules.streams import schedule_streams
from megatron.engine.schedules.zero_bubble import ZeroBubbleH1Schedule

LAYOUTS = [(2, 2), (2, 8), (3, 3), (3, 7), (4, 4), (4, 16), (8, 8), (8, 24), (12, 48)]  # (stages, micro-batches)


@pytest.mark.parametrize("stages, micro_batches", LAYOUTS)
def test_idle_slots_per_stage_are_the_analytic_bubbles(stages, micro_batches):
    one_f_one_b = idle_slots(schedule_streams(TrainSchedule, stages, micro_batches), ONE_F_ONE_B_COSTS)
    zbh1 = idle_slots(schedule_streams(ZeroBubbleH1Schedule, stages, micro_batches), ZERO_BUBBLE_COSTS)
    assert one_f_one_b == [analytic_idle_slots("1f1b", stages, micro_batches)] * stages == [3 * (stages - 1)] * stages
    assert zbh1 == [analytic_idle_slots("zbh1", stages, micro_batches)] * stages == [stages - 1] * stages
    # as a fraction of the step: 1F1B (p - 1) / (m + p - 1), ZB-H1 (p - 1) / (3m + p - 1)
    busy = 3 * micro_batches
    assert one_f_one_b[0] / (busy + one_f_one_b[0]) == pytest.approx((stages - 1) / (micro_batches + stages - 1))
    assert zbh1[0] / (busy + zbh1[0]) == pytest.approx((stages - 1) / (3 * micro_batches + stages - 1))


@pytest.mark.parametrize("stages, micro_batches", LAYOUTS)
def test_zbh1_keeps_1f1b_order_and_runs_every_w_before_the_step(stages, micro_batches):
    ours = schedule_streams(ZeroBubbleH1Schedule, stages, micro_batches)
    theirs = schedule_streams(TrainSchedule, stages, micro_batches)
    for stage, (stream, reference) in enumerate(zip(ours, theirs)):
        # the same forwards, backwards and p2p pairs in the same order: no send meets another receive
        assert [name for name in stream if name != "WeightPass"] == reference, stage
        assert stream.count("WeightPass") == micro_batches, stage
        first_reduction = stream.index("ReduceTiedGrads")
        assert "WeightPass" not in stream[first_reduction:], f"stage {stage}: a W pass after the reductions"
        waiting, most = 0, 0  # W passes deferred at once: stage s holds s, and the next one until its W runs
        for name in stream:
            waiting += (name == "BackwardPass") - (name == "WeightPass")
            assert waiting >= 0, f"stage {stage}: a W pass before its backward pass"
            most = max(most, waiting)
        assert most == min(stage + 1, micro_batches), (stage, most)


def test_fewer_micro_batches_than_stages_leave_a_larger_bubble():
    # why --enable-zbh1-pipeline refuses them: (p - 1)(F + B - W) needs m >= p
    assert idle_slots(schedule_streams(ZeroBubbleH1Schedule, 4, 2), ZERO_BUBBLE_COSTS) == [5] * 4
    with pytest.raises(ValueError, match="micro-batches >= stages"):
        analytic_idle_slots("zbh1", 4, 2)


def test_a_receive_without_its_send_is_a_deadlock():
    with pytest.raises(ValueError, match="deadlock"):
        idle_slots([["RecvGrad", "ForwardPass"], ["RecvActivation"]], ZERO_BUBBLE_COSTS)
