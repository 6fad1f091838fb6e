"""The hang watchdog's decision (megatron.training.watchdog.StepClock) on a fake clock, its report on a fake
store, and --log-straggler's report (megatron.training.straggler), single-process. The launched job (a stopped
rank, a slowed rank) is tests/launch/test_torchrun_failures.py's."""

import threading

import pytest
import torch

from megatron.arguments import run_config_from_argv
from megatron.testing import tiny_argv
from megatron.training.straggler import ForwardTimer, straggler_report
from megatron.training.watchdog import FIRED_KEY, HangWatchdog, StepClock


def _steps(clock, seconds, first=1, start=0.0):
    """Run len(seconds) steps on ``clock``; returns the time after them."""
    now = start
    for i, s in enumerate(seconds):
        clock.start(now, first + i)
        now += s
        clock.stop(now)
    return now


def test_warmup_steps_are_neither_watched_nor_timed():
    clock = StepClock(factor=10, min_seconds=2, warmup_steps=3)
    clock.start(0.0, 1)
    assert clock.overdue(1000.0) is None  # a first step (compilation) may take any time
    clock.stop(1000.0)
    now = _steps(clock, [500.0, 500.0], first=2, start=1000.0)  # still warm-up: not timed either
    assert not clock.durations
    clock.start(now, 4)
    assert clock.overdue(now + 1000.0) is None  # no timed step yet: no median to compare with
    clock.stop(now + 1.0)
    assert list(clock.durations) == [1.0]


def test_a_step_past_factor_times_the_median_is_overdue_with_its_numbers():
    clock = StepClock(factor=10, min_seconds=2, warmup_steps=0)
    now = _steps(clock, [1.0, 1.2, 0.8, 1.0, 5.0])  # median 1.0: one slow step does not move it
    clock.start(now, 6)
    assert clock.overdue(now + 9.9) is None
    overdue = clock.overdue(now + 10.5)
    assert (overdue.iteration, overdue.elapsed_s, overdue.median_s, overdue.threshold_s, overdue.timed_steps) == (
        6, 10.5, 1.0, 10.0, 5)
    assert "past the threshold 10.0 s" in overdue.describe(10, 2)
    clock.stop(now + 10.5)
    assert clock.overdue(now + 100.0) is None  # between steps nothing is watched


def test_the_minimum_seconds_floor_and_the_window():
    clock = StepClock(factor=10, min_seconds=30, warmup_steps=0, window=3)
    now = _steps(clock, [100.0, 100.0, 100.0, 0.1, 0.1, 0.1])  # the window keeps only the last 3
    assert list(clock.durations) == pytest.approx([0.1, 0.1, 0.1])
    clock.start(now, 7)
    assert clock.overdue(now + 29.0) is None  # 10 x 0.1 s = 1 s, but never below 30 s
    assert clock.overdue(now + 31.0).threshold_s == 30


def test_an_evaluation_or_a_save_inside_a_step_is_not_watched_nor_counted():
    clock = StepClock(factor=10, min_seconds=2, warmup_steps=0)
    now = _steps(clock, [1.0, 1.0, 1.0])
    clock.start(now, 4)
    clock.pause(now + 0.5)  # evaluation, then a save: 500 s
    assert clock.overdue(now + 400.0) is None
    clock.resume(now + 500.5)
    assert clock.overdue(now + 505.0) is None  # 0.5 + 4.5 s of the step's own: under 10 s
    assert clock.overdue(now + 511.0).elapsed_s == pytest.approx(11.0)
    clock.stop(now + 501.0)
    assert clock.durations[-1] == pytest.approx(1.0)


def test_a_step_that_skipped_its_data_is_not_counted():
    clock = StepClock(factor=10, min_seconds=2, warmup_steps=0)
    now = _steps(clock, [1.0, 1.0])
    clock.start(now, 3)
    clock.stop(now + 0.001, timed=False)
    assert list(clock.durations) == [1.0, 1.0]


class FakeStore:
    """The few calls of torch.distributed's store the watchdog makes (set, get, check)."""

    def __init__(self):
        self.data = {}
        self.lock = threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.data[key] = value.encode()

    def get(self, key):
        with self.lock:
            return self.data[key]

    def check(self, keys):
        with self.lock:
            return all(key in self.data for key in keys)


class FakeTime:
    """Advances by ``tick`` at each read, so that a wait on it ends."""

    def __init__(self, start, tick=0.01):
        self.now, self.tick = start, tick

    def __call__(self):
        self.now += self.tick
        return self.now


def _overdue_clock():
    clock = StepClock(factor=10, min_seconds=2, warmup_steps=0)
    now = _steps(clock, [1.0, 1.0, 1.0])
    clock.start(now, 4)
    return clock, now


def test_the_firing_rank_dumps_its_stacks_names_a_silent_rank_and_exits_1():
    clock, now = _overdue_clock()
    out, exits = [], []
    store = FakeStore()
    watchdog = HangWatchdog(clock, rank=0, world_size=2, store=store, grace_s=0.05, time_fn=FakeTime(now + 11.0),
                            exit_fn=exits.append, write=out.append)
    assert watchdog.poll()
    text = "".join(out)
    assert exits == [1]
    assert text.startswith("hang watchdog: rank 0: iteration 4 has run 11.0 s, past the threshold 10.0 s")
    assert "[rank 0] Thread MainThread (most recent call last):" in text
    assert "in test_the_firing_rank_dumps_its_stacks_names_a_silent_rank_and_exits_1" in text  # this very stack
    assert "rank(s) 1 did not answer" in text  # rank 1 never beat: stopped
    assert store.data[FIRED_KEY] == b"0"


