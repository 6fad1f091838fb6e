"""--timing-log-level timers, --log-memory-to-tensorboard and the --profile torch.profiler window."""

import json
import time

import pytest

from megatron.engine.timers import PhaseTimers
from megatron.testing import run_distributed, tiny_argv
from megatron.training.timing import format_timers, gather_timers, timer_scalars
from tests.helpers.training import tensorboard_scalars, train


def test_phase_timers_count_only_up_to_their_level_and_reset():
    timers = PhaseTimers(level=1)
    with timers("optimizer", 1):
        time.sleep(0.01)
    with timers("batch-generator", 2):
        time.sleep(0.01)
    elapsed = timers.elapsed_ms()
    assert list(elapsed) == ["optimizer"] and elapsed["optimizer"] >= 10.0
    assert timers.elapsed_ms() == {}


def test_timers_without_a_process_group_are_this_rank_per_iteration():
    per_rank = gather_timers({"train-batch": 30.0, "optimizer-inner-step": 6.0}, num_iterations=3)
    assert per_rank == {"train-batch": [(0, 10.0)], "optimizer-inner-step": [(0, 2.0)]}
    assert timer_scalars(per_rank) == {"train-batch-time": 10.0, "optimizer-inner-step-time": 2.0}


def test_the_log_line_names_the_rank_with_the_max_or_the_range():
    per_rank = {"forward-backward": [(0, 4.0), (1, 9.5)], "batch-generator": [(0, 1.25)]}
    assert format_timers(per_rank, "max") == (" max time across ranks (ms): forward-backward: 9.50 (rank 1) | "
                                              "batch-generator: 1.25 (rank 0) |")
    assert format_timers(per_rank, "minmax").startswith(" (min, max) time across ranks (ms): "
                                                        "forward-backward: (4.00, 9.50) |")
    assert "forward-backward: rank 0 4.00, rank 1 9.50" in format_timers(per_rank, "all")
    assert format_timers({}, "max") == ""


def _trace_steps(path):
    events = json.loads(path.read_text())["traceEvents"]
    return sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))


@pytest.mark.multiprocess
def test_timers_memory_and_a_two_step_profile_window_land_in_tensorboard(tiny_corpus, tmp_path):
    tb = tmp_path / "tb"
    argv = tiny_argv(tiny_corpus, train_iters=6, log_interval=2, tensorboard_dir=str(tb), timing_log_level=2,
                     log_timers_to_tensorboard=True, log_memory_to_tensorboard=True, profile=True,
                     use_pytorch_profiler=True, profile_step_start=2, profile_step_end=4)
    plain = tiny_argv(tiny_corpus, train_iters=6, log_interval=2)
    (timed, untimed), = run_distributed(train, world_size=1, args=([argv, plain],))
    assert [h[1] for h in timed["history"]] == [h[1] for h in untimed["history"]]  # measuring changes no loss

    scalars = tensorboard_scalars(tb)
    for tag in ("train-batch-time", "optimizer-inner-step-time", "batch-generator-time"):
        assert [step for step, _ in scalars[tag]] == [2, 4, 6], tag
        assert all(value > 0 for _, value in scalars[tag]), tag
    # one iteration contains its optimizer step and its batches
    for (_, whole), (_, inner), (_, batches) in zip(scalars["train-batch-time"], scalars["optimizer-inner-step-time"],
                                                    scalars["batch-generator-time"]):
        assert inner < whole and batches < whole
    for tag in ("mem-rss-bytes", "mem-max-rss-bytes"):
        assert [step for step, _ in scalars[tag]] == [2, 4, 6] and all(v > 1e6 for _, v in scalars[tag]), tag

    traces = sorted(tb.glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0"]
    # iterations 3 and 4 recorded (iteration 2 was the warm-up); two steps, no more
    assert len(_trace_steps(traces[0])) == 2
