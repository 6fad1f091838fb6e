"""The hang watchdog (--hang-watchdog-factor): a thread on each rank that ends a hung job with its stacks.

    clock = StepClock(factor=10, min_seconds=60, warmup_steps=5)   # the decision, on any clock (tests: a fake one)
    watchdog = HangWatchdog(clock, rank=0, world_size=2, store=store, poll_s=1.0)
    watchdog.start()
    clock.start(time.monotonic(), iteration); ...step...; clock.stop(time.monotonic())
    watchdog.stop()

A step (the training loop's whole iteration: the engine's step, the log line's collectives, the exit check) is
overdue when it has run longer than ``factor`` x the median of the last ``window`` timed steps, and at least
``min_seconds``. The first ``warmup_steps`` steps of the launch (compilation, warm-up, the first steps after a
resume) are neither watched nor timed; an evaluation or a save inside an iteration is left out (``pause`` /
``resume`` around it: the clock stops, and the step's time excludes it).

Each rank dumps its own stacks: a hung rank cannot answer a collective, so none is used. When a rank's step is
overdue its watchdog writes every thread's Python stack to stderr (each line prefixed ``[rank R]``), asks the other
ranks' watchdogs through the job's key-value store (torch.distributed's, a TCP server outside the collectives) to do
the same, waits ``grace_s`` for them, names the ranks whose watchdog did not answer (its heartbeat in the store did
not move: the process is stopped, hung in native code holding the GIL, or on a node cut off from the store's host;
each rank's host name, published at start, is given with it), and ends the process with exit status 1
(``os._exit``: the main thread is stuck in the step). The launcher (torchrun, srun) then ends the job.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from typing import Callable, Optional

FIRED_KEY = "hang-watchdog/fired"
EXIT_STATUS = 1


def _beat_key(rank: int) -> str:
    return f"hang-watchdog/beat/{rank}"


def _dumped_key(rank: int) -> str:
    return f"hang-watchdog/dumped/{rank}"


def _host_key(rank: int) -> str:
    return f"hang-watchdog/host/{rank}"


@dataclasses.dataclass(frozen=True)
class Overdue:
    """A step that has run past the threshold: the watchdog's own numbers, for its report."""

    iteration: int
    elapsed_s: float
    median_s: float
    threshold_s: float
    timed_steps: int  # how many steps the median is of

    def describe(self, factor: float, min_seconds: float) -> str:
        return (f"iteration {self.iteration} has run {self.elapsed_s:.1f} s, past the threshold {self.threshold_s:.1f} s "
                f"(--hang-watchdog-factor {factor:g} x the median step {self.median_s:.3f} s of the last "
                f"{self.timed_steps} steps, at least --hang-watchdog-min-seconds {min_seconds:g})")


class StepClock:
    """When a training step is overdue: the watchdog's decision, on whatever clock the caller reads."""

    def __init__(self, factor: float, min_seconds: float, warmup_steps: int, window: int = 20):
        self.factor = factor
        self.min_seconds = min_seconds
        self.warmup_steps = warmup_steps
        self.durations: deque[float] = deque(maxlen=window)
        self.steps_seen = 0
        self._current: Optional[tuple[int, float]] = None  # (iteration, start) of the step running now
        self._excluded = 0.0  # seconds of the running step spent paused
        self._paused_since: Optional[float] = None
        self._lock = threading.Lock()

    def start(self, now: float, iteration: int) -> None:
        """A training step begins (the loop's thread)."""
        with self._lock:
            self._current, self._excluded, self._paused_since = (iteration, now), 0.0, None

    def pause(self, now: float) -> None:
        """An evaluation or a save begins inside the step: not watched, not counted."""
        with self._lock:
            if self._paused_since is None:
                self._paused_since = now

    def resume(self, now: float) -> None:
        with self._lock:
            if self._paused_since is not None:
                self._excluded += now - self._paused_since
                self._paused_since = None

    def _elapsed(self, now: float) -> float:
        paused = now - self._paused_since if self._paused_since is not None else 0.0
        return now - self._current[1] - self._excluded - paused

    def stop(self, now: float, timed: bool = True) -> None:
        """The step ended; ``timed`` False: it is not counted in the median (a step that skipped its data)."""
        with self._lock:
            if self._current is not None and timed and self.steps_seen >= self.warmup_steps:
                self.durations.append(self._elapsed(now))
            self.steps_seen += 1
            self._current, self._paused_since = None, None

    def overdue(self, now: float) -> Optional[Overdue]:
        """The running step, if it is past the threshold (any thread); None otherwise, between steps, during the
        warm-up steps and before a step after them was timed."""
        with self._lock:
            if (self._current is None or self._paused_since is not None or self.steps_seen < self.warmup_steps
                    or not self.durations):
                return None
            iteration = self._current[0]
            median = statistics.median(self.durations)
            threshold = max(self.factor * median, self.min_seconds)
            elapsed = self._elapsed(now)
            if elapsed <= threshold:
                return None
            return Overdue(iteration, elapsed, median, threshold, len(self.durations))


