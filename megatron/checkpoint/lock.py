"""One writer per checkpoint folder: the run that saves into ``--save`` holds ``SAVE/.lock``.

The lock file names its holder (host, pid, SLURM job id, start time) and is touched every
``HEARTBEAT_S`` seconds while the run lives. A second run given the same folder refuses to start,
naming the holder. A lock is taken over, with a warning, when its holder is known to be gone: the
same host and the pid no longer exists, or no heartbeat for ``STALE_AFTER_S`` (a holder on another
host that was killed). Without the lock, two jobs on one folder both exit 0 and the later silently
overwrites the first one's checkpoints. Plain files, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
import warnings
from typing import Optional

LOCK_NAME = ".lock"
HEARTBEAT_S = 60.0
STALE_AFTER_S = 15 * 60.0


@dataclasses.dataclass
class SaveLock:
    path: str
    record: dict
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        self._stop.set()
        if _read(self.path) == self.record:
            os.remove(self.path)


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "job_id": os.environ.get("SLURM_JOB_ID"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _gone(path: str, holder: Optional[dict]) -> Optional[str]:
    """Why the lock's holder is known to be gone, or None while it may be alive."""
    if holder is None:
        return "the lock file is unreadable"
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return f"process {holder['pid']} no longer exists on this host"
        except (PermissionError, KeyError, ValueError):
            pass
    age = time.time() - os.path.getmtime(path)
    if age > STALE_AFTER_S:
        return f"no heartbeat for {age / 60:.0f} minutes"
    return None


def acquire(save_dir: str) -> SaveLock:
    """Take the lock of ``save_dir`` for this process; ValueError naming the holder if a live run has it."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK_NAME)
    record = _holder()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            reason = _gone(path, holder)
            if reason is None:
                job = f", SLURM job {holder['job_id']}" if holder.get("job_id") else ""
                raise ValueError(f"--save {save_dir} is in use by another run (host {holder.get('host')}, pid "
                                 f"{holder.get('pid')}{job}, since {holder.get('started')}; lock {path}); give this "
                                 f"run its own --save, or, if that run is gone, delete the lock") from None
            warnings.warn(f"taking over the lock of {save_dir} from {holder}: {reason}")
            os.remove(path)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        lock = SaveLock(path, record)
        threading.Thread(target=lock._beat, name="save-lock-heartbeat", daemon=True).start()
        return lock
    raise ValueError(f"could not take the lock {path}: another run took it at the same time")
