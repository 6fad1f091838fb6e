"""--timing-log-level, --log-memory-to-tensorboard and the --profile window: parsed into LoggingConfig,
impossible combinations refused with the fix named."""

import pytest

from megatron.arguments import run_config_from_argv
from tests.helpers.arguments import tiny_config_argv


def _logging(files, **flags):
    return run_config_from_argv(tiny_config_argv(files, **flags), world_size=1, with_vocab=False).logging


def test_defaults_measure_and_profile_nothing(files):
    log = _logging(files)
    assert (log.timing_log_level, log.timing_log_option, log.log_memory_to_tensorboard) == (0, "minmax", False)
    assert (log.profile, log.profile_step_start, log.profile_step_end, log.profile_ranks) == (False, 10, 12, ())


def test_profiling_flags_reach_the_config(files, tmp_path):
    log = _logging(files, timing_log_level=2, timing_log_option="max", tensorboard_dir=str(tmp_path / "tb"),
                   log_memory_to_tensorboard=True, profile=True, use_pytorch_profiler=True,
                   profile_step_start=3, profile_step_end=5, profile_ranks=[0, 2])
    assert (log.timing_log_level, log.timing_log_option, log.log_memory_to_tensorboard) == (2, "max", True)
    assert (log.profile, log.use_pytorch_profiler, log.profile_step_start, log.profile_step_end,
            log.profile_ranks) == (True, True, 3, 5, (0, 2))


@pytest.mark.parametrize("flags, message", [
    (dict(profile=True, profile_step_start=5, profile_step_end=5), "need 0 <= START < END"),
    (dict(profile=True, profile_step_start=-1, profile_step_end=2), "need 0 <= START < END"),
    (dict(profile=True, use_pytorch_profiler=True), "--tensorboard-dir"),
    (dict(use_pytorch_profiler=True), "add --profile"),
    (dict(log_memory_to_tensorboard=True), "needs --tensorboard-dir"),
])
def test_impossible_combinations_are_refused(files, flags, message):
    with pytest.raises(ValueError, match=message):
        _logging(files, **flags)


def test_a_timing_level_outside_0_to_2_is_a_usage_error(files):
    with pytest.raises(SystemExit):
        _logging(files, timing_log_level=3)


def test_nsys_profiling_is_refused_without_cuda(files, monkeypatch):
    from megatron.training.profiling import check_profiler_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="--use-pytorch-profiler"):
        check_profiler_device(_logging(files, profile=True))