def format_stacks(rank: int) -> str:
    """Every thread's Python stack in this process, each line prefixed ``[rank R]`` (the ranks' dumps interleave
    in a launcher's log)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        lines.append(f"Thread {names.get(ident, ident)!s} (most recent call last):")
        lines.extend(line.rstrip("\n") for entry in traceback.format_stack(frame) for line in entry.splitlines())
    return "".join(f"[rank {rank}] {line}\n" for line in lines)


class HangWatchdog:
    """The thread: every ``poll_s`` a heartbeat to the store, a look at the clock and at the store's request."""

    def __init__(self, clock: StepClock, *, rank: int, world_size: int, store=None, poll_s: float = 1.0,
                 grace_s: Optional[float] = None, time_fn: Callable[[], float] = time.monotonic,
                 exit_fn: Callable[[int], None] = os._exit, write: Optional[Callable[[str], None]] = None):
        self.clock = clock
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.poll_s = poll_s
        self.grace_s = grace_s if grace_s is not None else max(3 * poll_s, 2.0)
        self.time_fn = time_fn
        self.exit_fn = exit_fn
        self.write = write or _write_stderr
        self.beats = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self.fired: Optional[Overdue] = None

    def start(self) -> None:
        self._store_call("set", _host_key(self.rank), socket.gethostname())  # named when this rank goes silent
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10 * self.poll_s)

    def _run(self) -> None:
        while not self._stopped.wait(self.poll_s):
            self.poll()

    def poll(self) -> bool:
        """One look (the thread's loop; tests call it directly). True when this rank fired or dumped on request."""
        self.beats += 1
        self._store_call("set", _beat_key(self.rank), str(self.beats))
        if self._store_call("check", [FIRED_KEY]):
            fired_by = self._store_call("get", FIRED_KEY)
            self._dump(f"rank {fired_by.decode() if fired_by else '?'}'s watchdog asked for every rank's stacks")
            self._stopped.set()  # that rank ends the job; this one dumped once and stops watching
            return True
        overdue = self.clock.overdue(self.time_fn())
        if overdue is None:
            return False
        self.fired = overdue
        self._fire(overdue)
        return True

    def _fire(self, overdue: Overdue) -> None:
        self.write(f"hang watchdog: rank {self.rank}: {overdue.describe(self.clock.factor, self.clock.min_seconds)}; "
                   f"dumping every rank's Python stacks and ending the job (exit status {EXIT_STATUS})\n")
        self._dump("its step is overdue")
        others = [r for r in range(self.world_size) if r != self.rank]
        if self.store is not None and others:
            before = {r: self._store_call("get_if_set", _beat_key(r)) for r in others}
            self._store_call("set", FIRED_KEY, str(self.rank))
            deadline = self.time_fn() + self.grace_s
            dumped = set()
            while self.time_fn() < deadline and len(dumped) < len(others):
                dumped = {r for r in others if self._store_call("check", [_dumped_key(r)])}
                time.sleep(min(0.1, self.grace_s / 10))
            after = {r: self._store_call("get_if_set", _beat_key(r)) for r in others}
            silent = [r for r in others if r not in dumped and after[r] == before[r]]
            if silent:
                self.write(f"hang watchdog: rank {self.rank}: rank(s) {', '.join(map(str, silent))} did not answer "
                           f"(their watchdog's heartbeat stopped {self.grace_s:.0f} s ago or more: stopped, or hung "
                           f"in native code holding the GIL, or cut off); no stacks from them{self._hosts(silent)}\n")
            late = [r for r in others if r not in dumped and r not in silent]
            if late:
                self.write(f"hang watchdog: rank {self.rank}: rank(s) {', '.join(map(str, late))} still run but did "
                           f"not dump within {self.grace_s:.0f} s\n")
        self.write(f"hang watchdog: rank {self.rank}: ending the job (exit status {EXIT_STATUS})\n")
        self.exit_fn(EXIT_STATUS)

    def _hosts(self, ranks: list[int]) -> str:
        """'; host(s): node1 (ranks 2, 3)' from the names the ranks published at start ('' when none did)."""
        by_host: dict[str, list[int]] = {}
        for r in ranks:
            host = self._store_call("get_if_set", _host_key(r))
            if host is not None:
                by_host.setdefault(host.decode(errors="replace"), []).append(r)
        if not by_host:
            return ""
        return "; host(s): " + ", ".join(f"{host} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                                          for host, rs in by_host.items())

    def _dump(self, why: str) -> None:
        self.write(f"hang watchdog: rank {self.rank}'s Python stacks ({why}):\n" + format_stacks(self.rank))
        self._store_call("set", _dumped_key(self.rank), "1")

    def _store_call(self, name: str, *args):
        """A store operation that never raises (the store's server may be gone with a failed launcher)."""
        if self.store is None:
            return None
        try:
            if name == "get_if_set":
                key = args[0]
                return self.store.get(key) if self.store.check([key]) else None
            return getattr(self.store, name)(*args)
        except Exception:  # noqa: BLE001 (a store error must not stop the watchdog's report)
            return None


def _write_stderr(text: str) -> None:
    """One write per report, flushed: the dump is the last thing this process says."""
    sys.stderr.write(text)
    sys.stderr.flush()


def default_store():
    """torch.distributed's key-value store of the default group (None without one)."""
    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 (a private API; without it the watchdog still dumps its own rank)
        return None
