"""ParallelState: the tensor / pipeline / data / sequence-parallel process groups of one rank.

The rank layout is exactly DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)``:
axes (pipe, data, model) with the model (tensor-parallel) axis innermost, i.e.

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so that our tensor-parallel layers and DeepSpeed's pipeline engine agree on who is who.

DeepSpeed-Ulysses (``--ds-sequence-parallel-size``, sp) adds an axis between data and model:

    rank = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank

The two axes that move the most bytes, TP (all-reduces of activations) and SP (all-to-alls of
q, k, v and the context), are the two innermost, so consecutive ranks (one node) hold them, as in
Megatron-DeepSpeed. With sp = 1 the layout is the one above. The sequence-data-parallel group (every
(dp, sp) rank of one (pipe, model) coordinate) is where DeepSpeed reduces gradients and shards ZeRO
state when sp > 1: every SP rank holds the same weights and sees other tokens of the same samples.
Groups are handed to layers explicitly; nothing here reads globals or the environment.

Context parallelism (``--context-parallel-size``, cp; ring attention, ``megatron.model.ring_attention``)
takes the same place as Ulysses' axis (the two are never combined): rank = ((pp_rank * dp + dp_rank) * cp +
cp_rank) * tp + tp_rank, Megatron-LM's order (TP innermost, then CP, then DP, then PP). Every CP rank holds
the same weights; gradients are reduced over the dp x cp ranks of one (pipe, model) coordinate (Megatron's
data-parallel-with-CP group), the ``sequence_data`` lists.

Expert parallelism (``--expert-model-parallel-size``, ep) is carved from the data-parallel ranks, as in
Megatron-LM and DeepSpeed: of the dp ranks of one (pipe, seq, model) coordinate, ranks d = e * ep + i
(i < ep) form an expert-model-parallel group (consecutive data ranks; each holds 1/ep of every MoE layer's
experts and they exchange tokens all-to-all), and ranks d = j * ep + i (j < dp / ep) of one i, over every
sequence rank s (Ulysses' or CP's: other tokens of the same samples), form the expert-data-parallel group (the
same experts on other data: where their gradients are averaged).

Expert tensor parallelism (``--expert-tensor-parallel-size``, etp; Megatron-LM's flag, default TP): with etp = 1 <
tp (which needs --sequence-parallel: every rank of a stage holds other tokens) the experts are not split over TP and
the stage's tp x seq x dp ranks are folded again in Megatron-LM's expert order (tp-ep-dp): with the stage-local
index l = rank - pp_rank * stage, etp_rank = l % etp, ep_rank = (l // etp) % ep, edp_rank = l // (etp * ep); the
expert-model-parallel group is the ep ranks of one (pp, edp, etp) coordinate, the expert-data-parallel group the
ranks of one (pp, ep, etp) coordinate. With etp = tp the groups are the ones above.

A group of ``None`` everywhere in ``megatron.parallel`` means "no parallelism on this axis"
(size 1, collectives are the identity), never the default WORLD group.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from megatron.config import parallel_dims

__all__ = ["ParallelState", "LayerGroups", "GroupLayout", "group_layout", "group_size", "group_rank",
           "collective_device", "all_reduce_on_host"]


def collective_device() -> torch.device:
    """Where a tensor made for a collective must live: this rank's GPU under NCCL (which has no CPU collectives:
    a CPU tensor there raises), else the CPU. For the host-side bookkeeping collectives (exit reasons, statistics,
    timers), whose tensors are made on the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_on_host(tensor: torch.Tensor, *groups, op=None) -> torch.Tensor:
    """``tensor`` (on the CPU) all-reduced over each of ``groups`` in turn (``op``: SUM by default), skipping groups
    of one; the result on the CPU. The reductions run on ``collective_device()``."""
    groups = [group for group in groups if group_size(group) > 1]
    if not groups:
        return tensor
    tensor = tensor.to(collective_device())
    for group in groups:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return tensor.cpu()


