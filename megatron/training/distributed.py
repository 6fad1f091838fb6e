"""Joining the job's process group, however it was launched.

- ``torchrun`` / ``python -m torch.distributed.run`` and the DeepSpeed launcher set RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
- ``srun python pretrain_gpt.py`` (one task per GPU, no launcher) sets SLURM_PROCID, SLURM_NTASKS,
  SLURM_LOCALID and SLURM_JOB_NODELIST: the master is the allocation's first host;
- a plain ``python pretrain_gpt.py`` is a world of one on loopback.
The variables DeepSpeed reads later (RANK, LOCAL_RANK, ...) are set from whichever was found.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import socket

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``node[003-005,010],gpu7`` -> ``node003``."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST {nodelist!r}")
    prefix, ranges = match.group(1), match.group(3)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_launch(env: dict | None = None) -> LaunchInfo:
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                          env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
        port = int(env.get("MASTER_PORT", 20000 + job_id % 20000))
        return LaunchInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                          env.get("MASTER_ADDR", first_slurm_host(nodelist)), port, "slurm")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return LaunchInfo(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", port)), "single")


def init_process_group(backend: str, timeout_minutes: float = 10.0) -> LaunchInfo:
    """Initialize torch.distributed's default group from the launch environment (idempotent)."""
    info = detect_launch()
    os.environ.update({"RANK": str(info.rank), "WORLD_SIZE": str(info.world_size),
                       "LOCAL_RANK": str(info.local_rank), "MASTER_ADDR": info.master_addr,
                       "MASTER_PORT": str(info.master_port)})
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size,
                                init_method=f"tcp://{info.master_addr}:{info.master_port}",
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    return info
