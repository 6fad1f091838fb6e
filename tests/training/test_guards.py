"""The loss guard on its own: when a non-finite loss, gradient norm or skipped step stops the run, and
which losses are reported as spikes."""

import math

import pytest

from megatron.training.guards import LossGuard, NonFiniteLossError


def _guard(**overrides):
    settings = dict(check_for_nan=True, max_nonfinite_steps=None, loss_spike_factor=10.0, loss_scaling=False)
    settings.update(overrides)
    return LossGuard(**settings)


@pytest.mark.parametrize("loss, grad_norm", [(math.nan, 1.0), (math.inf, 1.0), (2.0, math.nan), (2.0, math.inf)])
def test_the_first_nonfinite_loss_or_grad_norm_stops_the_run_naming_the_iteration(loss, grad_norm):
    guard = _guard()
    assert guard.observe(1, 3.0, 1.0, False) is None
    with pytest.raises(NonFiniteLossError, match=r"^iteration 2: non-finite loss or gradient norm .*"
                                                 r"--check-for-nan-in-loss-and-grad"):
        guard.observe(2, loss, grad_norm, False)


def test_a_skipped_step_counts_without_loss_scaling_and_not_with_it():
    with pytest.raises(NonFiniteLossError, match="iteration 7: .*optimizer step skipped by DeepSpeed"):
        _guard().observe(7, 3.0, 1.0, True)  # bf16 / fp32: a skip means the gradients overflowed
    assert _guard(loss_scaling=True).observe(7, 3.0, 1.0, True) is None  # fp16: the loss scaler's normal skip


def test_max_nonfinite_steps_allows_that_many_minus_one_in_a_row_and_the_check_can_be_turned_off():
    guard = _guard(max_nonfinite_steps=3)
    guard.observe(1, math.nan, None, False)
    guard.observe(2, 3.0, 1.0, False)  # a finite one resets the count
    guard.observe(3, math.nan, None, False)
    guard.observe(4, math.nan, None, False)
    with pytest.raises(NonFiniteLossError, match="iteration 5: 3 consecutive iterations"):
        guard.observe(5, math.nan, None, False)
    unchecked = _guard(check_for_nan=False)
    for iteration in range(1, 20):
        assert unchecked.observe(iteration, math.nan, math.nan, True) is None
    assert unchecked.consecutive == 19


def test_a_loss_above_factor_times_its_running_mean_is_reported_with_its_ratio():
    guard = _guard(loss_spike_factor=4.0)
    assert [guard.observe(i, 2.0, 1.0, False) for i in range(1, 6)] == [None] * 5  # history first
    assert guard.observe(6, 7.9, 1.0, False) is None  # below 4 x 2.0
    mean = (5 * 2.0 + 7.9) / 6
    assert guard.observe(7, 40.0, 1.0, False) == pytest.approx(40.0 / mean)
    disabled = _guard(loss_spike_factor=0.0)
    assert [disabled.observe(i, 2.0, 1.0, False) for i in range(1, 7)] + [disabled.observe(7, 1e9, 1.0, False)] \
        == [None] * 7