def group_size(group) -> int:
    """Number of ranks in ``group``; ``None`` means a group of one."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index inside ``group``; ``None`` means a group of one."""
    return 0 if group is None else dist.get_rank(group)


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """The global ranks of every group for a (tp, pp, dp, sp) layout. Pure data, no torch.distributed."""

    tp: int
    pp: int
    dp: int
    tensor: list[list[int]]      # one list per (pipe, data, seq): the TP group, consecutive ranks
    pipeline: list[list[int]]    # one list per (data, seq, model): ranks of the stages, first to last
    data: list[list[int]]        # one list per (pipe, seq, model)
    model: list[list[int]]       # one list per (data, seq): every TP x PP rank of one model replica
    embedding: list[list[int]]   # first and last pipeline stage of each pipeline (one rank if pp == 1)
    sp: int = 1                  # DeepSpeed-Ulysses sequence-parallel size
    sequence: list[list[int]] = dataclasses.field(default_factory=list)       # one per (pipe, data, model)
    sequence_data: list[list[int]] = dataclasses.field(default_factory=list)  # one per (pipe, model): dp x sp
    ep: int = 1                  # expert-model-parallel size (divides dp)
    expert: list[list[int]] = dataclasses.field(default_factory=list)         # ep consecutive data ranks
    expert_data: list[list[int]] = dataclasses.field(default_factory=list)    # dp / ep x seq ranks, stride ep
    cp: int = 1                  # context-parallel size (ring attention); the sequence axis when > 1
    etp: int = 0                 # expert-tensor-parallel size (0: tp, the experts split as the dense layers)
    stage: list[list[int]] = dataclasses.field(default_factory=list)  # one per pipe stage: its tp x seq x dp ranks
    token_shards: list[list[int]] = dataclasses.field(default_factory=list)  # one per (pipe, data): seq x tp ranks,
                                 # the shards of one micro-batch's tokens when each TP rank routes its own (etp < tp)

    @property
    def expert_tp(self) -> int:
        """The ranks each expert's matrices are split over (``etp``; tp where it is 0)."""
        return self.etp or self.tp

    def expert_coords(self, rank: int) -> tuple[int, int, int]:
        """(etp_rank, ep_rank, edp_rank) of a global rank."""
        pp_rank, dp_rank, tp_rank = self.coords(rank)
        if self.expert_tp == self.tp:
            return tp_rank, dp_rank % self.ep, dp_rank // self.ep
        local = rank - pp_rank * self.tp * self.seq * self.dp
        etp = self.expert_tp
        return local % etp, (local // etp) % self.ep, local // (etp * self.ep)

    @property
    def seq(self) -> int:
        """Ranks on the axis between data and model: Ulysses' sp or context parallelism's cp (one is 1)."""
        return self.sp * self.cp

    @property
    def world_size(self) -> int:
        return parallel_dims.world_size(dict(tp=self.tp, pp=self.pp, dp=self.dp, sp=self.sp, cp=self.cp))

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank (its sp_rank: :meth:`sp_rank_of`)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")
        tp_rank = rank % self.tp
        dp_rank = (rank // (self.tp * self.seq)) % self.dp
        pp_rank = rank // (self.tp * self.seq * self.dp)
        return pp_rank, dp_rank, tp_rank

    def sp_rank_of(self, rank: int) -> int:
        """The sequence-axis rank of a global rank (Ulysses' or, with cp > 1, context parallelism's): which slice
        of each sample's tokens it holds."""
        self.coords(rank)  # range check
        return (rank // self.tp) % self.seq

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, sp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.seq + sp_rank) * self.tp + tp_rank


def _check_sizes(tp: int, pp: int, dp: int, world_size: Optional[int], sp: int = 1, cp: int = 1) -> None:
    parallel_dims.check_world(dict(tp=tp, pp=pp, dp=dp, sp=sp, cp=cp), world_size)
    if sp > 1 and cp > 1:
        raise ValueError(f"DeepSpeed-Ulysses (sequence-parallel size {sp}) and context parallelism (size {cp}) "
                         f"both split the sequence; use one of the two")


def _check_expert_size(dp: int, ep: int, tp: int = 1, etp: Optional[int] = None, seq: int = 1) -> None:
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert-model-parallel size must be a positive integer, got {ep!r}")
    if etp is not None and etp != tp:
        if etp != 1:
            raise ValueError(f"--expert-tensor-parallel-size {etp}: only 1 or the TP size {tp} are built")
        if (tp * seq * dp) % ep:
            raise ValueError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} does not divide "
                             f"the {tp * seq * dp} ranks of a pipeline stage")
        return
    if dp % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the data-parallel size {dp}: expert "
                         f"parallelism is carved from the data-parallel ranks; use a divisor of {dp}")


