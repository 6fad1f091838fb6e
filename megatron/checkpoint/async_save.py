"""``--async-save``: the step loop copies the state to host memory and goes on; a thread writes the files.

    saver = AsyncSaver(engine)            installs a HostCopyWriter as the engine's DeepSpeed checkpoint engine
    saver.save(save_dir, iteration, client_state, run_state, keep_last_n)   waits for the previous save, then
                                          copies this one's state to host memory and starts writing it
    saver.poll()                          after every step while a write is pending (collective): finishes the save
                                          once every rank's writer is done, or stops the run if one failed
    saver.wait()                          the end of training (SIGTERM's exit included): waits and finishes
    saver.abandon()                       a run ending on an error: waits for this rank's writer, finishes nothing

DeepSpeed's engine collects its state dicts and hands each file to ``checkpoint_engine.save(state_dict, path)``
(the pipeline engine's layer files too). ``HostCopyWriter.save`` copies every tensor's storage to host memory
(pinned where CUDA exists; storages shared between tensors stay shared, so the file is the one a synchronous
save writes) and every other object by ``copy.deepcopy``: later optimizer steps cannot change what is written.
The writer thread then saves each file with DeepSpeed's own engine (the same serialization), fsyncs it and its
folder, and hashes it for ``checksums.json``.

Finishing a save is what ``megatron.checkpoint.training_io.save_checkpoint`` does after its writes: every rank
has joined its writer (so every rank's files are durable) before the first collective of the finish, a failure
on any rank is agreed by the same all-reduce and raises the same ``CheckpointSaveError``, then the checksums
(the writers' digests, plus the files written outside the engine: the recovery script, MoE expert files),
``run_state.json``, the ``complete`` marker and ``latest``. A kill at any moment before leaves ``latest`` on the
previous complete tag. Duck-typed like training_io: nothing here imports deepspeed.
"""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.checkpoint.integrity import file_digest, record_checksums
from megatron.checkpoint.tags import tag_for
from megatron.checkpoint.training_io import (
    CLIENT_STATE_VERSION,
    CheckpointSaveError,
    attempt_write,
    commit_tag,
    raise_if_any_failed,
)
from megatron.parallel.state import collective_device

__all__ = ["AsyncSaver", "HostCopyWriter", "host_copy"]


def host_copy(obj: Any, memo: Optional[dict] = None, pool: Optional[dict] = None) -> Any:
    """``obj`` with every tensor's storage copied to host memory (pinned where CUDA exists) and every other object
    deep-copied. What ``obj`` shares stays shared in the copy (an object met twice is copied once; tensors viewing
    one storage view one copy, with their offsets and strides), so ``torch.save`` writes the same bytes. CUDA
    copies are asynchronous: ``torch.cuda.synchronize()`` before reading them.

    ``pool``: {(bytes, pinned): [free host buffers]}, the buffers of an earlier copy that has been written: a
    storage of the same size is copied into one of them instead of into new memory (fresh host memory costs its
    first touch, or a pinned allocation on CUDA: more than the copy). The buffers used are listed in
    ``memo["buffers"]``, to be handed back to the pool once the copy is no longer needed."""
    memo = {"deepcopy": {}} if memo is None else memo
    memo.setdefault("pool", pool)
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out = _tensor_copy(obj, memo)
    elif type(obj) in (dict, OrderedDict):
        out = memo[id(obj)] = type(obj)()
        out.update((key, host_copy(value, memo)) for key, value in obj.items())
    elif type(obj) is list:
        out = memo[id(obj)] = []
        out.extend(host_copy(value, memo) for value in obj)
    elif type(obj) is tuple:
        out = tuple(host_copy(value, memo) for value in obj)
    else:
        out = copy.deepcopy(obj, memo["deepcopy"])
    memo[id(obj)] = out
    return out


def _tensor_copy(tensor: torch.Tensor, memo: dict) -> torch.Tensor:
    storage = tensor.untyped_storage()
    key = ("storage", storage.device, storage.data_ptr())
    if storage.nbytes() == 0 or key not in memo:
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        pinned = source.device.type == "cuda"
        free = (memo.get("pool") or {}).get((storage.nbytes(), pinned))
        host = free.pop() if free else torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
        memo.setdefault("buffers", []).append((host, pinned))
        host.copy_(source.detach(), non_blocking=pinned)
        memo[key] = host.untyped_storage()
    out = torch.empty(0, dtype=tensor.dtype).set_(memo[key], tensor.storage_offset(), tensor.size(), tensor.stride())
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=tensor.requires_grad)
    return out.requires_grad_(tensor.requires_grad) if tensor.is_leaf else out


