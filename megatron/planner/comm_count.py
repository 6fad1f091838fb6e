"""Count the collectives and point-to-point messages of a training step, measured and analytic.

Measured: :class:`CollectiveRecorder` replaces the ``torch.distributed`` functions in this process
with wrappers that record (operation, group ranks, elements, bytes) and call the original.
DeepSpeed's ``deepspeed.comm`` calls ``torch.distributed.<op>`` by attribute at call time, and our
own layers use ``dist.<op>``, so both are seen. Each call is attributed to an axis by comparing its
group's ranks with the layout's groups (``megatron.parallel.state.group_layout``); a send or recv
by its peer. Bytes are per rank: what this rank hands to the call (its input tensor; for
all-gather-into-tensor the local shard; for send the message).

Analytic: :func:`analytic_step_counts` gives the calls and bytes one rank should issue in one
``train_batch`` for the GPT / BLOOM model in megatron.model on DeepSpeed's pipeline engine with
BF16_Optimizer (formulas in docs/performance.md):

  TP   per micro-batch and transformer layer: 2 all-reduces of s*b*h activations in forward
       (attention and MLP output, row-parallel), 2 in backward (input gradients of the
       column-parallel QKV and h->4h), +1 per layer with recomputation (the attention output's; the
       replay stops before the MLP's, see below); first stage +1 (the
       vocab-parallel embedding, forward), last stage +1 (the output head's input gradient,
       backward) and the vocab-parallel cross-entropy: 2 all-reduces (max: s*b, sums: 3*s*b, fp32).
  PP   per micro-batch: stage i < p-1 sends its output activation s*b*h forward, stage i > 0 sends
       the gradient s*b*h backward (each counted once, by the sender; the receiver's recv too).
  DP   BF16_Optimizer: all-reduce of each optimizer group's fp32 gradient buffer (numel padded to
       a multiple of 2*d) after the last micro-batch, all-gather of the updated bf16 weights
       (each rank contributes its 1/d shard); the last stage all-reduces the mean loss over DP.
  EMB  PP > 1: the tied word embedding's fp32 gradient (v/t * h) all-reduced between first and last stage.
  SP   --sequence-parallel (``StepShape.sequence_parallel``) replaces each layer's TP all-reduces: per
       micro-batch and layer 4 all-gathers of the s/t*b*h shard (forward: inputs of QKV and h->4h;
       backward: the adjoints of the two reduce-scatters) and 4 reduce-scatters of s*b*h partial sums
       (forward: attention and MLP outputs; backward: the gathered inputs' gradients); recomputation
       replays 2 all-gathers and 1 reduce-scatter per layer (it stops before the MLP's). The first stage
       keeps the embedding's all-reduce and all-gathers the scattered output's gradient; the last stage
       all-gathers the final norm's output for the head (backward: a reduce-scatter) instead of the
       head's all-reduce. Every replicated parameter used on the shards (norm weights and biases, the
       row-parallel biases) all-reduces its gradient (h values) once per micro-batch. The pipeline sends
       each rank's own shard unpartitioned (s/t*b*h per message, no TP all-gather).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Optional

from megatron.parallel.state import GroupLayout

WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
           "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "send", "recv", "isend",
           "irecv", "barrier", "all_reduce_coalesced", "all_to_all_single")
P2P = ("send", "recv", "isend", "irecv")
# torch 2.13's names of the tensor collectives (megatron.parallel.mappings calls them where they exist), recorded
# under the older names DeepSpeed calls, so the counts do not depend on the torch version
ALIASES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
WRAPPED += tuple(ALIASES)


@dataclasses.dataclass(frozen=True)
class CallRecord:
    op: str
    axis: str          # tp | sp | pp | dp | sp_dp | embedding | model | world | self | other
    ranks: tuple       # the group's global ranks (p2p: (me, peer))
    numel: int
    nbytes: int


def classify(op: str, ranks: tuple, layout: GroupLayout) -> str:
    """Which axis a call over ``ranks`` (a p2p call: (me, peer)) belongs to."""
    ranks = tuple(sorted(ranks))
    if len(ranks) == 1:
        return "self"
    if op in P2P:
        a, b = ranks
        return "pp" if any(a in g and b in g for g in layout.pipeline) else "other"
    # With PP = 2 the embedding group (first + last stage) IS the pipeline group: an all-reduce
    # there is the tied-embedding gradient, a broadcast the pipeline's loss.
    pipeline_first = op != "all_reduce"
    # sp_dp: the data-parallel x sequence-parallel ranks of one TP rank (what ZeRO shards over under Ulysses;
    # the data-parallel group without it, and the sequence-parallel group at DP 1, which match first)
    named = (("tp", layout.tensor), ("sp", layout.sequence), ("pp", layout.pipeline if pipeline_first else []),
             ("embedding", layout.embedding), ("pp", layout.pipeline), ("dp", layout.data),
             ("sp_dp", layout.sequence_data), ("model", layout.model))
    for axis, groups in named:
        if any(tuple(sorted(g)) == ranks for g in groups):
            return axis
    if ranks == tuple(range(layout.world_size)):
        return "world"
    return "other"


def _tensor_of(op: str, args, kwargs):
    for key in ("tensor", "input_tensor", "input", "tensor_list", "tensors", "input_tensor_list"):
        if key in kwargs:
            return kwargs[key]
    if op in ("all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
              "reduce_scatter_tensor", "_reduce_scatter_base", *ALIASES):
        return args[1] if len(args) > 1 else None
    return args[0] if args else None


def _size(tensor) -> tuple[int, int]:
    if tensor is None:
        return 0, 0
    if isinstance(tensor, (list, tuple)):
        sizes = [_size(t) for t in tensor]
        return sum(s[0] for s in sizes), sum(s[1] for s in sizes)
    return tensor.numel(), tensor.numel() * tensor.element_size()


_RECORDERS: list = []  # the recorders entered in this process, innermost last


class CollectiveRecorder:
    """Record the torch.distributed calls made while ``active`` (patched for the recorder's lifetime).

        with CollectiveRecorder(layout) as rec:
            rec.active = True; engine.train_batch(it); rec.active = False
        rec.summary()   # {(axis, op): {"calls": n, "bytes": b, "numel": e}}
    """

    def __init__(self, layout: GroupLayout):
        self.layout = layout
        self.records: list[CallRecord] = []
        self.active = False
        # groups the layout does not know, checked first: {axis: [ranks, ...]} (ZeRO++'s hpZ groups)
        self.extra_groups: dict[str, list[tuple]] = {}
        self._originals: dict[str, object] = {}

    def __enter__(self) -> "CollectiveRecorder":
        import torch.distributed as dist  # noqa: PLC0415 (the planner runs without torch; only the recorder patches torch.distributed)

        _RECORDERS.append(self)
        for name in WRAPPED:
            original = getattr(dist, name, None)
            if original is None or getattr(original, "_recorder_wrapped", False):
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist  # noqa: PLC0415 (the planner runs without torch; only the recorder patches torch.distributed)

        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
        _RECORDERS.remove(self)

    def _group_ranks(self, op: str, args, kwargs) -> tuple:
        import torch.distributed as dist  # noqa: PLC0415 (the planner runs without torch; only the recorder patches torch.distributed)

        me = dist.get_rank()
        if op in P2P:
            peer = kwargs.get("dst", kwargs.get("src"))
            if peer is None:
                peer = args[1] if len(args) > 1 else None
            return (me, int(peer))
        group = kwargs.get("group")
        if group is None:
            positional = {"all_reduce": 2, "broadcast": 2, "reduce": 3, "all_gather": 2, "all_gather_into_tensor": 2,
                          "_all_gather_base": 2, "reduce_scatter": 3, "reduce_scatter_tensor": 3,
                          "_reduce_scatter_base": 3, "barrier": 0, "all_reduce_coalesced": 2,
                          "all_gather_single": 2, "reduce_scatter_single": 3}
            index = positional.get(op)
            if index is not None and len(args) > index and not isinstance(args[index], (int, float)):
                group = args[index]
        if group is None or group is dist.GroupMember.WORLD:
            return tuple(range(dist.get_world_size()))
        return tuple(dist.get_process_group_ranks(group))

    def _wrap(self, op: str, original):
        # The wrapper records into whichever recorder is current when it is CALLED, not the one that
        # made it: DeepSpeed's TorchBackend caches torch.distributed.all_gather_into_tensor when it
        # is initialized, so a wrapper can outlive its recorder (a second run in the same process).
        # Hence also: enter the recorder before deepspeed.init_distributed, or that call is unseen.
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            current = _RECORDERS[-1] if _RECORDERS else None
            if current is not None and current.active:
                numel, nbytes = _size(_tensor_of(op, args, kwargs))
                ranks = current._group_ranks(op, args, kwargs)
                name = ALIASES.get(op, op)
                axis = next((a for a, groups in current.extra_groups.items()
                             if any(tuple(sorted(g)) == tuple(sorted(ranks)) for g in groups)), None)
                axis = axis or classify(name, ranks, current.layout)
                current.records.append(CallRecord(name, axis, ranks, numel, nbytes))
            return original(*args, **kwargs)

        wrapper._recorder_wrapped = True
        return wrapper

    def summary(self) -> dict:
        return summarize(self.records)


def summarize(records) -> dict:
    out: dict = collections.defaultdict(lambda: {"calls": 0, "bytes": 0, "numel": 0})
    for r in records:
        entry = out[(r.axis, r.op)]
        entry["calls"] += 1
        entry["bytes"] += r.nbytes
        entry["numel"] += r.numel
    return dict(out)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What the analytic count needs about the model and the run (one rank's view)."""

    seq_length: int
    micro_batch_size: int
    hidden_size: int
    padded_vocab_size: int
    num_micro_batches: int
    activation_bytes: int = 2        # bf16 activations; 4 in fp32 (the parameters' dtype too)
    recompute: bool = False
    sequence_parallel: bool = False  # --sequence-parallel (with TP > 1)
    norm_params: int = 2             # parameters of one norm: 2 LayerNorm (weight, bias), 1 RMSNorm
    linear_biases: bool = True       # row-parallel biases (False: --disable-bias-linear)
    embed_layernorm: bool = False    # BLOOM's norm after the embedding


def _sequence_parallel_tp(shape: StepShape, layers: int, first: bool, last: bool, t: int) -> dict:
    """One micro-batch's TP collectives under --sequence-parallel: {op: (calls, bytes)} (module docstring, SP)."""
    act = shape.seq_length * shape.micro_batch_size * shape.hidden_size * shape.activation_bytes
    shard = act // t
    gathers = layers * (6 if shape.recompute else 4) + (1 if first else 0) + (1 if last else 0)
    scatters = layers * (5 if shape.recompute else 4) + (1 if last else 0)
    replicated = (layers * (2 * shape.norm_params + (2 if shape.linear_biases else 0))
                  + (shape.norm_params if first and shape.embed_layernorm else 0)
                  + (shape.norm_params if last else 0))
    embedding = 1 if first else 0
    return {"all_gather_into_tensor": (gathers, gathers * shard),
            "reduce_scatter_tensor": (scatters, scatters * act),
            "all_reduce": (replicated + embedding,
                           replicated * shape.hidden_size * shape.activation_bytes + embedding * act)}


def _bucket_calls(numels: list[int], per_bucket: int) -> int:
    """Calls DeepSpeed's ``allreduce_no_retain`` makes: tensors join a bucket until it exceeds the size."""
    calls, current = 0, 0
    for n in numels:
        current += n
        if current > per_bucket:
            calls, current = calls + 1, 0
    return calls + (1 if current else 0)


ALLREDUCE_BUCKET = 500_000_000   # deepspeed MEMORY_OPT_ALLREDUCE_SIZE (elements)
ALLGATHER_BUCKET = 500_000_000   # BF16_Optimizer allgather_bucket_size default (elements)


def analytic_step_counts(shape: StepShape, layout: GroupLayout, rank: int, num_layers_on_stage: int,
                         optimizer_group_numels: Optional[list[int]] = None, bf16: bool = True) -> dict:
    """Expected {(axis, op): {"calls", "bytes"}} for one ``train_batch`` on ``rank``.

    optimizer_group_numels: this rank's parameters per optimizer group (decay, no-decay), needed
    for the DP figures (padded here exactly as BF16_Optimizer pads them)."""
    pp_rank, _, _ = layout.coords(rank)
    s, b, h, m, t = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.num_micro_batches, layout.tp
    act_numel = s * b * h
    act = act_numel * shape.activation_bytes
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    out: dict = {}

    def add(axis, op, calls, nbytes):
        if calls:
            entry = out.setdefault((axis, op), {"calls": 0, "bytes": 0})
            entry["calls"] += calls
            entry["bytes"] += nbytes

    if t > 1 and shape.sequence_parallel:
        for op, (calls, nbytes) in _sequence_parallel_tp(shape, num_layers_on_stage, first, last, t).items():
            add("tp", op, m * calls, m * nbytes)
        if last:  # cross-entropy: max over the vocab shards, then the three sums, fp32
            add("tp", "all_reduce", 2 * m, m * (s * b * 4 + 3 * s * b * 4))
    elif t > 1:
        # Recomputation replays the forward up to the last tensor backward needs: torch's non-reentrant
        # checkpoint stops early, before the MLP's output all-reduce, so it adds ONE per layer, not two.
        per_layer = 5 if shape.recompute else 4
        calls = num_layers_on_stage * per_layer + (1 if first else 0) + (1 if last else 0)
        add("tp", "all_reduce", m * calls, m * calls * act)
        if last:  # cross-entropy: max over the vocab shards, then the three sums, fp32
            add("tp", "all_reduce", 2 * m, m * (s * b * 4 + 3 * s * b * 4))
    if layout.pp > 1:
        # Each stage boundary carries one activation forward and one gradient backward per micro-batch.
        # With TP > 1 DeepSpeed partitions them over the TP group (pipe_partitioned/grad_partitioned):
        # a message is an int64 meta tensor (t + 7 values) + 1/t of the tensor, and the receiver
        # rebuilds the whole with an all-gather over the TP group; a non-last stage also rebuilds its
        # own partitioned output before its backward.
        messages = (0 if last else 1) + (0 if first else 1)   # sent = received, per micro-batch
        if t > 1 and shape.sequence_parallel:  # each rank sends its own shard, whole (pipe_partitioned off)
            add("pp", "send", m * messages, m * messages * (act // t))
            add("pp", "recv", m * messages, m * messages * (act // t))
        elif t > 1:
            part = act // t
            meta = (t + 7) * 8
            add("pp", "send", 2 * m * messages, m * messages * (part + meta))
            add("pp", "recv", 2 * m * messages, m * messages * (part + meta))
            gathers = (0 if first else 1) + (0 if last else 2)
            add("tp", "all_gather_into_tensor", m * gathers, m * gathers * part)
        else:
            add("pp", "send", m * messages, m * messages * act)
            add("pp", "recv", m * messages, m * messages * act)
        add("pp", "broadcast", 1, 8)  # the last stage broadcasts (loss, its count) as 2 fp32 values
    if optimizer_group_numels is not None and bf16:
        align = 2 * layout.dp
        padded = [-(-n // align) * align for n in optimizer_group_numels]
        # fp32 gradient buffers, cast to the communication dtype (bf16 by default) for the all-reduce;
        # DeepSpeed issues it on a DP group of one too (a no-op there)
        add("dp" if layout.dp > 1 else "self", "all_reduce", _bucket_calls(padded, ALLREDUCE_BUCKET),
            shape.activation_bytes * sum(padded))
    if layout.dp > 1 and optimizer_group_numels is not None and bf16:
        gathers = sum(max(1, (n // layout.dp) * layout.dp // ALLGATHER_BUCKET) for n in padded)
        add("dp", "all_gather_into_tensor", gathers, 2 * sum(n // layout.dp for n in padded))
        if last:
            add("dp", "all_reduce", 1, 4)  # the mean loss over DP (fp32 scalar)
    if layout.pp > 1 and (first or last):
        add("embedding", "all_reduce", 1, 4 * shape.padded_vocab_size // t * h)
    if t * layout.pp > 1 and bf16:
        add("model", "all_reduce", 1, 4)  # BF16_Optimizer's squared grad norm over the model replica
    return out


def analytic_ulysses_counts(shape: StepShape, layout: GroupLayout, num_layers: int, num_attention_heads: int,
                            num_kv_heads: int, head_dim: int) -> dict:
    """DeepSpeed-Ulysses' all-to-alls of one rank in one step: {("sp", "all_to_all_single"): {calls, bytes}}.

    Per micro-batch and layer, forward: q, k, v [s/sp, b, heads/tp, hn] in and the context out (4 calls),
    backward: each one's adjoint, the same sizes (4 more); with full recomputation the forward's 4 again.
    Each call hands over this rank's s/sp tokens of its heads: (s/sp) * b * (np or ng) * hn elements of
    ``shape.activation_bytes``; ``shape.recompute``: full-layer recomputation.
    """
    sp, tp = layout.sp, layout.tp
    if sp == 1:
        return {}
    tokens = shape.seq_length // sp * shape.micro_batch_size
    q = tokens * num_attention_heads // tp * head_dim  # the context has q's size
    kv = tokens * num_kv_heads // tp * head_dim
    passes = 3 if shape.recompute else 2  # forward, backward (+ the replayed forward)
    per_layer_elements = passes * (2 * q + 2 * kv)
    micro = shape.num_micro_batches * num_layers
    return {("sp", "all_to_all_single"): {"calls": 4 * passes * micro,
                                          "bytes": micro * per_layer_elements * shape.activation_bytes}}


def compare(measured: dict, analytic: dict) -> dict:
    """Per axis: measured and analytic calls and bytes, and their ratios (1.0 = explained exactly)."""
    axes = sorted({k[0] for k in measured} | {k[0] for k in analytic})
    out = {}
    for axis in axes:
        mc = sum(v["calls"] for k, v in measured.items() if k[0] == axis)
        mb = sum(v["bytes"] for k, v in measured.items() if k[0] == axis)
        ac = sum(v["calls"] for k, v in analytic.items() if k[0] == axis)
        ab = sum(v["bytes"] for k, v in analytic.items() if k[0] == axis)
        out[axis] = {"measured_calls": mc, "analytic_calls": ac, "measured_bytes": mb, "analytic_bytes": ab,
                     "calls_ratio": (mc / ac) if ac else None, "bytes_ratio": (mb / ab) if ab else None}
    return out
