"""What the log line adds while tuning: per-phase timers across ranks and memory, Megatron-LM's names.

Timers (--timing-log-level, --timing-log-option): each rank sums its phases over a log interval
(megatron.engine.timers); ``gather_timers`` collects every rank's sums (one all-gather of a few
floats, on every rank, at the log interval), ``format_timers`` writes them as Megatron does (max,
(min, max) or every rank) and TensorBoard gets the max as '<name>-time', ms per iteration.

Memory (--log-memory-to-tensorboard): CUDA's allocator statistics under Megatron-LM's tags, or on
CPU the process's resident set size (RSS), for the rank that writes TensorBoard.
"""

from __future__ import annotations

import resource
import sys
from typing import Optional

import torch
import torch.distributed as dist

from megatron.parallel.state import collective_device

# Every timer name this project measures, by the level that turns it on. Megatron-LM's names; only
# 'train-batch' is ours: DeepSpeed's pipeline engine runs forward, backward, the pipeline's sends,
# the gradient reductions and the optimizer in one call that cannot be split from outside.
TIMER_LEVELS = {"train-batch": 1, "forward-backward": 1, "optimizer": 1, "optimizer-inner-step": 1,
                "batch-generator": 2, "forward-compute": 2, "backward-compute": 2}
TIMER_NAMES = tuple(TIMER_LEVELS)


def gather_timers(elapsed_ms: dict[str, float], num_iterations: int) -> dict[str, list[tuple[int, float]]]:
    """Per timer name, [(rank, ms per iteration)] of the ranks that ran it (a pipeline's middle stages
    read no batches). A collective: every rank calls it with its own sums."""
    unknown = set(elapsed_ms) - set(TIMER_NAMES)
    assert not unknown, f"timers without a level in TIMER_LEVELS: {sorted(unknown)}"
    mine = torch.tensor([elapsed_ms.get(name, -1.0) for name in TIMER_NAMES], dtype=torch.float64,
                        device=collective_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
    else:
        rows = [mine]
    table = torch.stack(rows).cpu()  # [ranks, timers]
    out = {}
    for column, name in enumerate(TIMER_NAMES):
        ran = [(rank, float(table[rank, column]) / num_iterations)
               for rank in range(table.shape[0]) if table[rank, column] >= 0]
        if ran:
            out[name] = ran
    return out


def format_timers(per_rank: dict[str, list[tuple[int, float]]], option: str) -> str:
    """The timers' part of the log line, e.g. 'max time across ranks (ms): optimizer: 3.20 (rank 1) |'."""
    if not per_rank:
        return ""
    parts = []
    for name, ran in per_rank.items():
        if option == "max":
            rank, ms = max(ran, key=lambda rank_ms: rank_ms[1])
            parts.append(f"{name}: {ms:.2f} (rank {rank})")
        elif option == "minmax":
            values = [ms for _, ms in ran]
            parts.append(f"{name}: ({min(values):.2f}, {max(values):.2f})")
        else:
            parts.append(f"{name}: " + ", ".join(f"rank {rank} {ms:.2f}" for rank, ms in ran))
    title = {"max": "max time across ranks (ms)", "minmax": "(min, max) time across ranks (ms)",
             "all": "times across ranks (ms)"}[option]
    return f" {title}: " + " | ".join(parts) + " |"


def timer_scalars(per_rank: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """TensorBoard's timer scalars: the max across ranks, ms per iteration, as Megatron-LM's timers.write."""
    return {f"{name}-time": max(ms for _, ms in ran) for name, ran in per_rank.items()}


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux
        return None


def memory_scalars(device: Optional[torch.device] = None) -> dict[str, float]:
    """This process's memory: on CUDA Megatron-LM's four tags plus the reserved peak, the peaks since the
    previous call (they are reset here); on CPU the current RSS and its peak since the process began."""
    if device is not None and device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        torch.cuda.reset_peak_memory_stats(device)
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-max-reserved-bytes": stats["reserved_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"]}
    # ru_maxrss is in KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    out = {"mem-max-rss-bytes": float(peak)}
    current = _rss_bytes()
    if current is not None:
        out["mem-rss-bytes"] = float(current)
    return out
