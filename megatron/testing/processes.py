"""Run a function on N local processes joined in a torch.distributed group (gloo on CPU).

    results = run_distributed(fn, world_size=4, args=(x,))   # fn(rank, world_size, *args) per rank

Each child initializes the default process group on a free loopback port with a bounded timeout,
calls ``fn`` and sends back its return value (picklable; tensors in it arrive as lists). A failing rank's
traceback is re-raised in the parent as :class:`DistributedTestError` naming the rank. A hang is stopped
after ``timeout`` seconds, and so is one the caller interrupts (pytest-timeout, Ctrl-C): either way every
rank still running first writes the stack of each of its threads (faulthandler), and the report shows them.
The default group (and anything ``fn`` left) is destroyed in ``finally`` so a child never lingers.

Children start from a fork server (``start_method="forkserver"``, the default): one clean interpreter,
started the first time a run needs it, that imports torch, DeepSpeed and this package once and forks every
rank from itself. A rank so starts nearly as fast as a fork of the caller, but inherits none of the caller's
threads. That matters: a process that ran ``torch.compile`` holds inductor's asynchronous compile pool, and
a rank forked from it that compiles anything new waits forever on a future of that pool (seen with a cold
inductor cache: > 400 s, where the same rank from the fork server compiles in seconds). Spawned ranks would
be safe too, but each imports torch and DeepSpeed anew (measured: a 4-rank launch 3.1-3.5 s against 0.6 s from
the running fork server, as from fork). ``fn`` and ``args`` are therefore pickled: ``fn`` must be importable (a
module-level function).
The caller's environment at the time of the call is what each rank sees, as with fork.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "find_free_port", "DistributedTestError"]

# What the fork server imports once, so that a rank forked from it starts with them imported (the training
# path's modules cost a rank about 0.4 s otherwise: 8 ranks on 2 cores, 1.6 s a launch). A module missing here
# is skipped by multiprocessing (ImportError is ignored while preloading). "__main__" imports a
# script run as ``python script.py`` (a benchmark) under its own name, so functions defined in it unpickle.
# DeepSpeed's first ZeRO support check probes its ops (deepspeed.ops.__compatible_ops__), importing distutils
# (setuptools'): 0.2-0.4 s a rank. (Its Muon module, which would import inductor, is replaced by a stand-in:
# megatron.engine.deepspeed_compat.skip_unused_muon_import.)
FORKSERVER_PRELOAD = ["__main__", "torch", "torch.distributed", "torch._dynamo", "deepspeed", "pytest",
                      "megatron.testing.processes", "megatron.arguments", "megatron.training.pretrain",
                      "megatron.inference.generation", "deepspeed.ops.op_builder", "deepspeed.module_inject",
                      "distutils.ccompiler", "distutils.sysconfig"]
# How long a hung rank gets to write its stacks once asked.
STACK_DUMP_WAIT_S = 3.0


class DistributedTestError(AssertionError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain(value):
    """Tensors in a result become lists: a tensor sent back through the queue would be shared memory
    of a process that has exited by the time the parent reads it."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _child(fn, rank, world_size, port, backend, init_timeout_s, environ, stack_file, args, kwargs, queue):
    # SIGUSR1 from the parent (a timeout) writes every thread's stack to this rank's file.
    stacks = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # One thread per rank: several ranks share a few cores, and extra intra-op threads only contend.
    torch.set_num_threads(1)
    os.environ.clear()
    os.environ.update(environ)
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


def _context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
    elif start_method == "fork":
        # Children inherit what the parent imported. torch._dynamo is imported lazily the first time an
        # optimizer is built (about 1 s alone, 10 s with 8 children on 2 busy cores): pay it once here.
        import torch._dynamo  # noqa: F401, PLC0415 (imported for its cost: paid once here, only for fork children)
    return ctx


