"""Per-file checksums of a checkpoint: recorded at save time, verified before loading.

``TAG/checksums.json`` maps every file under the tag (DeepSpeed's and ours, except itself, the marker
and run_state.json; a universal checkpoint's per-parameter folders too) to its size and SHA-256. A flipped bit, a
truncated, emptied or missing file is
then named (file and tag) instead of loading as plausible numbers or failing with an anonymous
``EOFError``. The hashing is shared out: file i of the sorted list goes to rank i % world size
(a collective over the default group when ``distributed``), so a 2.5 TB checkpoint is read once in
all, not once per rank. Checkpoints written before this existed have no checksums: nothing to verify.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import torch.distributed as dist

from megatron.checkpoint.tags import COMPLETE_MARKER, RUN_STATE, write_atomically

CHECKSUMS = "checksums.json"
_NOT_HASHED = (CHECKSUMS, COMPLETE_MARKER, RUN_STATE)
_CHUNK = 1 << 20


def file_digest(path: str) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def _share(names: list[str], distributed: bool) -> list[str]:
    if not distributed:
        return names
    return names[dist.get_rank()::dist.get_world_size()]


def _gather(part: dict, distributed: bool) -> dict:
    if not distributed:
        return part
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in p.items()}


def _files(tag_dir: str) -> list[str]:
    """Every file under ``tag_dir`` as a path relative to it ('/'-separated; a universal checkpoint keeps
    one folder per parameter), except our bookkeeping files and hidden ones."""
    names = []
    for folder, subfolders, files in os.walk(tag_dir):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        relative = os.path.relpath(folder, tag_dir)
        for name in files:
            path = name if relative == "." else f"{relative.replace(os.sep, '/')}/{name}"
            if path not in _NOT_HASHED and not name.startswith("."):
                names.append(path)
    return sorted(names)


def record_checksums(tag_dir: str, distributed: bool = True, known: Optional[dict] = None) -> dict:
    """Hash every file under ``tag_dir`` (shared out over the ranks); the last rank-0 write before the marker.
    ``known``: this rank's digests of files it hashed as it wrote them (``--async-save``'s writer): gathered, and
    only the other files are read."""
    known = {} if known is None else _gather(dict(known), distributed)
    names = [name for name in _files(tag_dir) if name not in known]
    sums = _gather({name: file_digest(os.path.join(tag_dir, name)) for name in _share(names, distributed)},
                   distributed)
    sums.update(known)
    if not distributed or dist.get_rank() == 0:
        write_atomically(os.path.join(tag_dir, CHECKSUMS), json.dumps(sums, indent=1, sort_keys=True))
    return sums


def verify_checksums(tag_dir: str, distributed: bool = True, names: Optional[list[str]] = None) -> list[str]:
    """What does not match ``checksums.json`` (all ranks get the same list); [] when it all does, or when
    the tag has no checksums (written before they existed). ``names``: only these files."""
    path = os.path.join(tag_dir, CHECKSUMS)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        try:
            recorded = json.load(f)
        except ValueError as error:
            return [f"{path} is not valid JSON ({error})"]
    wanted = sorted(recorded if names is None else [n for n in names if n in recorded])
    problems = {}
    for name in _share(wanted, distributed):
        file = os.path.join(tag_dir, name)
        if not os.path.isfile(file):
            problems[name] = f"{file} is missing"
            continue
        size = os.path.getsize(file)
        if size != recorded[name]["bytes"]:
            problems[name] = f"{file} has {size} bytes, {recorded[name]['bytes']} when saved (truncated?)"
        elif file_digest(file)["sha256"] != recorded[name]["sha256"]:
            problems[name] = f"{file} does not match its SHA-256 recorded at save time (corrupted)"
    return [problem for _, problem in sorted(_gather(problems, distributed).items())]
