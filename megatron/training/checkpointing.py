"""Saving and resuming through DeepSpeed, in the pipeline engine's layout (BLOOM's):

    SAVE/latest                                   the tag of the last COMPLETE checkpoint
    SAVE/global_stepN/layer_XX-model_YY-model_states.pt
    SAVE/global_stepN/mp_rank_YY_model_states.pt  (holds our client state)
    SAVE/global_stepN/bf16_zero_pp_rank_*_optim_states.pt (bf16) or the plain optimizer state

    SAVE/global_stepN/run_state.json              architecture, layout, tokenizer, progress (JSON)

Crash safety: DeepSpeed writes the tag's files with ``save_latest=False``; every rank then waits
at a barrier, rank 0 checks that each expected file is there and non-empty, writes
``run_state.json`` and then a ``complete`` marker inside the tag, and only then replaces ``latest``
atomically (write a temporary file, then rename). A kill at any point leaves ``latest`` naming the
previous complete checkpoint; a ``latest`` naming an incomplete tag (edited by hand, or copied
half-way) makes ``--load`` fall back to the newest complete checkpoint, with a warning.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.parallel.random import RNGStatesTracker

CLIENT_STATE_VERSION = 1
COMPLETE_MARKER = "complete"
RUN_STATE = "run_state.json"
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"  # written by ds_to_universal


def tag_for(iteration: int) -> str:
    return f"global_step{iteration}"


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


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_complete_marker(tag_dir: str, text: str) -> None:
    """Mark a checkpoint folder as finished (the last file written into it)."""
    _write_atomically(os.path.join(tag_dir, COMPLETE_MARKER), f"{text}\n")


def read_latest(load_dir: str, pointer: str = "latest") -> Optional[str]:
    path = os.path.join(load_dir, pointer)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def is_complete(load_dir: str, tag: str) -> bool:
    return os.path.isfile(os.path.join(load_dir, tag, COMPLETE_MARKER))


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
    if dist.get_rank() == 0:
        tag_dir = os.path.join(save_dir, tag)
        files = os.listdir(tag_dir)
        empty = [f for f in files if os.path.getsize(os.path.join(tag_dir, f)) == 0]
        if not any(f.endswith("model_states.pt") for f in files) or empty:
            raise RuntimeError(f"checkpoint {tag_dir} is incomplete after saving (files: {sorted(files)}); "
                               f"'latest' still names the previous checkpoint")
        _write_atomically(os.path.join(tag_dir, RUN_STATE), json.dumps(run_state, indent=1, sort_keys=True))
        write_complete_marker(tag_dir, str(iteration))
        _write_atomically(os.path.join(save_dir, LATEST), tag)
        if keep_last_n:
            prune_checkpoints(save_dir, keep_last_n)
    dist.barrier()
    return tag


def complete_tags(load_dir: str) -> list[str]:
    """The complete ``global_stepN`` tags of ``load_dir``, oldest first."""
    tags = []
    for name in os.listdir(load_dir) if os.path.isdir(load_dir) else []:
        match = re.fullmatch(r"global_step(\d+)", name)
        if match and is_complete(load_dir, name):
            tags.append((int(match.group(1)), name))
    return [name for _, name in sorted(tags)]


def prune_checkpoints(save_dir: str, keep_last_n: int) -> list[str]:
    """Delete all but the newest ``keep_last_n`` complete checkpoints; never the one ``latest`` names."""
    latest = read_latest(save_dir)
    doomed = [t for t in complete_tags(save_dir)[:-keep_last_n] if t != latest]
    for tag in doomed:
        # Remove the marker first: a crash halfway leaves an incomplete folder, never a "complete" one.
        os.remove(os.path.join(save_dir, tag, COMPLETE_MARKER))
        shutil.rmtree(os.path.join(save_dir, tag))
    return doomed


def resolve_tag(load_dir: str, universal: bool = False) -> Optional[str]:
    """The tag to resume from: the one ``latest`` (``latest_universal``) names if it is complete, else
    the newest complete checkpoint, with a warning; None when ``load_dir`` holds no checkpoint."""
    pointer = LATEST_UNIVERSAL if universal else LATEST
    tag = read_latest(load_dir, pointer)
    if tag is not None and is_complete(load_dir, tag):
        return tag
    if universal:
        raise RuntimeError(f"--universal-checkpoint: {load_dir} has no complete universal checkpoint "
                           f"('{LATEST_UNIVERSAL}' names {tag!r}); convert one first with "
                           f"tools/convert_checkpoint/ds_to_universal.py")
    fallback = complete_tags(load_dir)
    if tag is None and not fallback:
        return None
    if not fallback:
        raise RuntimeError(f"checkpoint {os.path.join(load_dir, tag)} has no '{COMPLETE_MARKER}' marker (a crash "
                           f"during the save?) and {load_dir} holds no complete checkpoint to fall back to")
    warnings.warn(f"'latest' in {load_dir} names {tag!r}, which is not a complete checkpoint; "
                  f"falling back to the newest complete one, {fallback[-1]}")
    return fallback[-1]


def read_run_state(load_dir: str, tag: str) -> dict[str, Any]:
    path = os.path.join(load_dir, tag, RUN_STATE)
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} is missing: {os.path.join(load_dir, tag)} was not written by this project "
                           f"(or by a version before run_state.json existed)")
    with open(path) as f:
        return json.load(f)


def load_checkpoint(engine, load_dir: str, tag: str, *, load_optimizer_states: bool = True) -> dict[str, Any]:
    """Load ``tag`` of ``load_dir`` into the engine (weights, optimizer, DeepSpeed's own state) and return
    our client state."""
    path, client_state = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                                load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {os.path.join(load_dir, tag)}")
    return client_state


# Fields that must agree between a checkpoint and the run loading it (the others may change:
# dropout, init std, seed...). The padded vocabulary may grow when a universal checkpoint is loaded
# on a layout that pads more; it may never shrink.
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                       "position_embedding_type", "embed_layernorm", "layernorm_epsilon", "max_position_embeddings")


def check_model_config(saved: dict[str, Any], current: dict[str, Any], universal: bool = False) -> None:
    """Raise ValueError naming the first architecture field that differs."""
    for name in ARCHITECTURE_FIELDS:
        if name in saved and saved[name] != current.get(name):
            raise ValueError(f"the checkpoint was trained with {name} = {saved[name]!r} but this run has "
                             f"{current.get(name)!r}: the architectures differ; fix --{name.replace('_', '-')} "
                             f"or load another checkpoint")
    saved_vocab, vocab = saved.get("padded_vocab_size"), current.get("padded_vocab_size")
    if saved_vocab is not None and (vocab < saved_vocab if universal else vocab != saved_vocab):
        raise ValueError(f"the checkpoint's padded vocabulary has {saved_vocab} rows, this run's {vocab}: set "
                         f"--pad-vocab-size-to {saved_vocab} (or a --make-vocab-size-divisible-by that gives it)")
