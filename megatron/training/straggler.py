"""--log-straggler (Megatron-LM's): each rank's forward compute time, gathered every log interval; the fastest and
slowest ranks named.

    timer = ForwardTimer(engine.module)          # hooks around the model's forward calls (every micro-batch)
    per_rank = gather_per_rank(timer.take_ms() / iterations)   # a collective: [ms per iteration] by rank
    text, scalars = straggler_report(per_rank, count)

Synchronous data parallelism makes every rank's whole step equally long (the fast ranks wait in the gradient
reduction), so, as Megatron-LM's StragglerDetector does, the time of the model's forward calls is what is
compared: under data parallelism alone it holds no communication. Under tensor or pipeline parallelism it includes
their exchanges, and a pipeline stage's time is its own layers'. On CUDA the forward is timed with CUDA events (no
synchronisation in the step; the events are read at the log interval).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron.parallel.state import collective_device


class ForwardTimer:
    """The wall time (CUDA: event time) of ``module``'s forward calls, summed until ``take_ms``."""

    def __init__(self, module: torch.nn.Module, cuda: bool = False):
        self.cuda = cuda
        self.active = True  # False: forward calls are not timed (evaluations)
        self.total_ms = 0.0
        self._start = None
        self._events: list[tuple] = []
        self._handles = [module.register_forward_pre_hook(self._before),
                         module.register_forward_hook(self._after)]

    def _before(self, module, inputs) -> None:
        if not self.active:
            return
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def _after(self, module, inputs, output) -> None:
        if self._start is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self.total_ms += 1000.0 * (time.perf_counter() - self._start)
        self._start = None

    def take_ms(self) -> float:
        """The forward time since the last call, in ms."""
        for start, end in self._events:
            end.synchronize()
            self.total_ms += start.elapsed_time(end)
        self._events = []
        total, self.total_ms = self.total_ms, 0.0
        return total

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def gather_per_rank(ms_per_iteration: float) -> list[float]:
    """Every rank's number, by rank (a collective: every rank calls it)."""
    mine = torch.tensor([ms_per_iteration], dtype=torch.float64, device=collective_device())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [ms_per_iteration]
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [float(row.item()) for row in rows]


def straggler_report(per_rank: list[float], count: int) -> tuple[str, dict[str, float]]:
    """The log line's part and the scalars: the ``count`` fastest and slowest ranks (fewer when there are fewer
    ranks), e.g. ' forward compute per iteration (ms): fastest 12.1 (rank 0) | slowest 40.3 (rank 1) |'."""
    ranked = sorted(range(len(per_rank)), key=lambda rank: (per_rank[rank], rank))
    count = min(count, len(ranked))
    fastest, slowest = ranked[:count], ranked[::-1][:count]

    def named(ranks):
        return ", ".join(f"{per_rank[rank]:.1f} (rank {rank})" for rank in ranks)

    text = f" forward compute per iteration (ms): fastest {named(fastest)} | slowest {named(slowest)} |"
    scalars = {"straggler/fastest-rank-ms": per_rank[fastest[0]], "straggler/fastest-rank": float(fastest[0]),
               "straggler/slowest-rank-ms": per_rank[slowest[0]], "straggler/slowest-rank": float(slowest[0])}
    return text, scalars
