"""Leaving cleanly: SIGTERM (what SLURM sends before a time limit or on preemption), the kill-switch
file, ``--exit-duration-in-mins`` and ``--exit-interval``.

Each rank notices these on its own and possibly at different iterations (a signal reaches ranks
at different moments), so the decision is agreed with one all-reduce (MAX) per iteration: every
rank stops after the same iteration, saves, and exits 0.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Optional

REASONS = ("", "exit-interval", "exit-duration", "kill-switch", "signal")

# A signal that arrived during start-up, before the loop's ExitMonitor existed (see below).
_early_signal: dict[str, Optional[int]] = {"signum": None}


def _die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG). True if armed."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        return False
    if os.getppid() == 1:  # the parent died before the request was made
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def die_with_launcher() -> bool:
    """Under torchrun (TORCHELASTIC_RUN_ID set), SIGKILL this worker when the launcher that started it
    dies: a ``kill -9`` of torchrun must not leave workers training and writing checkpoints on their own.
    Not under srun or a plain ``python`` (there the parent is a shell or SLURM's step daemon, and a closed
    terminal must not end a run). True if armed."""
    return "TORCHELASTIC_RUN_ID" in os.environ and _die_with_parent()


def data_loader_worker_init(worker_id: int) -> None:  # noqa: ARG001 - DataLoader's worker_init_fn signature
    """In each DataLoader worker: ignore SIGTERM, and leave with the rank that started it.

    torchrun stops its workers with ``killpg`` and ``scancel`` signals every process of the step, so the
    SIGTERM that asks a rank to save also reaches its data workers. torch's worker handler dies of it
    (it only ignores a SIGTERM from its own parent), the rank's next batch then raises "DataLoader worker
    is killed by signal: Terminated" and the job ends without its checkpoint. Ignored here, the workers
    keep serving batches through the save and end when the rank does (the death signal, and torch's own
    watchdog on the parent's pid)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()


def install_early_signal_handler(signals=(signal.SIGTERM,)) -> None:
    """Record SIGTERM from the very start of the process (this module imports nothing heavy), so a
    preemption during the long start-up is acted on at the first iteration boundary instead of
    killing the process before its handler exists."""

    def record(signum, frame):  # noqa: ARG001 - signal handler signature
        _early_signal["signum"] = signum

    for sig in signals:
        signal.signal(sig, record)


class ExitMonitor:
    """Watches the exit conditions; ``check(iteration)`` returns the agreed reason or ''."""

    def __init__(self, *, exit_interval: Optional[int] = None, exit_duration_in_mins: Optional[float] = None,
                 kill_switch_path: Optional[str] = None, start_time: Optional[float] = None,
                 signals=(signal.SIGTERM,)):
        self.exit_interval = exit_interval
        self.exit_duration_in_mins = exit_duration_in_mins
        self.kill_switch_path = kill_switch_path
        self.start_time = time.time() if start_time is None else start_time
        self.received_signal: Optional[int] = _early_signal["signum"]
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):  # noqa: ARG002 - signal handler signature
        self.received_signal = signum

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def local_reason(self, iteration: int) -> int:
        if self.received_signal is not None:
            return REASONS.index("signal")
        if self.kill_switch_path and os.path.exists(self.kill_switch_path):
            return REASONS.index("kill-switch")
        if self.exit_duration_in_mins and (time.time() - self.start_time) / 60.0 > self.exit_duration_in_mins:
            return REASONS.index("exit-duration")
        if self.exit_interval and iteration % self.exit_interval == 0:
            return REASONS.index("exit-interval")
        return 0

    def check(self, iteration: int) -> str:
        import torch  # noqa: PLC0415 (pretrain_gpt.py installs the signal handler before torch is imported)
        import torch.distributed as dist  # noqa: PLC0415 (pretrain_gpt.py installs the signal handler before torch is imported)

        from megatron.parallel.state import collective_device  # noqa: PLC0415 (imports torch: see above)

        code = torch.tensor([self.local_reason(iteration)], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            code = code.to(collective_device())
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
        return REASONS[int(code.item())]
