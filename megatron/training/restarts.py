"""In-job restarts under ``torchrun --max-restarts N``: how many happened, how many iterations they lost.

    tracker = RestartTracker.from_launch()      # None unless torchrun started this process with its agent's store
    report = tracker.resumed(iteration)         # collective, once the checkpoint is loaded: the restart, or None
    tracker.reached(iteration)                  # after every iteration: rank 0 records how far the job has got

The progress of a dead attempt must outlive its workers. torchrun's agent holds one key-value store for the whole
job, every attempt of its workers included (each attempt joins its process group through a prefix of its own,
``megatron.training.distributed``): rank 0 writes the iteration it has finished, and the iterations lost so far,
to one unprefixed key of it after every iteration. The key lives exactly as long as the job, so a new launch never
reads an old job's progress (a file beside the checkpoints would outlive it, and would need --save), and the agent
survives any failure of its workers. The write is one small request to the agent per iteration.

An attempt after the first (TORCHELASTIC_RESTART_COUNT > 0) reads the key before any rank writes it again (a
barrier between): the previous attempt had reached iteration ``reached``; this one resumes from ``resumed`` (the
newest complete checkpoint), so ``reached - resumed`` iterations are trained again. Rank 0 then records the resume,
so an attempt that dies before its first iteration is counted as losing nothing more.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch.distributed as dist

from megatron.training.distributed import job_store

KEY = "/megatron/progress"  # unprefixed: every attempt of the job reads and writes the same key


@dataclasses.dataclass(frozen=True)
class RestartReport:
    restarts: int          # restarts so far in this job: torchrun's attempt number
    reached: int           # the iteration the previous attempt had finished
    resumed: int           # the iteration this attempt resumes from (its checkpoint's)
    lost: int              # iterations trained again because of this restart: reached - resumed
    lost_total: int        # iterations lost by every restart of the job so far

    def message(self) -> str:
        return (f"in-job restart {self.restarts} (torchrun attempt {self.restarts}): the previous attempt had reached "
                f"iteration {self.reached}, this one resumes from iteration {self.resumed}: {self.lost} iteration(s) "
                f"lost, {self.lost_total} in all")

    def scalars(self) -> dict[str, float]:
        return {"restarts/restarts": self.restarts, "restarts/iterations-lost": self.lost,
                "restarts/iterations-lost-total": self.lost_total}


class RestartTracker:
    """The job's progress in torchrun's store (see the module docstring); ``store`` the unprefixed store."""

    def __init__(self, store, attempt: int, rank: int):
        self.store = store
        self.attempt = attempt
        self.rank = rank
        self.lost_total = 0

    @classmethod
    def from_launch(cls) -> Optional["RestartTracker"]:
        store = job_store()
        if store is None:
            return None
        return cls(store, int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_rank())

    def resumed(self, iteration: int) -> Optional[RestartReport]:
        """Collective. In a restarted attempt, the report of the restart (None in the first attempt, or when the
        previous attempts never recorded an iteration); rank 0 then records ``iteration`` as the job's progress."""
        report = None
        if self.attempt > 0 and self.store.check([KEY]):
            previous = json.loads(self.store.get(KEY))
            lost = max(0, previous["iteration"] - iteration)
            self.lost_total = previous["lost_total"] + lost
            report = RestartReport(self.attempt, previous["iteration"], iteration, lost, self.lost_total)
        dist.barrier()  # every rank has read the dead attempt's progress before rank 0 overwrites it
        self.reached(iteration)
        return report

    def reached(self, iteration: int) -> None:
        """Rank 0: the job has finished ``iteration`` (one request to torchrun's agent). Where the agent no longer
        answers (it is going down with the job), the count stops there rather than the run, which may be saving."""
        if self.rank == 0 and self.store is not None:
            try:
                self.store.set(KEY, json.dumps({"iteration": iteration, "lost_total": self.lost_total}))
            except RuntimeError as error:  # torch's DistStoreError is one
                print(f"in-job restart count: torchrun's store did not answer ({error}); no longer recorded",
                      flush=True)
                self.store = None
