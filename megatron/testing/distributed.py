"""Run a function on N local processes joined in a torch.distributed group (gloo on CPU).

    results = run_distributed(fn, world_size=4, args=(x,))   # fn(rank, world_size, *args) per rank

Each child initializes the default process group on a free loopback port with a bounded timeout,
calls ``fn`` and sends back its return value (picklable; tensors in it arrive as lists). A failing rank's traceback is re-raised
in the parent as :class:`DistributedTestError` naming the rank; a hang is killed after ``timeout``.
The default group (and anything ``fn`` left) is destroyed in ``finally`` so a child never lingers.

``start_method="fork"`` (the default on CPU) is fast because the children inherit the imported
modules; use "spawn" where CUDA is already initialized in the parent (fork would break it).
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from typing import Any, Callable, Optional, Sequence

import torch.multiprocessing as mp

__all__ = ["run_distributed", "find_free_port", "DistributedTestError"]


class DistributedTestError(AssertionError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain(value):
    """Tensors in a result become lists: a tensor sent back through the queue would be shared memory
    of a process that has exited by the time the parent reads it."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _child(fn, rank, world_size, port, backend, init_timeout_s, env, args, kwargs, queue):
    import torch
    import torch.distributed as dist

    # A forked child inherits the parent's OpenMP thread pool in a state it cannot use: once the parent
    # has run a multithreaded op, the child's first matmul can wait forever. One thread per rank also
    # suits several ranks sharing a few cores.
    torch.set_num_threads(1)
    os.environ.update(env)
    # gloo connects every pair of ranks inside init_process_group (and new_group), and a rank can finish
    # its side first: if fn then fails at once on that rank and it exits, a slower rank still connecting
    # dies with "Connection closed by peer" instead of reporting its own error. The store barrier torch
    # runs after each group's creation when this is set keeps every rank in until all are connected.
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=init_timeout_s))
        result = fn(rank, world_size, *args, **kwargs)
        queue.put((rank, True, _plain(result)))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    kwargs: Optional[dict] = None, backend: str = "gloo", timeout: float = 300.0,
                    init_timeout_s: float = 60.0, start_method: str = "fork",
                    env: Optional[dict] = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return results by rank.

    Raises DistributedTestError (an AssertionError, so pytest shows it as a test failure) if any
    rank raised, exited without reporting, or the whole run exceeded ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method == "fork":
        # Children inherit what the parent imported. torch._dynamo is imported lazily the first time an
        # optimizer is built (about 1 s alone, 10 s with 8 children on 2 busy cores): pay it once here.
        import torch._dynamo  # noqa: F401
    ctx = mp.get_context(start_method)
    queue = ctx.SimpleQueue()
    port = find_free_port()
    procs = [ctx.Process(target=_child, daemon=False,
                         args=(fn, rank, world_size, port, backend, init_timeout_s, dict(env or {}),
                               tuple(args), dict(kwargs or {}), queue))
             for rank in range(world_size)]
    for p in procs:
        p.start()

    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) + len(failures) < world_size:
            if datetime.datetime.now() > deadline:
                missing = sorted(set(range(world_size)) - set(results) - set(failures))
                failures.update({r: f"timed out after {timeout:.0f} s (hang?)" for r in missing})
                break
            if not queue.empty():
                rank, ok, payload = queue.get()
                (results if ok else failures)[rank] = payload
                if not ok:
                    # The other ranks are probably blocked in a collective with the failed one.
                    deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=10))
                continue
            dead = [r for r, p in enumerate(procs)
                    if not p.is_alive() and r not in results and r not in failures]
            if dead and queue.empty():
                for r in dead:
                    failures[r] = f"process exited with code {procs[r].exitcode} without reporting"
                # The others are probably waiting on the dead rank: give them a moment, then stop.
                deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=10))
            for p in procs:
                p.join(timeout=0.05)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()

    if failures:
        # Show real tracebacks before the "other ranks timed out" noise they usually cause.
        order = sorted(failures, key=lambda r: ("timed out" in failures[r], r))
        report = "\n".join(f"--- rank {r} of {world_size} failed ---\n{failures[r]}" for r in order)
        raise DistributedTestError(f"{len(failures)} of {world_size} ranks failed:\n{report}")
    return [results[r] for r in range(world_size)]
