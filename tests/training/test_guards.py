"""The loss guard on its own: when a non-finite loss, gradient norm or skipped step stops the run, and
which losses are reported as spikes; and in a real bf16 run, a step DeepSpeed skipped for an overflowing
gradient (injected; the loss still finite) stops the run before that state is saved."""

import math

import pytest

from megatron.testing import run_distributed, tiny_argv
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


def _train_watching_the_guard(rank, world_size, argv, poisoned_iteration=None):
    """On each rank: pretrain ``argv`` with every ``LossGuard.observe`` call recorded (and, where
    ``poisoned_iteration`` is given, one gradient element made inf in that iteration's backward); those calls
    (iteration, loss, grad norm, skipped) and the message of the NonFiniteLossError that stopped it (or None)."""
    from megatron.arguments import run_config_from_argv
    from megatron.training import guards
    from megatron.training.pretrain import pretrain
    from tests.helpers.faults import poison_gradients

    seen = []
    observe = guards.LossGuard.observe

    def watched(self, iteration, loss, grad_norm, skipped):
        seen.append((iteration, loss, grad_norm, skipped))
        return observe(self, iteration, loss, grad_norm, skipped)

    guards.LossGuard.observe = watched  # this rank's process only
    if poisoned_iteration is not None:
        poison_gradients({poisoned_iteration}, math.inf)
    try:
        pretrain(run_config_from_argv(argv, world_size=world_size))
    except NonFiniteLossError as error:
        return seen, str(error)
    return seen, None


@pytest.mark.multiprocess
def test_a_bf16_step_deepspeed_skips_for_overflow_stops_the_run_before_its_save(tiny_corpus, tmp_path):
    # An inf in one gradient element of iteration 2 (injected: which learning rate overflows bf16, and when,
    # depends on the CPU's kernels): DeepSpeed's BF16_Optimizer finds the norm non-finite and skips the step,
    # while the loss is finite. bf16 has no loss scaler to explain a skip.
    save = tmp_path / "ckpt"
    argv = tiny_argv(tiny_corpus, "--bf16", train_iters=4, save=str(save), save_interval=1)
    (seen, error), = run_distributed(_train_watching_the_guard, world_size=1, args=(argv, 2))
    assert [r[0] for r in seen] == [1, 2], seen  # it stopped at the poisoned iteration
    (_, *first), (_, loss, grad_norm, skipped) = seen
    assert all(math.isfinite(x) for x in first[:2]) and not first[2], seen
    assert math.isfinite(loss) and skipped, seen  # the loss alone would not have stopped it
    assert grad_norm == math.inf  # DeepSpeed reports a skipped step's norm as inf (bf16_optimizer.step)
    assert error is not None and error.startswith("iteration 2: ") and "skipped by DeepSpeed" in error, error
    assert (save / "latest").read_text().strip() == "global_step1" and not (save / "global_step2").exists()
