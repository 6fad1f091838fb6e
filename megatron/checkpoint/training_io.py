"""Saving and resuming a training run through DeepSpeed's engine, crash-safe.

    SAVE/global_stepN/layer_XX-model_YY-model_states.pt   pipeline layer XX (megatron.model.layout), TP rank YY
    SAVE/global_stepN/mp_rank_YY_model_states.pt          DeepSpeed's record + our client state
    SAVE/global_stepN/bf16_zero_pp_rank_*_optim_states.pt (bf16) or the plain optimizer state
    SAVE/global_stepN/run_state.json                      megatron.checkpoint.run_state

Crash safety: DeepSpeed writes the tag's files with ``save_latest=False``; every rank then waits
at a barrier, the ranks hash the files between them (``checksums.json``), rank 0 checks that each expected file is
there and non-empty, writes
``run_state.json`` and then a ``complete`` marker inside the tag, and only then replaces ``latest``
atomically (write a temporary file, then rename). A kill at any point leaves ``latest`` naming the
previous complete checkpoint (``megatron.checkpoint.tags`` says which tag a resume reads). A write
that fails on any rank (a full disk) is agreed by an all-reduce: the half-written tag is removed and
every rank raises the same ``CheckpointSaveError``, naming the folder, the space needed and ENOSPC.

``--async-save`` (``megatron.checkpoint.async_save``) writes the files in a thread and then finishes the save
with the same steps (``attempt_write``, ``raise_if_any_failed``, ``commit_tag``).

The engine is duck-typed (its ``save_checkpoint`` / ``load_checkpoint``): nothing here imports deepspeed.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.checkpoint.integrity import record_checksums
from megatron.checkpoint.tags import (
    LATEST,
    RUN_STATE,
    prune_checkpoints,
    read_latest,
    tag_for,
    write_atomically,
    write_complete_marker,
)
from megatron.parallel.random import RNGStatesTracker
from megatron.parallel.state import collective_device

__all__ = ["CLIENT_STATE_VERSION", "CheckpointSaveError", "rng_state", "set_rng_state", "save_checkpoint",
           "load_checkpoint", "attempt_write", "commit_tag", "raise_if_any_failed"]

CLIENT_STATE_VERSION = 1
NEARLY_FULL_BYTES = 2**20  # a failed save with less than this free is taken for a full disk


def rng_state(tracker: Optional[RNGStatesTracker]) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if tracker is not None:
        state["tracker"] = tracker.get_states()
    return state


def set_rng_state(state: dict[str, Any], tracker: Optional[RNGStatesTracker]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if tracker is not None and "tracker" in state:
        tracker.set_states(state["tracker"])


class CheckpointSaveError(RuntimeError):
    """A save failed (a full disk, most often); the half-written tag is gone and ``latest`` is untouched."""

    on_every_rank = True  # agreed by an all-reduce: every rank raises the same


def save_checkpoint(engine, save_dir: str, iteration: int, client_state: dict[str, Any],
                    run_state: dict[str, Any], keep_last_n: Optional[int] = None) -> str:
    """Write the checkpoint of ``iteration`` on every rank, then move ``latest`` to it. Collective.

    ``run_state`` (JSON: architecture, layout, tokenizer, progress) is written beside DeepSpeed's
    files as ``run_state.json``, readable without unpickling anything; ``keep_last_n`` prunes older
    complete checkpoints once the new one is complete. A write that fails on any rank (ENOSPC, ...) is a
    CheckpointSaveError on every rank, once the half-written tag is removed.
    """
    tag = tag_for(iteration)
    tag_dir = os.path.join(save_dir, tag)
    state = dict(client_state, client_state_version=CLIENT_STATE_VERSION, iteration=iteration)
    # DeepSpeed's save ends in a barrier: a rank whose writes failed joins it before the failure is agreed.
    failure = attempt_write(lambda: engine.save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=False),
                           after_failure=dist.barrier)
    raise_if_any_failed(failure, save_dir, tag)
    dist.barrier()
    record_checksums(tag_dir)  # collective: each rank hashes its share of the files
    failure = None
    if dist.get_rank() == 0:
        failure = attempt_write(lambda: commit_tag(save_dir, tag, iteration, run_state, keep_last_n))
    raise_if_any_failed(failure, save_dir, tag)
    return tag


def commit_tag(save_dir: str, tag: str, iteration: int, run_state: dict[str, Any],
               keep_last_n: Optional[int]) -> None:
    """Rank 0, once every rank's files are there: check them, write run_state.json, the marker, then ``latest``."""
    tag_dir = os.path.join(save_dir, tag)
    files = os.listdir(tag_dir)
    empty = [f for f in files if os.path.getsize(os.path.join(tag_dir, f)) == 0]
    if not any(f.endswith("model_states.pt") for f in files) or empty:
        raise RuntimeError(f"checkpoint {tag_dir} is incomplete after saving (files: {sorted(files)})")
    write_atomically(os.path.join(tag_dir, RUN_STATE), json.dumps(run_state, indent=1, sort_keys=True))
    write_complete_marker(tag_dir, str(iteration))
    write_atomically(os.path.join(save_dir, LATEST), tag)
    if keep_last_n:
        prune_checkpoints(save_dir, keep_last_n)


