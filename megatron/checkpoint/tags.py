"""A checkpoint folder's names and markers: tags, ``latest``, the ``complete`` marker, pruning.

    SAVE/latest                                   the tag of the last COMPLETE checkpoint
    SAVE/latest_universal                         the same for universal checkpoints (ds_to_universal)
    SAVE/global_stepN/complete                    written last, once every rank has saved
    SAVE/global_stepN/run_state.json              architecture, layout, tokenizer, progress (JSON)
    SAVE/global_stepN/...                         DeepSpeed's files (``megatron.checkpoint.training_io``)

One rule for which tag is read, for training (--load) and the tools alike (``resolve_tag``): an
explicit tag must be complete; otherwise the one ``latest`` names if it is complete (or, with a
warning, if another tool wrote it: Megatron-DeepSpeed writes neither run_state.json nor a marker),
else the newest complete ``global_stepN`` with a warning (``latest`` edited by hand, or copied half-way).
Plain file logic: imports neither torch nor deepspeed.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Optional

COMPLETE_MARKER = "complete"
RUN_STATE = "run_state.json"
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"  # written by ds_to_universal


class CheckpointFormatError(ValueError):
    """A checkpoint directory that is missing, incomplete or inconsistent."""


def tag_for(iteration: int) -> str:
    return f"global_step{iteration}"


def tag_number(tag: str) -> int:
    """N of ``global_stepN`` (-1 for any other name)."""
    match = re.fullmatch(r"global_step(\d+)", tag)
    return int(match.group(1)) if match else -1


def write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:  # a full disk: leave no partial temporary file behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_complete_marker(tag_dir: str, text: str) -> None:
    """Mark a checkpoint folder as finished (the last file written into it)."""
    write_atomically(os.path.join(tag_dir, COMPLETE_MARKER), f"{text}\n")


def read_latest(load_dir: str, pointer: str = "latest") -> Optional[str]:
    path = os.path.join(load_dir, pointer)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def is_complete(load_dir: str, tag: str) -> bool:
    return os.path.isfile(os.path.join(load_dir, tag, COMPLETE_MARKER))


def is_foreign(load_dir: str, tag: str) -> bool:
    """A tag another tool wrote (Megatron-DeepSpeed): DeepSpeed's files, and none of our markers in the
    whole folder. A folder of ours holds a complete tag once its first save finished (and ``latest``
    is written only then), so a save of ours that died half-way is never taken for a foreign one."""
    tag_dir = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(tag_dir, "mp_rank_00_model_states.pt")):
        return False
    ours = [name for name in os.listdir(load_dir)
            if os.path.exists(os.path.join(load_dir, name, RUN_STATE)) or is_complete(load_dir, name)]
    return not ours


def _warn_foreign(load_dir: str, tag: str) -> None:
    warnings.warn(f"{os.path.join(load_dir, tag)} was not written by this project (no {RUN_STATE}; Megatron-DeepSpeed "
                  f"writes no '{COMPLETE_MARKER}' marker): read as it is, its completeness cannot be checked")


def complete_tags(load_dir: str) -> list[str]:
    """The complete ``global_stepN`` tags of ``load_dir``, oldest first."""
    names = os.listdir(load_dir) if os.path.isdir(load_dir) else []
    return sorted((n for n in names if tag_number(n) >= 0 and is_complete(load_dir, n)), key=tag_number)


def prune_checkpoints(save_dir: str, keep_last_n: int) -> list[str]:
    """Delete all but the newest ``keep_last_n`` complete checkpoints; never the one ``latest`` names."""
    latest = read_latest(save_dir)
    doomed = [t for t in complete_tags(save_dir)[:-keep_last_n] if t != latest]
    for tag in doomed:
        # Remove the marker first: a crash halfway leaves an incomplete folder, never a "complete" one.
        os.remove(os.path.join(save_dir, tag, COMPLETE_MARKER))
        shutil.rmtree(os.path.join(save_dir, tag))
    return doomed


def resolve_tag(ckpt_dir: str, tag: Optional[str] = None, *, universal: bool = False,
                required: bool = False) -> Optional[str]:
    """The tag to read from ``ckpt_dir`` (see the module docstring for the rule).

    tag: an explicit tag, which must be a complete checkpoint of ``ckpt_dir``.
    universal: follow ``latest_universal`` (no fallback: a universal checkpoint is made on purpose).
    Returns None when ``ckpt_dir`` holds no checkpoint at all (a run that starts from scratch), or
    raises CheckpointFormatError then if ``required``.
    """
    if tag is not None:
        if not os.path.isdir(os.path.join(ckpt_dir, tag)):
            raise CheckpointFormatError(f"checkpoint tag {tag!r} is not a directory of {ckpt_dir!r}")
        if is_foreign(ckpt_dir, tag):
            _warn_foreign(ckpt_dir, tag)
        elif not is_complete(ckpt_dir, tag):
            raise CheckpointFormatError(f"checkpoint {os.path.join(ckpt_dir, tag)!r} has no '{COMPLETE_MARKER}' "
                                        f"marker: its save did not finish (a crash during the save?); use an "
                                        f"earlier tag")
        return tag
    if required and not os.path.isdir(ckpt_dir):
        raise CheckpointFormatError(f"checkpoint directory {ckpt_dir!r} does not exist; pass the --save directory "
                                    f"of a training run")
    pointer = LATEST_UNIVERSAL if universal else LATEST
    named = read_latest(ckpt_dir, pointer)
    if named is not None and is_complete(ckpt_dir, named):
        return named
    if named is not None and not universal and is_foreign(ckpt_dir, named):
        _warn_foreign(ckpt_dir, named)
        return named
    if universal:
        raise CheckpointFormatError(f"--universal-checkpoint: {ckpt_dir} has no complete universal checkpoint "
                                    f"('{LATEST_UNIVERSAL}' names {named!r}); convert one first with "
                                    f"tools/convert_checkpoint/ds_to_universal.py")
    fallback = complete_tags(ckpt_dir)
    if named is None and not fallback:
        if required:
            raise CheckpointFormatError(f"{ckpt_dir!r} holds no complete checkpoint (no '{LATEST}' file and no "
                                        f"complete global_stepN folder)")
        return None
    if not fallback:
        raise CheckpointFormatError(f"checkpoint {os.path.join(ckpt_dir, named)!r} has no '{COMPLETE_MARKER}' "
                                    f"marker (a crash during the save?) and {ckpt_dir} holds no complete "
                                    f"checkpoint to fall back to")
    warnings.warn(f"'{LATEST}' in {ckpt_dir} names {named!r}, which is not a complete checkpoint; "
                  f"falling back to the newest complete one, {fallback[-1]}")
    return fallback[-1]