def group_layout(tp: int, pp: int, dp: int, sp: int = 1, ep: int = 1, cp: int = 1,
                 etp: Optional[int] = None) -> GroupLayout:
    """Every group's ranks for the layout, in PipeModelDataParallelTopology's order (SP or CP between data and
    model; EP within data, or with ``etp`` (default tp) below tp, over the whole stage: the module docstring)."""
    _check_sizes(tp, pp, dp, None, sp, cp)
    _check_expert_size(dp, ep, tp, etp, sp * cp)
    seq = sp * cp  # the sequence axis: Ulysses' or context parallelism's
    rank = lambda p, d, s, t: ((p * dp + d) * seq + s) * tp + t  # noqa: E731  (GroupLayout.rank_of's formula)
    P, D, S, T = range(pp), range(dp), range(seq), range(tp)
    tensor = [[rank(p, d, s, t) for t in T] for p in P for d in D for s in S]
    pipeline = [[rank(p, d, s, t) for p in P] for d in D for s in S for t in T]
    data = [[rank(p, d, s, t) for d in D] for p in P for s in S for t in T]
    model = [[rank(p, d, s, t) for p in P for t in T] for d in D for s in S]
    embedding = [sorted({ranks[0], ranks[-1]}) for ranks in pipeline]
    sequence = [[rank(p, d, s, t) for s in S] for p in P for d in D for t in T]
    sequence_data = [[rank(p, d, s, t) for d in D for s in S] for p in P for t in T]
    E, J = range(ep), range(dp // ep)
    expert = [[rank(p, j * ep + i, s, t) for i in E] for p in P for s in S for t in T for j in J]
    expert_data = [[rank(p, j * ep + i, s, t) for j in J for s in S] for p in P for t in T for i in E]
    size = tp * seq * dp  # ranks per stage
    stage = [list(range(p * size, (p + 1) * size)) for p in P]
    if etp is not None and etp != tp:  # Megatron-LM's expert order tp-ep-dp over each stage's ranks
        X, EDP = range(etp), range(size // (etp * ep))
        at = lambda p, x, e, j: p * size + (j * ep + e) * etp + x  # noqa: E731  (the stage-local index inverted)
        expert = [[at(p, x, e, j) for e in E] for p in P for j in EDP for x in X]
        expert_data = [[at(p, x, e, j) for j in EDP] for p in P for e in E for x in X]
    token_shards = [[rank(p, d, s, t) for s in S for t in T] for p in P for d in D]
    return GroupLayout(tp, pp, dp, tensor, pipeline, data, model, embedding, sp, sequence, sequence_data, ep,
                       expert, expert_data, cp, 0 if etp is None or etp == tp else etp, stage, token_shards)


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """What one transformer layer works over, handed to it as one object (``ParallelState.layer_groups``); None
    on an axis: one rank there.

    tp: the tensor-parallel group (each layer's matrices split, whole heads per rank); cp: the context-parallel
    group (ring attention over this rank's load-balanced tokens); ep: the expert-model-parallel group (an MoE
    layer's experts shared out, tokens exchanged all-to-all); sequence_exchange: DeepSpeed-Ulysses' all-to-all
    around the core attention (``megatron.model.attention.SequenceExchange``, built from the sp group by
    ``megatron.engine.ulysses.ulysses_exchange``); tokens: the ranks holding other tokens of the same samples
    with the same weights after an MoE layer has gathered any sequence-parallel TP shards (CP's or Ulysses' sequence
    group: the group an MoE layer's aux and z losses are summed over; the TP group itself when ``experts_span_tp``).
    """

    tp: Optional[object] = None
    cp: Optional[object] = None
    ep: Optional[object] = None
    sequence_exchange: Optional[object] = None
    tokens: Optional[object] = None
    experts_span_tp: bool = False  # etp = 1 < tp: an MoE layer routes this TP rank's own sequence-parallel tokens
                                   # over ``ep`` (which then spans TP ranks) to whole experts
    routes_tp_shards: bool = False  # etp = tp with sequence parallelism (alltoall): an MoE layer routes this TP
                                    # rank's own tokens over ``ep``, then gathers the rows over TP for its TP-split
                                    # experts (Megatron-LM's order; ``tokens`` spans the TP, and seq, ranks)

    def __post_init__(self):
        if self.cp is not None and self.sequence_exchange is not None:
            raise ValueError("context parallelism and DeepSpeed-Ulysses both split the sequence; give a layer "
                             "a cp group or a sequence exchange, not both")


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
    sp_group: Optional[object] = None         # DeepSpeed-Ulysses sequence-parallel group (slices of one sample)
    sp_data_group: Optional[object] = None    # dp x sp (or dp x cp) ranks of one (pipe, model) coordinate (gradients,
                                              # ZeRO)
    ep_group: Optional[object] = None         # expert-model-parallel group (token all-to-all)
    expert_dp_group: Optional[object] = None  # expert-data-parallel group (the experts' gradients)
    cp_group: Optional[object] = None         # context-parallel group (ring attention over slices of one sample)
    stage_group: Optional[object] = None      # every rank of this pipeline stage; built only where each TP rank
                                              # routes other tokens (etp < tp, or ``moe_tp_shards``): the routers'
                                              # counts
    token_shard_group: Optional[object] = None  # the seq x tp ranks of one (pipe, data) coordinate; built only where
                                              # each TP rank routes its own tokens (etp < tp, ``moe_tp_shards``) and
                                              # the sequence is split (CP, Ulysses): an MoE layer's losses
    moe_tp_shards: bool = False               # MoE layers route each TP rank's own sequence-parallel tokens with
                                              # TP-split experts (``LayerGroups.routes_tp_shards``)

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
    def sp_size(self) -> int:
        return self.layout.sp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def cp_rank(self) -> int:
        return self.layout.sp_rank_of(self.rank) if self.cp_size > 1 else 0

    @property
    def seq_size(self) -> int:
        """Ranks splitting each sample's tokens: Ulysses' sp or context parallelism's cp (the other is 1)."""
        return self.layout.seq

    @property
    def seq_rank(self) -> int:
        return self.layout.sp_rank_of(self.rank)

    @property
    def seq_group(self):
        """The group of ranks splitting each sample's tokens (Ulysses' or CP's; None when seq_size is 1)."""
        return self.sp_group if self.sp_size > 1 else self.cp_group

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        return self.layout.expert_coords(self.rank)[1]

    @property
    def etp_size(self) -> int:
        """The ranks each expert is split over (--expert-tensor-parallel-size; the TP size by default)."""
        return self.layout.expert_tp

    @property
    def etp_rank(self) -> int:
        return self.layout.expert_coords(self.rank)[0]

    @property
    def edp_rank(self) -> int:
        """This rank's index in its expert-data-parallel group (0: the one that writes the expert files)."""
        return self.layout.expert_coords(self.rank)[2]

    @property
    def experts_span_tp(self) -> bool:
        """Whether the experts are split over fewer ranks than the dense layers (etp < tp: each TP rank routes and
        exchanges its own sequence-parallel tokens, its experts are whole)."""
        return self.etp_size != self.tp_size

    @property
    def routing_data_group(self):
        """The ranks routing other tokens with this stage's routers: dp x seq (the whole stage where each TP rank
        routes its own tokens: etp < tp, or ``moe_tp_shards``)."""
        return self.stage_group if self.experts_span_tp or self.moe_tp_shards else self.sp_data_group

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def sp_rank(self) -> int:
        return self.layout.sp_rank_of(self.rank) if self.sp_size > 1 else 0

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

    # ---- construction ----------------------------------------------------------------------
    def layer_groups(self, sequence_exchange: Optional[object] = None) -> LayerGroups:
        """The groups this rank's transformer layers work over (with Ulysses' ``sequence_exchange`` if given)."""
        span = self.experts_span_tp  # etp < tp: the TP (x seq) ranks hold the micro-batch's token shards
        shards = self.moe_tp_shards and not span  # the same shards, routed to TP-split experts
        tokens = self.seq_group
        if span or shards:
            tokens = self.token_shard_group if self.token_shard_group is not None else self.tp_group
        return LayerGroups(tp=self.tp_group, cp=self.cp_group, ep=self.ep_group, sequence_exchange=sequence_exchange,
                           tokens=tokens, experts_span_tp=span, routes_tp_shards=shards)

    @classmethod
    def single(cls) -> "ParallelState":
        """One process, no parallelism: every group is None (size 1)."""
        return cls(layout=group_layout(1, 1, 1), rank=0)

    @classmethod
    def create(cls, tp: int, pp: int, dp: Optional[int] = None, backend: Optional[str] = None, sp: int = 1,
               ep: int = 1, cp: int = 1, etp: Optional[int] = None, moe_tp_shards: bool = False) -> "ParallelState":
        """Create the groups over the initialized world. ``dp`` defaults to world / (tp * pp * sp * cp).
        ``moe_tp_shards``: MoE layers route each TP rank's own sequence-parallel tokens
        (``megatron.config.moe.routes_tp_shards``; needs tp > 1).

        Collective: every rank of the world must call it with the same sizes.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first "
                               "(or use ParallelState.single() for one process)")
        world_size = dist.get_world_size()
        if dp is None:
            dp = parallel_dims.divide_world(world_size, dict(tp=tp, pp=pp, sp=sp, cp=cp))
        _check_sizes(tp, pp, dp, world_size, sp, cp)
        layout = group_layout(tp, pp, dp, sp, ep, cp, etp)
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

        tp_group, pp_group, dp_group = mine(layout.tensor), mine(layout.pipeline), mine(layout.data)
        model_group, embedding_group, seq_group = mine(layout.model), mine(layout.embedding), mine(layout.sequence)
        return cls(layout=layout, rank=rank, tp_group=tp_group, pp_group=pp_group, dp_group=dp_group,
                   model_group=model_group, embedding_group=embedding_group,
                   sp_group=seq_group if sp > 1 else None, sp_data_group=mine(layout.sequence_data),
                   ep_group=mine(layout.expert) if ep > 1 else None,
                   expert_dp_group=mine(layout.expert_data) if ep > 1 else None,
                   cp_group=seq_group if cp > 1 else None,
                   stage_group=mine(layout.stage) if layout.etp or moe_tp_shards else None,
                   token_shard_group=mine(layout.token_shards) if (layout.etp or moe_tp_shards) and sp * cp > 1
                   else None,
                   moe_tp_shards=moe_tp_shards and tp > 1)

    def destroy(self) -> None:
        """Destroy the groups this rank holds (the default group is left to the caller)."""
        seen = set()
        for group in (self.tp_group, self.pp_group, self.dp_group, self.model_group,
                      self.embedding_group, self.sp_group, self.sp_data_group, self.ep_group, self.expert_dp_group,
                      self.cp_group, self.stage_group, self.token_shard_group):
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                dist.destroy_process_group(group)

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.rank}, tp={self.tp_rank}/{self.tp_size}, "
                f"pp={self.pp_rank}/{self.pp_size}, dp={self.dp_rank}/{self.dp_size}"
                + (f", sp={self.sp_rank}/{self.sp_size}" if self.sp_size > 1 else "")
                + (f", cp={self.cp_rank}/{self.cp_size}" if self.cp_size > 1 else "")
                + (f", ep={self.ep_rank}/{self.ep_size})" if self.ep_size > 1 else ")"))
