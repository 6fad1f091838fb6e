"""Context parallelism's sequence layout and its ring exchange (Megatron-LM's ``--context-parallel-size``).

Each of the c ranks of a context-parallel (CP) group holds 1/c of every sequence. The sequence is cut into 2c
equal chunks and rank i keeps chunks i and 2c-1-i: under a causal mask the late chunks see more keys than the
early ones, and pairing the i-th earliest with the i-th latest gives every rank the same attention work.

    load_balanced_positions(s, c, i)  the global token indices rank i holds, [s/c], ascending
    gather_sequence(x, group)         every rank's [b, s/c, ...] slice (ids, labels, masks, log-probabilities) back
                                      into [b, s, ...] order
    RingExchange                      send a list of tensors to the next rank of the group, receive the previous
                                      rank's (asynchronously: the caller computes on the current block meanwhile)

A group of ``None`` means one rank (no context parallelism). Nothing here reads globals.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron.parallel.state import group_rank, group_size

__all__ = ["RingExchange", "check_context_parallel_length", "load_balanced_positions", "gather_sequence"]


def check_context_parallel_length(seq_length: int, cp_size: int) -> None:
    """ValueError unless the sequence splits into 2 x cp_size equal chunks."""
    if cp_size > 1 and seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x context-parallel size {cp_size} = "
                         f"{2 * cp_size} (each rank holds two equal chunks); use a --seq-length that is a multiple "
                         f"of {2 * cp_size} or another --context-parallel-size")


def load_balanced_positions(seq_length: int, cp_size: int, cp_rank: int,
                            device: Optional[torch.device] = None) -> torch.Tensor:
    """Global indices [s/c] of the tokens CP rank ``cp_rank`` holds: chunks cp_rank and 2c-1-cp_rank of 2c."""
    check_context_parallel_length(seq_length, cp_size)
    if cp_size == 1:
        return torch.arange(seq_length, device=device)
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat((first, last))  # [s/c]


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """[b, s/c, ...] (this rank's load-balanced tokens, along dim 1) -> [b, s, ...], the whole sequence in order:
    every rank's slice all-gathered and put back at its ``load_balanced_positions``. No gradient (for token ids,
    labels and masks, e.g. the shifted targets of multi-token prediction, and the live harness's log-probabilities)."""
    c = group_size(group)
    if c == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(c)]
    dist.all_gather(parts, local.contiguous(), group=group)
    seq_length = local.shape[1] * c
    whole = torch.empty((local.shape[0], seq_length) + local.shape[2:], dtype=local.dtype, device=local.device)
    for rank, part in enumerate(parts):
        whole[:, load_balanced_positions(seq_length, c, rank, local.device)] = part
    return whole


class RingExchange:
    """Point-to-point ring over a CP group: each ``start`` sends to rank (r + 1) % c and receives from (r - 1) % c.

    After k exchanges a rank holds what rank (r - k) % c started with. gloo and NCCL both implement
    isend / irecv; the receive buffers are fresh tensors, so the caller may keep reading what it sent.
    """

    def __init__(self, group) -> None:
        self.group = group
        self.size, self.rank = group_size(group), group_rank(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else [0]
        self.next_rank = ranks[(self.rank + 1) % self.size]
        self.prev_rank = ranks[(self.rank - 1) % self.size]
        self._pending: list = []
        self._received: list[torch.Tensor] = []

    def start(self, tensors: Sequence[torch.Tensor]) -> None:
        """Begin sending ``tensors`` on and receiving the previous rank's (same shapes and dtypes)."""
        assert not self._pending, "wait() for the previous exchange first"
        self._received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = []
        for sent, received in zip(tensors, self._received):  # non-blocking both: no order can deadlock
            ops.append(dist.P2POp(dist.isend, sent.contiguous(), self.next_rank, self.group))
            ops.append(dist.P2POp(dist.irecv, received, self.prev_rank, self.group))
        self._pending = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        """The previous rank's tensors, once they have arrived."""
        for request in self._pending:
            request.wait()
        self._pending = []
        return self._received
