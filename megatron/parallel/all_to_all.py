"""The autograd all-to-all with uneven splits that expert parallelism exchanges tokens with.

    all_to_all(x, group, output_splits, input_splits)   forward: all-to-all   backward: all-to-all back
    start_all_to_all(x, group, output_splits, input_splits) -> (rows, in_flight)
    wait_all_to_all(rows, in_flight) -> rows            the same exchange split in two: started without
                                                        waiting, waited for where its rows are needed
    take_exchange_stats()                               the exchanges since the last call: count, bytes, and
                                                        the host time spent blocked in them

Rank i sends rows ``x[sum(input_splits[:j]) : ... + input_splits[j]]`` to rank j and receives
``output_splits[j]`` rows from rank j, in rank order. Its adjoint is the same exchange with the splits swapped.
gloo and NCCL both implement ``all_to_all_single`` with uneven splits. A group of ``None`` is one rank: the
identity.

The split form lets computation run while the rows travel (``--overlap-moe-expert-parallel-comm``,
``moe.dispatch.alltoall_experts``). ``start_all_to_all`` hands back the output buffer, not yet filled, and the
exchange in flight; only ``wait_all_to_all`` may read the buffer (it waits, then passes the rows on). Backward
runs the adjoint the same way round: ``wait_all_to_all``'s backward starts the exchange of the gradient back,
``start_all_to_all``'s backward waits for it, so the work autograd runs between the two nodes (those created between
them in the forward: it runs the nodes created last first) overlaps it too. gloo runs an exchange started with
``async_op`` on its own worker threads; NCCL on its own stream.

``take_exchange_stats`` counts what ``EXCHANGES`` gathered: on CPU the blocked time is the communication not
hidden behind computation; on CUDA the host does not wait for an exchange (``wait`` orders streams), so it says
nothing there.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron.parallel.state import group_size

__all__ = ["all_to_all", "all_to_all_counts", "start_all_to_all", "wait_all_to_all", "InFlight", "ExchangeStats",
           "take_exchange_stats"]


@dataclasses.dataclass
class ExchangeStats:
    """The all-to-alls of rows (forward and backward; not ``all_to_all_counts``) since the last
    ``take_exchange_stats``."""

    calls: int = 0
    bytes_sent: int = 0
    blocked_seconds: float = 0.0  # host time inside a blocking exchange, a start, or a wait


EXCHANGES = ExchangeStats()


def take_exchange_stats() -> ExchangeStats:
    """What the exchanges counted since the last call (``EXCHANGES`` counts afresh from now)."""
    taken = dataclasses.replace(EXCHANGES)
    EXCHANGES.calls, EXCHANGES.bytes_sent, EXCHANGES.blocked_seconds = 0, 0, 0.0
    return taken


def _exchange(x: torch.Tensor, group, output_splits: Sequence[int], input_splits: Sequence[int],
              async_op: bool = False):
    """The exchange (blocking: its output; ``async_op``: its output buffer and the work in flight)."""
    start = time.perf_counter()
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x, list(output_splits), list(input_splits), group=group, async_op=async_op)
    EXCHANGES.calls += 1
    EXCHANGES.bytes_sent += x.numel() * x.element_size()
    EXCHANGES.blocked_seconds += time.perf_counter() - start
    return (out, work) if async_op else out


def _wait(work) -> None:
    start = time.perf_counter()
    work.wait()
    EXCHANGES.blocked_seconds += time.perf_counter() - start


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all, backward: all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _exchange(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad_output):
        return _exchange(grad_output, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def all_to_all(x: torch.Tensor, group, output_splits: Sequence[int], input_splits: Sequence[int]) -> torch.Tensor:
    """x [n, ...] -> [sum(output_splits), ...]: rows exchanged over ``group`` (see the module docstring)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits))


class InFlight:
    """One exchange of ``start_all_to_all`` in flight: the forward's work, then the backward's (its buffers held
    until it is waited for)."""

    def __init__(self, group, output_splits: list[int], input_splits: list[int]):
        self.group, self.output_splits, self.input_splits = group, output_splits, input_splits
        self.work = None
        self.grad_work = None
        self.grad_held: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (gradient sent, buffer receiving)


class _StartAllToAll(torch.autograd.Function):
    """forward: the exchange started, its unfilled output returned; backward: waits for the gradient's exchange
    back that ``_WaitAllToAll``'s backward started, and returns it."""

    @staticmethod
    def forward(ctx, x, flight):
        ctx.flight = flight
        out, flight.work = _exchange(x, flight.group, flight.output_splits, flight.input_splits, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad_output):  # grad_output: the gradient already on its way (``grad_held``)
        flight = ctx.flight
        _wait(flight.grad_work)
        grad_input = flight.grad_held[1]
        flight.grad_work = flight.grad_held = None
        return grad_input, None


class _WaitAllToAll(torch.autograd.Function):
    """forward: waits for the exchange, then the rows; backward: starts the gradient's exchange back."""

    @staticmethod
    def forward(ctx, rows, flight):
        ctx.flight = flight
        _wait(flight.work)
        flight.work = None
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad_output):
        flight = ctx.flight
        grad_output = grad_output.contiguous()
        back, flight.grad_work = _exchange(grad_output, flight.group, flight.input_splits, flight.output_splits,
                                           async_op=True)
        flight.grad_held = (grad_output, back)
        return grad_output, None


def start_all_to_all(x: torch.Tensor, group, output_splits: Sequence[int],
                     input_splits: Sequence[int]) -> tuple[torch.Tensor, Optional[InFlight]]:
    """``all_to_all``'s exchange started: (the output buffer, unfilled until ``wait_all_to_all``; the exchange in
    flight). One rank: (x, None)."""
    if group_size(group) == 1:
        return x, None
    flight = InFlight(group, list(output_splits), list(input_splits))
    return _StartAllToAll.apply(x, flight), flight


def wait_all_to_all(rows: torch.Tensor, flight: Optional[InFlight]) -> torch.Tensor:
    """The rows of ``start_all_to_all``'s exchange, once it has arrived."""
    if flight is None:
        return rows
    return _WaitAllToAll.apply(rows, flight)


def all_to_all_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [g, c] (what this rank sends each of the g ranks) -> [g, c] (what each rank sends this one)."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
