"""ParallelState: the tensor / pipeline / data-parallel process groups of one rank.

The rank layout is exactly DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)``:
axes (pipe, data, model) with the model (tensor-parallel) axis innermost, i.e.

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so that our tensor-parallel layers and DeepSpeed's pipeline engine agree on who is who.
Groups are handed to layers explicitly; nothing here reads globals or the environment.

A group of ``None`` everywhere in ``megatron.parallel`` means "no parallelism on this axis"
(size 1, collectives are the identity), never the default WORLD group.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.distributed as dist

__all__ = ["ParallelState", "GroupLayout", "group_layout", "group_size", "group_rank"]


def group_size(group) -> int:
    """Number of ranks in ``group``; ``None`` means a group of one."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index inside ``group``; ``None`` means a group of one."""
    return 0 if group is None else dist.get_rank(group)


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """The global ranks of every group for a (tp, pp, dp) layout. Pure data, no torch.distributed."""

    tp: int
    pp: int
    dp: int
    tensor: list[list[int]]      # one list per (pipe, data): the TP group, consecutive ranks
    pipeline: list[list[int]]    # one list per (data, model): ranks of the stages, first to last
    data: list[list[int]]        # one list per (pipe, model)
    model: list[list[int]]       # one list per data index: every TP x PP rank of one model replica
    embedding: list[list[int]]   # first and last pipeline stage of each pipeline (one rank if pp == 1)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return pp_rank, dp_rank, tp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank


def _check_sizes(tp: int, pp: int, dp: int, world_size: Optional[int]) -> None:
    for name, value in (("tensor-model-parallel size", tp), ("pipeline-model-parallel size", pp),
                        ("data-parallel size", dp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size is not None and tp * pp * dp != world_size:
        raise ValueError(
            f"world size {world_size} != tensor-model-parallel size {tp} x pipeline-model-parallel "
            f"size {pp} x data-parallel size {dp} = {tp * pp * dp}; choose sizes whose product is "
            f"the number of processes")


def group_layout(tp: int, pp: int, dp: int) -> GroupLayout:
    """Every group's ranks for the layout, in PipeModelDataParallelTopology's order."""
    _check_sizes(tp, pp, dp, None)
    rank = lambda p, d, t: (p * dp + d) * tp + t  # noqa: E731  (same formula as GroupLayout.rank_of)
    tensor = [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)]
    pipeline = [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
    data = [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    model = [[rank(p, d, t) for p in range(pp) for t in range(tp)] for d in range(dp)]
    embedding = [sorted({ranks[0], ranks[-1]}) for ranks in pipeline]
    return GroupLayout(tp, pp, dp, tensor, pipeline, data, model, embedding)


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """This rank's place in a (tp, pp, dp) layout and the process groups it belongs to.

    Build with :meth:`create` after ``torch.distributed`` is initialized (every rank must call it,
    since creating a group is collective), or :meth:`single` for one process without any groups.
    """

    layout: GroupLayout
    rank: int
    tp_group: Optional[object] = None         # tensor-model-parallel group
    pp_group: Optional[object] = None         # pipeline group
    dp_group: Optional[object] = None         # data-parallel group
    model_group: Optional[object] = None      # TP x PP ranks of one model replica
    embedding_group: Optional[object] = None  # first + last stage (tied embedding); None if not a member

    # ---- sizes and coordinates -------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def in_embedding_group(self) -> bool:
        return self.is_first_stage or self.is_last_stage

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def single(cls) -> "ParallelState":
        """One process, no parallelism: every group is None (size 1)."""
        return cls(layout=group_layout(1, 1, 1), rank=0)

    @classmethod
    def create(cls, tp: int, pp: int, dp: Optional[int] = None, backend: Optional[str] = None
               ) -> "ParallelState":
        """Create the groups over the initialized world. ``dp`` defaults to world / (tp * pp).

        Collective: every rank of the world must call it with the same sizes.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first "
                               "(or use ParallelState.single() for one process)")
        world_size = dist.get_world_size()
        if dp is None:
            if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
                raise ValueError(
                    f"world size {world_size} is not divisible by tensor-model-parallel size {tp} x "
                    f"pipeline-model-parallel size {pp} = {tp * pp}; the data-parallel size would not "
                    f"be a whole number")
            dp = world_size // (tp * pp)
        _check_sizes(tp, pp, dp, world_size)
        layout = group_layout(tp, pp, dp)
        rank = dist.get_rank()

        def mine(all_ranks: list[list[int]]):
            # new_group is collective over the world: every rank creates every group in the same
            # order and keeps the one it belongs to. Groups of one rank are left as None.
            found = None
            for ranks in all_ranks:
                group = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
                if rank in ranks:
                    found = group
            return found

        return cls(layout=layout, rank=rank,
                   tp_group=mine(layout.tensor), pp_group=mine(layout.pipeline),
                   dp_group=mine(layout.data), model_group=mine(layout.model),
                   embedding_group=mine(layout.embedding))

    def destroy(self) -> None:
        """Destroy the groups this rank holds (the default group is left to the caller)."""
        seen = set()
        for group in (self.tp_group, self.pp_group, self.dp_group, self.model_group,
                      self.embedding_group):
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                dist.destroy_process_group(group)

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.rank}, tp={self.tp_rank}/{self.tp_size}, "
                f"pp={self.pp_rank}/{self.pp_size}, dp={self.dp_rank}/{self.dp_size})")
