"""Restarts of a job, by torchrun (``--max-restarts N``) or by SLURM (``sbatch --requeue``): how many happened, how
many iterations they lost.

    tracker = RestartTracker.from_launch(save)  # None unless torchrun's agent store or a SLURM job saving is there
    report = tracker.resumed(iteration)         # collective, once the checkpoint is loaded: the restart, or None
    tracker.reached(iteration)                  # after every iteration: rank 0 records how far the job has got

The progress of a dead start must outlive its workers. torchrun's agent holds one key-value store for the whole
job, every attempt of its workers included (each attempt joins its process group through a prefix of its own,
``megatron.training.distributed``): rank 0 writes the iteration it has finished, the iterations lost and the
restarts so far, to one unprefixed key of it after every iteration. The key lives exactly as long as the job, so a
new launch never reads an old job's progress, and the agent survives any failure of its workers; the write is one
small request to the agent per iteration. A SLURM job requeued keeps its job id but is launched anew (a new
torchrun, a new store): its progress is a file under --save named by the job id (``ProgressFile``), which
counts torchrun's restarts inside the job too; a new job (a new id) never reads it.

A start that finds a record (all ranks read it, then a barrier) is a restart: the previous start had reached
iteration ``reached``; this one resumes from ``resumed`` (the newest complete checkpoint), so ``reached - resumed``
iterations are trained again. Rank 0 then records the resume, so a start that dies before its first iteration is
counted as losing nothing more.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch.distributed as dist

from megatron.training.distributed import job_store

KEY = "/megatron/progress"  # unprefixed: every attempt of the job reads and writes the same key
PROGRESS_FOLDER = "job_progress"  # under --save: SLURM jobs' progress files, one per job id


@dataclasses.dataclass(frozen=True)
class RestartReport:
    restarts: int          # restarts so far in this job (the first start is none)
    reached: int           # the iteration the previous start had finished
    resumed: int           # the iteration this start resumes from (its checkpoint's)
    lost: int              # iterations trained again because of this restart: reached - resumed
    lost_total: int        # iterations lost by every restart of the job so far
    source: str = "torchrun"  # what restarted it: "torchrun" (--max-restarts) or "SLURM" (a requeue)

    def message(self) -> str:
        how = (f"in-job restart {self.restarts} (torchrun attempt {self.restarts})" if self.source == "torchrun"
               else f"job restart {self.restarts} (SLURM requeue: the same job, started again)")
        return (f"{how}: the previous attempt had reached iteration {self.reached}, this one resumes from iteration "
                f"{self.resumed}: {self.lost} iteration(s) lost, {self.lost_total} in all")

    def scalars(self) -> dict[str, float]:
        return {"restarts/restarts": self.restarts, "restarts/iterations-lost": self.lost,
                "restarts/iterations-lost-total": self.lost_total}


class ProgressFile:
    """The job's progress where no torchrun store outlives a restart: a SLURM job requeued (``--requeue``: the same
    job id, a new launch) keeps it in ``SAVE/job_progress/slurm-<job id>.json`` on the shared filesystem. The store
    interface ``RestartTracker`` uses (check / get / set of the one key); each write replaces the file whole."""

    def __init__(self, path: str):
        self.path = path

    def check(self, keys) -> bool:
        return os.path.isfile(self.path)

    def get(self, key) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def set(self, key, value: str) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        partial = f"{self.path}.partial"
        with open(partial, "w") as f:
            f.write(value)
        os.replace(partial, self.path)


class RestartTracker:
    """The job's progress in a store every start of the job reads (see the module docstring): torchrun's
    (unprefixed), or a SLURM job's ``ProgressFile``. A record there when a start resumes means an earlier start of
    the same job got that far: this one is a restart."""

    def __init__(self, store, rank: int, source: str = "torchrun"):
        self.store = store
        self.rank = rank
        self.source = source
        self.restarts = 0
        self.lost_total = 0

    @classmethod
    def from_launch(cls, save_dir: Optional[str] = None) -> Optional["RestartTracker"]:
        """A SLURM job saving checkpoints (SLURM_JOB_ID, ``save_dir``): its progress file, which counts requeues and
        torchrun's restarts inside the job alike; else torchrun's store (--max-restarts); else None."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if job_id and save_dir:
            restarted_by = "torchrun" if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" else "SLURM"
            return cls(ProgressFile(os.path.join(save_dir, PROGRESS_FOLDER, f"slurm-{job_id}.json")),
                       dist.get_rank(), restarted_by)
        store = job_store()
        if store is None:
            return None
        return cls(store, dist.get_rank())

    def resumed(self, iteration: int) -> Optional[RestartReport]:
        """Collective. In a restarted start of the job, the report of the restart (None in its first start, or
        when the previous starts never recorded an iteration); rank 0 then records ``iteration`` as the job's
        progress."""
        report = None
        if self.store.check([KEY]):
            previous = json.loads(self.store.get(KEY))
            lost = max(0, previous["iteration"] - iteration)
            self.restarts = previous.get("restarts", 0) + 1
            self.lost_total = previous["lost_total"] + lost
            report = RestartReport(self.restarts, previous["iteration"], iteration, lost, self.lost_total, self.source)
        dist.barrier()  # every rank has read the previous start's progress before rank 0 overwrites it
        self.reached(iteration)
        return report

    def reached(self, iteration: int) -> None:
        """Rank 0: the job has finished ``iteration`` (one request to torchrun's agent, or one small file written).
        Where the store no longer answers (torchrun's agent going down with the job, a full disk), the count stops
        there rather than the run, which may be saving."""
        if self.rank == 0 and self.store is not None:
            record = {"iteration": iteration, "lost_total": self.lost_total, "restarts": self.restarts}
            try:
                self.store.set(KEY, json.dumps(record))
            except (RuntimeError, OSError) as error:  # torch's DistStoreError is a RuntimeError
                print(f"job restart count: its store did not answer ({error}); no longer recorded", flush=True)
                self.store = None