def attempt_write(write: Callable[[], Any], after_failure: Callable[[], Any] = lambda: None) -> Optional[Exception]:
    """Run ``write``; the exception it raised (after ``after_failure``), or None."""
    try:
        write()
    except (OSError, RuntimeError) as error:  # torch's writer reports a full disk as a RuntimeError
        after_failure()
        return error
    return None


def raise_if_any_failed(failure: Optional[Exception], save_dir: str, tag: str) -> None:
    """Collective: if ``failure`` happened on any rank, remove the half-written tag (rank 0, once every rank
    has stopped writing) and raise CheckpointSaveError on every rank, naming the folder, the space and ENOSPC."""
    flags = torch.tensor([failure is not None, getattr(failure, "errno", None) == errno.ENOSPC], dtype=torch.int64,
                         device=collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if not flags[0].item():
        return
    tag_dir = os.path.join(save_dir, tag)
    # every rank's message the same: the free space as the rank that saw the least (other writers to the same disk
    # change it between the ranks' looks); the folders measured are no longer written (every rank has stopped)
    free = torch.tensor([shutil.disk_usage(save_dir).free], dtype=torch.int64, device=collective_device())
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    written, free = folder_bytes(tag_dir), int(free.item())
    latest = read_latest(save_dir)
    previous = folder_bytes(os.path.join(save_dir, latest)) if latest and latest != tag else 0
    needed = f"about {previous} bytes (the size of {latest})" if previous else f"more than the {written} bytes written"
    no_space = flags[1].item() or free < NEARLY_FULL_BYTES  # torch's writer loses the errno: "iostream error"
    why = "no space left on device (ENOSPC)" if no_space else f"{type(failure).__name__}: {failure}"
    dist.barrier()  # every rank has measured
    if dist.get_rank() == 0:
        shutil.rmtree(tag_dir, ignore_errors=True)
    dist.barrier()
    raise CheckpointSaveError(
        f"saving {tag_dir} failed: {why}; {free} bytes free in {save_dir}, a checkpoint needs {needed}. The "
        f"half-written {tag} was removed and 'latest' still names {latest or 'nothing'}; free some space (or pass "
        f"another --save) and resume with --load {save_dir}") from failure


def folder_bytes(folder: str) -> int:
    """The bytes of the files under ``folder`` (0 if it does not exist)."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def load_checkpoint(engine, load_dir: str, tag: str, *, load_optimizer_states: bool = True) -> dict[str, Any]:
    """Load ``tag`` of ``load_dir`` into the engine (weights, optimizer, DeepSpeed's own state) and return
    our client state."""
    # No grad: DeepSpeed re-broadcasts tied weights after loading them (see engine/pipeline.py's
    # build_pipeline_module for why that must not be seen by autograd).
    with torch.no_grad():
        path, client_state = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                                    load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {os.path.join(load_dir, tag)}")
    return client_state