class HostCopyWriter:
    """A DeepSpeed checkpoint engine (duck-typed; anything not here is the wrapped engine's: load, makedirs, ...):
    ``save`` keeps a host copy of the state dict, ``start`` writes the copies in a thread with the wrapped engine's
    ``save`` (fsync and SHA-256 of each file), ``join`` waits for it. A written copy's host buffers go to ``pool``,
    which the next save's copies reuse (``host_copy``): one checkpoint's share of host memory stays allocated."""

    def __init__(self, inner):
        self.inner = inner
        self.pool: dict[tuple[int, bool], list[torch.Tensor]] = {}  # touched by the thread only while it runs
        self.queued: list[tuple[str, Any, list]] = []
        self.thread: Optional[threading.Thread] = None
        self.finished = threading.Event()  # set by the thread once it has written every file or failed
        self.finished.set()
        self.error: Optional[Exception] = None
        self.digests: dict[str, dict] = {}  # path -> {"bytes", "sha256"}
        self.name = "HostCopyWriter"

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def is_decoupled(self) -> bool:
        return False

    def create(self, info) -> None:
        self.inner.create(info)

    def commit(self, info) -> bool:  # DeepSpeed's "all files handed over": nothing is on disk yet (see AsyncSaver)
        return True

    def save(self, state_dict, path: str) -> None:
        memo = {"deepcopy": {}}
        copied = host_copy(state_dict, memo, self.pool)
        self.queued.append((path, copied, memo.get("buffers", [])))

    def start(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned copies are complete before the thread reads them
        files, self.queued = self.queued, []
        self.error, self.digests = None, {}
        self.finished.clear()
        self.thread = threading.Thread(target=self._write, args=(files,), name="async-save-writer", daemon=True)
        self.thread.start()

    def discard(self) -> None:
        self.queued = []

    def _write(self, files: list[tuple[str, Any]]) -> None:
        folders = set()
        try:
            while files:
                path, state, buffers = files.pop(0)
                self.inner.save(state, path)
                del state  # written: its host buffers are free for the next save's copies
                for buffer, pinned in buffers:
                    self.pool.setdefault((buffer.numel(), pinned), []).append(buffer)
                _fsync(path)
                folders.add(os.path.dirname(path))
                self.digests[path] = file_digest(path)
            for folder in sorted(folders):
                _fsync(folder)
        except Exception as error:  # noqa: BLE001 - any failure of the thread is the save's (a full disk, most often)
            self.error = error
        finally:
            self.finished.set()

    def done(self) -> bool:
        return self.finished.is_set()

    def join(self) -> Optional[Exception]:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        return self.error


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AsyncSaver:
    """``--async-save`` for one engine (see the module docstring). Every method is collective."""

    def __init__(self, engine):
        deepspeed_engine = getattr(engine, "engine", engine)  # ZeRO-2/3: the DeepSpeedEngine inside a ModelEngine
        self.engine = engine
        # the safe-loading torch engine (megatron.engine.deepspeed_compat.use_safe_loading refuses any other)
        self.writer = HostCopyWriter(deepspeed_engine.checkpoint_engine)
        deepspeed_engine.checkpoint_engine = self.writer
        self.pending: Optional[tuple] = None  # (save_dir, tag, iteration, run_state, keep_last_n)

    def save(self, save_dir: str, iteration: int, client_state: dict[str, Any], run_state: dict[str, Any],
             keep_last_n: Optional[int] = None) -> str:
        """Wait for the previous save, copy this one's state to host memory and start writing it; the tag."""
        self.wait()
        tag = tag_for(iteration)
        state = dict(client_state, client_state_version=CLIENT_STATE_VERSION, iteration=iteration)
        failure = attempt_write(lambda: self.engine.save_checkpoint(save_dir, tag=tag, client_state=state,
                                                                    save_latest=False),
                                after_failure=dist.barrier)
        try:
            raise_if_any_failed(failure, save_dir, tag)
        except CheckpointSaveError:
            self.writer.discard()  # another rank's copy failed: nothing of this save is written
            raise
        self.writer.start()
        self.pending = (save_dir, tag, iteration, run_state, keep_last_n)
        return tag

    def poll(self) -> Optional[str]:
        """After a step: finish the pending save if every rank's writer is done (or stop the run if one failed);
        the tag finished, else None. One small all-reduce while a save is pending, nothing otherwise."""
        if self.pending is None:
            return None
        flags = torch.tensor([not self.writer.done(), self.writer.done() and self.writer.error is not None],
                             dtype=torch.int64, device=collective_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item() and not flags[1].item():
            return None
        return self._finish()

    def wait(self) -> Optional[str]:
        """Wait for the pending save's writers and finish it; the tag finished, else None."""
        return self._finish() if self.pending is not None else None

    def abandon(self) -> None:
        """The run is ending on an error: wait for this rank's writer (no collective), leave its tag incomplete."""
        if self.pending is not None:
            self.pending = None
            self.writer.join()

    def _finish(self) -> str:
        save_dir, tag, iteration, run_state, keep_last_n = self.pending
        self.pending = None
        failure = self.writer.join()  # this rank's files are durable (or failed) before the first collective
        raise_if_any_failed(failure, save_dir, tag)
        tag_dir = os.path.join(save_dir, tag)
        written = {os.path.relpath(path, tag_dir).replace(os.sep, "/"): digest
                   for path, digest in self.writer.digests.items()}
        record_checksums(tag_dir, known=written)  # collective: the writers' digests, the other files hashed
        failure = None
        if dist.get_rank() == 0:
            failure = attempt_write(lambda: commit_tag(save_dir, tag, iteration, run_state, keep_last_n))
        raise_if_any_failed(failure, save_dir, tag)
        return tag
