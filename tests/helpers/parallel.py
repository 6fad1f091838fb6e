"""Helpers of the tensor-parallel tests: seeded weights and inputs, relative errors, a test-side
gather, and running a worker on a TP group of gloo processes (or in this process for TP = 1)."""

import torch
import torch.distributed as dist

from megatron.parallel.state import ParallelState, group_size
from megatron.testing import run_distributed


def seeded_init(seed: int):
    """An init_method drawing normal(0, 0.02) from its own generator: same full weight on all ranks."""
    def init(weight):
        return torch.nn.init.normal_(weight, 0.0, 0.02, generator=torch.Generator().manual_seed(seed))
    return init


def randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (shapes must match)."""
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    scale = expected.detach().abs().max().clamp_min(1e-30)
    return ((actual.detach().float() - expected.detach().float()).abs().max() / scale).item()


def gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every TP rank's tensor along dim with plain torch.distributed (test-side)."""
    if group_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def run_on_tp(worker, tp: int, *args):
    """worker(tp_group, *args) on tp processes (or in this process with group None for tp=1)."""
    if tp == 1:
        return [worker(None, *args)]
    # A failing rank leaves the others blocked in a collective: keep the wait short.
    return run_distributed(_with_tp_group, world_size=tp, args=(worker, *args), timeout=60)


def _with_tp_group(rank, world_size, worker, *args):
    # A forked child must not enter the OpenMP pool the parent may have started (it waits forever
    # for threads that were not forked); one thread per rank is also right on a shared 2-core box.
    torch.set_num_threads(1)
    state = ParallelState.create(tp=world_size, pp=1)
    try:
        return worker(state.tp_group, *args)
    finally:
        state.destroy()
