"""Joining the job's process group, however it was launched (``megatron.config.launch`` reads who
this process is; the variables DeepSpeed reads later, RANK, LOCAL_RANK, ..., are set from it).

Under torchrun, ``job_store()`` is then torchrun's own key-value store, unprefixed: the one store every attempt of
the job shares (``megatron.training.restarts`` keeps the job's progress there across restarts).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron.config.launch import LaunchInfo, detect_launch

_job_store = None  # torchrun's store, shared by every attempt of the job (set by init_process_group)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_group_timeout(minutes: float) -> None:
    """Every process group made from now on without a timeout of its own (DeepSpeed's pipeline, data-
    and model-parallel groups, ours) waits at most ``minutes`` in a collective: torch takes such a
    group's timeout from these two module defaults (30 min for gloo, 10 for NCCL otherwise)."""
    timeout = datetime.timedelta(minutes=minutes)
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


def init_process_group(backend: str, timeout_minutes: float = 10.0) -> LaunchInfo:
    """Initialize torch.distributed's default group from the launch environment (idempotent), every
    group's collectives bounded by ``timeout_minutes`` (--distributed-timeout-minutes)."""
    set_group_timeout(timeout_minutes)
    info = detect_launch()
    if info.master_port is None:  # a world of one: any free port
        info = dataclasses.replace(info, master_port=_free_port())
    os.environ.update({"RANK": str(info.rank), "WORLD_SIZE": str(info.world_size),
                       "LOCAL_RANK": str(info.local_rank), "MASTER_ADDR": info.master_addr,
                       "MASTER_PORT": str(info.master_port)})
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        global _job_store
        timeout = datetime.timedelta(minutes=timeout_minutes)
        _job_store = _agent_store(info, timeout)
        store = _attempt_store(_job_store)
        if store is not None:
            dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size, store=store,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size,
                                    init_method=f"tcp://{info.master_addr}:{info.master_port}", timeout=timeout)
    return info


def job_store():
    """torchrun's key-value store, which every attempt of the job shares (--max-restarts); None when this process
    was not started by torchrun with its agent's store, or before ``init_process_group``."""
    return _job_store


def _agent_store(info: LaunchInfo, timeout: datetime.timedelta):
    """Under torchrun (its agent's store, TORCHELASTIC_USE_AGENT_STORE): a client of that store, else None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    return dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=False, timeout=timeout)


def _attempt_store(store):
    """torchrun's store seen through a prefix of this attempt (TORCHELASTIC_RESTART_COUNT), or None without it.
    torchrun keeps one store for every attempt of the job: without the prefix, workers restarted after a failure
    (--max-restarts) read the previous attempt's keys (the dead ranks' gloo addresses: "Gloo connectFullMesh failed
    ... Connection refused", or a wait that never ends) instead of their peers'."""
    if store is None:
        return None
    return dist.PrefixStore(f"/megatron/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