def test_the_silent_ranks_are_named_with_the_hosts_they_published_at_start():
    """Ranks 2 and 3 started on node1 (each watchdog's start publishes its host) and went silent, as when node1's
    link is cut: rank 0's report names them and their host; rank 1 answered."""
    store = FakeStore()
    for rank, host in ((1, "node0"), (2, "node1"), (3, "node1")):
        store.set(f"hang-watchdog/host/{rank}", host)
    store.set("hang-watchdog/dumped/1", "1")
    clock, now = _overdue_clock()
    out = []
    watchdog = HangWatchdog(clock, rank=0, world_size=4, store=store, grace_s=0.05, time_fn=FakeTime(now + 11.0),
                            exit_fn=lambda status: None, write=out.append)
    assert watchdog.poll()
    lines = [line for line in "".join(out).splitlines() if "did not answer" in line]
    assert len(lines) == 1 and lines[0].startswith("hang watchdog: rank 0: rank(s) 2, 3 did not answer"), out
    assert lines[0].endswith("; host(s): node1 (ranks 2, 3)"), lines


def test_before_the_threshold_nothing_fires():
    clock, now = _overdue_clock()
    exits = []
    watchdog = HangWatchdog(clock, rank=0, world_size=2, store=FakeStore(), time_fn=lambda: now + 9.0,
                            exit_fn=exits.append, write=lambda text: None)
    assert not watchdog.poll() and not exits


def test_a_running_rank_dumps_its_own_stacks_when_another_rank_fires():
    store = FakeStore()
    clock0, now = _overdue_clock()
    clock1 = StepClock(factor=10, min_seconds=2, warmup_steps=0)  # rank 1: not overdue itself
    out1 = []
    rank1 = HangWatchdog(clock1, rank=1, world_size=2, store=store, poll_s=0.01, write=out1.append,
                         exit_fn=lambda status: pytest.fail("rank 1 must not end the job itself"))
    rank1.start()
    out0, exits = [], []
    rank0 = HangWatchdog(clock0, rank=0, world_size=2, store=store, grace_s=30.0, time_fn=FakeTime(now + 11.0, 0.0),
                         exit_fn=exits.append, write=out0.append)
    assert rank0.poll()  # waits (on the fake clock, for ever) until rank 1's stacks are out
    rank1.stop()
    assert exits == [1]
    assert "rank 0's watchdog asked for every rank's stacks" in "".join(out1)
    assert "[rank 1] Thread hang-watchdog (most recent call last):" in "".join(out1)
    assert "did not answer" not in "".join(out0)


def test_straggler_report_names_the_fastest_and_slowest_ranks():
    text, scalars = straggler_report([10.0, 40.0, 12.0, 5.0], count=2)
    assert text == (" forward compute per iteration (ms): fastest 5.0 (rank 3), 10.0 (rank 0) | "
                    "slowest 40.0 (rank 1), 12.0 (rank 2) |")
    assert scalars == {"straggler/fastest-rank-ms": 5.0, "straggler/fastest-rank": 3.0,
                       "straggler/slowest-rank-ms": 40.0, "straggler/slowest-rank": 1.0}
    one_rank = straggler_report([3.0], count=2)[0]
    assert one_rank == " forward compute per iteration (ms): fastest 3.0 (rank 0) | slowest 3.0 (rank 0) |"


def test_the_forward_timer_counts_forward_calls_only_while_active(monkeypatch):
    module = torch.nn.Linear(2, 2)
    ticks = iter([1.0, 1.5, 2.0, 2.25])  # two forward calls: 0.5 s and 0.25 s
    monkeypatch.setattr("megatron.training.straggler.time.perf_counter", lambda: next(ticks))
    timer = ForwardTimer(module)
    module(torch.zeros(2))
    timer.active = False  # an evaluation
    module(torch.zeros(2))
    timer.active = True
    module(torch.zeros(2))
    assert timer.take_ms() == pytest.approx(750.0)
    assert timer.take_ms() == 0.0


def test_the_flags_reach_the_run_config_and_a_minimum_past_the_collective_timeout_is_refused(tiny_corpus):
    rc = run_config_from_argv(tiny_argv(tiny_corpus, "--hang-watchdog-factor", "8", "--hang-watchdog-min-seconds", "30",
                                        "--log-straggler", "--straggler-minmax-count", "2"))
    assert (rc.exit.hang_watchdog_factor, rc.exit.hang_watchdog_min_seconds, rc.exit.hang_watchdog_warmup_iters) == (
        8.0, 30.0, 5)
    assert (rc.logging.log_straggler, rc.logging.straggler_minmax_count) == (True, 2)
    off = run_config_from_argv(tiny_argv(tiny_corpus))
    assert (off.exit.hang_watchdog_factor, off.logging.log_straggler) == (None, False)
    with pytest.raises(ValueError, match="--hang-watchdog-min-seconds 60 is not below --distributed-timeout-minutes 1"):
        run_config_from_argv(tiny_argv(tiny_corpus, "--hang-watchdog-factor", "8", "--distributed-timeout-minutes", "1"))
    with pytest.raises(ValueError, match="--hang-watchdog-factor must be above 1"):
        run_config_from_argv(tiny_argv(tiny_corpus, "--hang-watchdog-factor", "0.5"))
