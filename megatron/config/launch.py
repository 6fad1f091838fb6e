"""Who this process is in the job, as the launcher says it: rank, world size, local rank, master.

- ``torchrun`` / ``python -m torch.distributed.run`` and the DeepSpeed launcher set WORLD_SIZE, RANK,
  LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
- ``srun python pretrain_gpt.py`` (one task per GPU, no launcher) sets SLURM_NTASKS, SLURM_PROCID,
  SLURM_LOCALID and SLURM_JOB_NODELIST: the master is the allocation's first host;
- a plain ``python pretrain_gpt.py`` is a world of one on loopback.

Under ``srun ... torchrun`` (BLOOM's scripts: one SLURM task per node) torchrun's WORLD_SIZE wins
over SLURM_NTASKS (the number of nodes there). The argument checks (world size) and the process
group (``megatron.training.distributed``) both read this one function. ``planned_world_size`` is
its counterpart before a job starts (``--dry-run``): how many processes the launch will make. Pure:
the environment is passed in (default ``os.environ``) and nothing is changed.
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


def planned_world_size(env: Optional[Mapping[str, str]] = None) -> tuple[int, str]:
    """The number of processes a job launched from this environment will have, and where it comes from.

    For checking a job before it starts (``pretrain_gpt.py --dry-run``), e.g. inside its allocation:

    - WORLD_SIZE: set by torchrun and the DeepSpeed launcher;
    - under SLURM, one task per node (``--ntasks-per-node=1``, BLOOM's sbatch scripts: each node's task
      runs ``torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $SLURM_NNODES``): nodes
      (SLURM_JOB_NUM_NODES, or its older name SLURM_NNODES) x GPUs per node: GPUS_PER_NODE, the scripts'
      own variable, when exported, else SLURM_GPUS_ON_NODE (what ``--gres=gpu:N`` allocated). The
      task count cannot be the world size here: it is the number of nodes;
    - under SLURM with more tasks than nodes (one task per GPU, ``srun python pretrain_gpt.py``):
      SLURM_NTASKS, as ``detect_launch`` counts the ranks of such a launch;
    - no launcher: a world of one.

    Raises ValueError when SLURM gives one task per node but not the number of GPUs per node.
    """
    env = os.environ if env is None else env
    if env.get("WORLD_SIZE"):
        return _int(env, "WORLD_SIZE"), "WORLD_SIZE (torchrun / DeepSpeed launcher)"
    nodes_var = next((name for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES") if env.get(name)), None)
    tasks = _int(env, "SLURM_NTASKS")
    if nodes_var is None:
        if tasks is not None:
            return tasks, "SLURM_NTASKS (one SLURM task per process)"
        return 1, "no launcher in the environment (a world of one)"
    nodes = _int(env, nodes_var)
    if tasks is not None and tasks > nodes:
        return tasks, f"SLURM_NTASKS (one SLURM task per process: {tasks} tasks on {nodes} nodes)"
    gpus_var = next((name for name in ("GPUS_PER_NODE", "SLURM_GPUS_ON_NODE") if env.get(name)), None)
    if gpus_var is None:
        raise ValueError(f"SLURM runs one task per node here ({nodes_var}={nodes}), so the world size is nodes x "
                         "GPUs per node, but neither GPUS_PER_NODE nor SLURM_GPUS_ON_NODE is set; export "
                         "GPUS_PER_NODE or pass --world-size")
    gpus = _int(env, gpus_var)
    return nodes * gpus, f"{nodes_var}={nodes} x {gpus_var}={gpus} (one torchrun per node, as BLOOM's scripts)"
