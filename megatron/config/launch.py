"""Who this process is in the job, as the launcher says it: rank, world size, local rank, master.

- ``torchrun`` / ``python -m torch.distributed.run`` and the DeepSpeed launcher set WORLD_SIZE, RANK,
  LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
- ``srun python pretrain_gpt.py`` (one task per GPU, no launcher) sets SLURM_NTASKS, SLURM_PROCID,
  SLURM_LOCALID and SLURM_JOB_NODELIST: the master is the allocation's first host;
- a plain ``python pretrain_gpt.py`` is a world of one on loopback.

Under ``srun ... torchrun`` (BLOOM's scripts: one SLURM task per node) torchrun's WORLD_SIZE wins
over SLURM_NTASKS (the number of nodes there). The argument checks (world size) and the process
group (``megatron.training.distributed``) both read this one function. Pure: the environment is
passed in (default ``os.environ``) and nothing is changed.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: Optional[int]  # None: a world of one, any free port will do
    launcher: str               # "torchrun", "slurm" or "single"


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


def _int(env: Mapping[str, str], name: str, default: Optional[int] = None) -> Optional[int]:
    value = env.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def detect_launch(env: Optional[Mapping[str, str]] = None) -> LaunchInfo:
    """The launch this process belongs to (see the module docstring for the precedence)."""
    env = os.environ if env is None else env
    if env.get("WORLD_SIZE"):
        return LaunchInfo(_int(env, "RANK", 0), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", 0),
                          env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT", 29500), "torchrun")
    if env.get("SLURM_NTASKS"):
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        port = _int(env, "MASTER_PORT", 20000 + _int(env, "SLURM_JOB_ID", 0) % 20000)
        return LaunchInfo(_int(env, "SLURM_PROCID", 0), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID", 0),
                          env.get("MASTER_ADDR", first_slurm_host(nodelist)), port, "slurm")
    return LaunchInfo(0, 1, 0, "127.0.0.1", _int(env, "MASTER_PORT"), "single")
