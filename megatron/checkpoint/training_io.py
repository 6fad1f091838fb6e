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
previous complete checkpoint (``megatron.checkpoint.tags`` says which tag a resume reads).

The engine is duck-typed (its ``save_checkpoint`` / ``load_checkpoint``): nothing here imports deepspeed.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.checkpoint.integrity import record_checksums
from megatron.checkpoint.tags import (
    LATEST,
    RUN_STATE,
    prune_checkpoints,
    tag_for,
    write_atomically,
    write_complete_marker,
)
from megatron.parallel.random import RNGStatesTracker

__all__ = ["CLIENT_STATE_VERSION", "rng_state", "set_rng_state", "save_checkpoint", "load_checkpoint"]

CLIENT_STATE_VERSION = 1


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


def save_checkpoint(engine, save_dir: str, iteration: int, client_state: dict[str, Any],
                    run_state: dict[str, Any], keep_last_n: Optional[int] = None) -> str:
    """Write the checkpoint of ``iteration`` on every rank, then move ``latest`` to it. Collective.

    ``run_state`` (JSON: architecture, layout, tokenizer, progress) is written beside DeepSpeed's
    files as ``run_state.json``, readable without unpickling anything; ``keep_last_n`` prunes older
    complete checkpoints once the new one is complete.
    """
    tag = tag_for(iteration)
    state = dict(client_state, client_state_version=CLIENT_STATE_VERSION, iteration=iteration)
    engine.save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=False)
    dist.barrier()
    tag_dir = os.path.join(save_dir, tag)
    record_checksums(tag_dir)  # collective: each rank hashes its share of the files
    if dist.get_rank() == 0:
        files = os.listdir(tag_dir)
        empty = [f for f in files if os.path.getsize(os.path.join(tag_dir, f)) == 0]
        if not any(f.endswith("model_states.pt") for f in files) or empty:
            raise RuntimeError(f"checkpoint {tag_dir} is incomplete after saving (files: {sorted(files)}); "
                               f"'latest' still names the previous checkpoint")
        write_atomically(os.path.join(tag_dir, RUN_STATE), json.dumps(run_state, indent=1, sort_keys=True))
        write_complete_marker(tag_dir, str(iteration))
        write_atomically(os.path.join(save_dir, LATEST), tag)
        if keep_last_n:
            prune_checkpoints(save_dir, keep_last_n)
    dist.barrier()
    return tag


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