def _stacks_of(procs, stack_files, ranks) -> dict[int, str]:
    """Ask each rank in ``ranks`` that still runs for its threads' stacks; what each wrote, by rank.

    faulthandler's handler is C code that writes at once, even while the rank's main thread is blocked
    inside a C call (a collective, a lock): the files fill within milliseconds."""
    asked = [r for r in ranks if procs[r].is_alive()]
    if not asked:  # the usual case, a run that ended: no wait
        return {}
    for r in asked:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STACK_DUMP_WAIT_S
    time.sleep(0.5)
    while time.monotonic() < deadline and not all(os.path.getsize(stack_files[r]) for r in asked):
        time.sleep(0.1)
    stacks = {}
    for r in asked:
        with open(stack_files[r]) as f:
            stacks[r] = f.read().strip() or "(no stack written: the process did not answer SIGUSR1)"
    return stacks


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    kwargs: Optional[dict] = None, backend: str = "gloo", timeout: float = 300.0,
                    init_timeout_s: float = 60.0, start_method: str = "forkserver",
                    env: Optional[dict] = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return results by rank.

    Raises DistributedTestError (an AssertionError, so pytest shows it as a test failure) if any
    rank raised, exited without reporting, or the whole run exceeded ``timeout`` seconds (then with the
    stacks of the ranks still running). ``env`` is added to the caller's environment in every rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context(start_method)
    queue = ctx.SimpleQueue()
    port = find_free_port()
    environ = {**os.environ, **(env or {})}
    stack_dir = tempfile.TemporaryDirectory(prefix="run_distributed_stacks_")
    stack_files = [os.path.join(stack_dir.name, f"rank{rank}.txt") for rank in range(world_size)]
    procs = [ctx.Process(target=_child, daemon=False,
                         args=(fn, rank, world_size, port, backend, init_timeout_s, environ, stack_files[rank],
                               tuple(args), dict(kwargs or {}), queue))
             for rank in range(world_size)]
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        for p in procs:
            p.start()
        _collect(procs, queue, results, failures, world_size, timeout)
        hung = [r for r, text in failures.items() if text.startswith("timed out")]
        for r, stack in _stacks_of(procs, stack_files, hung).items():
            failures[r] += f"\nits threads' stacks when it was stopped:\n{stack}"
    except BaseException:
        # Interrupted from outside (pytest-timeout's signal, Ctrl-C): show where every rank was, then stop them.
        for r, stack in _stacks_of(procs, stack_files, range(world_size)).items():
            print(f"--- rank {r} of {world_size} was still running; its threads' stacks ---\n{stack}",
                  file=sys.stderr, flush=True)
        raise
    finally:
        grace = time.monotonic() + 5  # for all of them together: a rank that reported exits at once
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=max(0.0, grace - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        stack_dir.cleanup()

    if failures:
        # Show real tracebacks before the "other ranks timed out" noise they usually cause.
        order = sorted(failures, key=lambda r: ("timed out" in failures[r], r))
        report = "\n".join(f"--- rank {r} of {world_size} failed ---\n{failures[r]}" for r in order)
        raise DistributedTestError(f"{len(failures)} of {world_size} ranks failed:\n{report}")
    return [results[r] for r in range(world_size)]


def _collect(procs, queue, results: dict, failures: dict, world_size: int, timeout: float) -> None:
    """Read every rank's report into ``results`` / ``failures``; a rank silent past the deadline has timed out."""
    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < world_size:
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(results) - set(failures))
            failures.update({r: f"timed out after {timeout:.0f} s (hang?)" for r in missing})
            return
        if not queue.empty():
            rank, ok, payload = queue.get()
            (results if ok else failures)[rank] = payload
            if not ok:
                # The other ranks are probably blocked in a collective with the failed one.
                deadline = min(deadline, time.monotonic() + 10)
            continue
        dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in failures]
        if dead and queue.empty():
            for r in dead:
                failures[r] = f"process exited with code {procs[r].exitcode} without reporting"
            # The others are probably waiting on the dead rank: give them a moment, then stop.
            deadline = min(deadline, time.monotonic() + 10)
        for p in procs:
            p.join(timeout=0.05)
