"""Interleaved virtual pipeline stages on DeepSpeed's own pipeline engine (docs/parallelism.md, "Interleaved pipeline").

    module = InterleavedPipelineModule(layers=..., topology=..., num_virtual_stages=v, ...)
    engine = InterleavedPipelineEngine(...)   # what deepspeed.initialize builds, with this class

The layer list is cut into p * v parts (DeepSpeed's partition methods over p * v stages, or the parts the
pipeline layout flags give: ``PartedPipelineModule``, the base class, which 1F1B and ZB-H1 runs with those flags
build too); rank r builds
parts r, r + p, ..., r + (v-1) p as its chunks, and ``activate_chunk(c)`` exposes chunk c as the module's
``forward``. Everything else is the ordinary ``PipelineEngine``: the same optimizer (ZeRO-1,
BF16_Optimizer), tied-embedding all-reduce (the first chunk of rank 0 and the last chunk of rank p-1
hold the tie), and layer files named by global layer index, so a layer's file is the same whichever
chunk holds it and a 1F1B checkpoint loads here and back. DeepSpeed's DualPipeVModule / DualPipeVEngine
(two chunks per rank) is the same pattern; this is it for v chunks in Megatron-LM's interleaved order.

Point-to-point: every send and receive is an asynchronous ``isend`` / ``irecv`` on the default group,
tagged by (receiving virtual stage, kind), so messages between two ranks for different chunks never
cross. A receive is posted at its instruction and waited for by the pass that reads it; sends are
waited for at the end of the step (``WaitSends``). Shapes travel once per chunk (a small int64 tensor
before the first activation), so no rank blocks in DeepSpeed's pairwise broadcasts.

The order (interleaved 1F1B as a DeepSpeed ``PipeSchedule``). Each of the p pipeline ranks holds v chunks; chunk c of
rank r is virtual stage c*p + r, so a micro-batch passes every rank v times (rank p-1's chunk c hands its activations
to rank 0's chunk c+1). The k-th forward of a rank runs chunk (k // p) % v on micro-batch (k // (p*v)) * p + k % p:
groups of p micro-batches go through chunk 0, then the same group through chunk 1, and so on; backwards walk the
chunks the other way. A rank first runs ``num_warmup_forwards`` forwards (Megatron's (p - r - 1) * 2 + (v - 1) * p,
the registry's), then alternates one forward and one backward, then drains the remaining backwards.

``compute_order`` gives that order for one rank (pure Python); ``InterleavedSchedule`` turns it into DeepSpeed
instructions for ``megatron.engine.schedules.interleaved.InterleavedPipelineEngine``; ``passes_of`` reads the
(kind, chunk) passes back from a rank's stream. The registry's timeline simulator
(``megatron.config.schedules.timeline``, over ``megatron.engine.schedules.streams.schedule_streams``) counts each
rank's idle slots, which the registry states in closed form ((p - 1) / v idle slots,
``megatron.planner.schedule_costs.bubble_fraction``): (p - 1) / (v * m + p - 1) of every rank's step, with F and B
passes of one chunk taking t_f / v and t_b / v of a whole stage's time.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

from megatron.config.pipeline_schedule import check_interleaved_micro_batches
from megatron.config.schedules import REGISTRY
from megatron.engine.deepspeed_compat import require

_ACTIVATION, _GRADIENT, _META = 0, 1, 2
_META_SIZE = 32  # int64s: [num_tensors, (dtype id, ndim, *shape) per tensor]


# ---- the order: which pass of which chunk each rank runs, as DeepSpeed instructions ------------------

INTERLEAVED = REGISTRY["interleaved"]
FORWARD, BACKWARD = "F", "B"


def num_warmup_forwards(pp: int, num_virtual_stages: int, num_micro_batches: int, rank: int) -> int:
    """Forwards rank ``rank`` runs before its first backward (Megatron-LM's count, capped at all of them: the
    registry's, ``megatron.config.schedules``)."""
    return INTERLEAVED.warmup_forwards(pp, num_micro_batches, rank, num_virtual_stages)


def _chunk_and_micro_batch(k: int, pp: int, v: int, kind: str) -> tuple[int, int]:
    chunk = (k // pp) % v
    return (chunk if kind == FORWARD else v - 1 - chunk), (k // (pp * v)) * pp + k % pp


def compute_order(pp: int, num_virtual_stages: int, num_micro_batches: int, rank: int,
                  forward_only: bool = False) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s passes in order: (FORWARD or BACKWARD, chunk, micro-batch)."""
    v, m = num_virtual_stages, num_micro_batches
    total = m * v
    if forward_only and m % pp:  # evaluation of any micro-batch count: each one through every chunk in turn
        return [(FORWARD, chunk, micro_batch) for micro_batch in range(m) for chunk in range(v)]
    check_interleaved_micro_batches(pp, v, m)
    forwards = [(FORWARD, *_chunk_and_micro_batch(k, pp, v, FORWARD)) for k in range(total)]
    if forward_only:
        return forwards
    backwards = [(BACKWARD, *_chunk_and_micro_batch(k, pp, v, BACKWARD)) for k in range(total)]
    warmup = num_warmup_forwards(pp, v, m, rank)
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup:]


class WaitSends(ds_schedule.PipeInstruction):
    """Wait until every activation and gradient this rank sent has been received."""


class InterleavedSchedule(ds_schedule.PipeSchedule):
    """``compute_order`` as DeepSpeed instructions, one step per pass; ``chunk`` rides on every buffer op.

    Buffer slot of (chunk, micro-batch): chunk * m + micro-batch. Receives are posted at their instruction
    and waited for by the pass that reads them; sends are waited for by ``WaitSends`` (so no rank blocks on
    a peer that is itself waiting: the order is a valid topological order of the whole pipeline's passes).
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, num_virtual_stages: int,
                 forward_only: bool = False):
        super().__init__(micro_batches, stages, stage_id)
        self.num_virtual_stages = num_virtual_stages
        self.forward_only = forward_only

    def num_pipe_buffers(self) -> int:
        return self.num_virtual_stages * self.micro_batches

    def _slot(self, chunk: int, micro_batch: int) -> int:
        return chunk * self.micro_batches + micro_batch

    def _loads_data(self, chunk: int) -> bool:
        """Rank 0 loads inputs at chunk 0; rank p-1 loads labels at its last chunk (both at once when p = 1)."""
        if self.stage_id == 0 and chunk == 0:
            return True
        return self.stage_id == self.stages - 1 and self.stages > 1 and chunk == self.num_virtual_stages - 1

    def steps(self):
        p, v = self.stages, self.num_virtual_stages
        order = compute_order(p, v, self.micro_batches, self.stage_id, self.forward_only)
        for kind, chunk, micro_batch in order:
            slot = self._slot(chunk, micro_batch)
            virtual_stage = chunk * p + self.stage_id
            first, last = virtual_stage == 0, virtual_stage == p * v - 1
            if kind == FORWARD:
                cmds = [ds_schedule.LoadMicroBatch(micro_batch)] if self._loads_data(chunk) else []
                cmds += [] if first else [ds_schedule.RecvActivation(slot, chunk=chunk)]
                cmds.append(ds_schedule.ForwardPass(slot, chunk=chunk))
                cmds += [] if last else [ds_schedule.SendActivation(slot, chunk=chunk)]
            else:
                cmds = [] if last else [ds_schedule.RecvGrad(slot, chunk=chunk)]
                cmds.append(ds_schedule.BackwardPass(slot, chunk=chunk))
                cmds += [] if first else [ds_schedule.SendGrad(slot, chunk=chunk)]
            yield cmds
        cmds = [WaitSends()]
        if not self.forward_only:
            cmds += [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]
        yield cmds


def passes_of(stream: Iterable[Sequence]) -> list[tuple[str, int]]:
    """The (FORWARD or BACKWARD, chunk) passes of one rank's instruction stream, in order (chunk 0 for a
    schedule without chunks, such as DeepSpeed's ``TrainSchedule``)."""
    kinds = {ds_schedule.ForwardPass: FORWARD, ds_schedule.BackwardPass: BACKWARD}
    return [(kinds[type(cmd)], getattr(cmd, "chunk", 0)) for step in stream for cmd in step if type(cmd) in kinds]


# ---- the engine -------------------------------------------------------------------------------------

def _as_list(tensors) -> list:
    return [tensors] if torch.is_tensor(tensors) else list(tensors)


class PartedPipelineModule(PipelineModule):
    """A ``PipelineModule`` whose stages hold the given ``parts`` (DeepSpeed's: stage s holds layers parts[s] ..
    parts[s+1] - 1; from the pipeline layout flags, ``megatron.config.pipeline_layout.item_bounds``) instead of
    what its partition method computes; ``parts=None``: the partition method's, as DeepSpeed's own class."""

    def __init__(self, *args, parts: Optional[Sequence[int]] = None, **kwargs):
        require("pipeline_schedule")  # the private PipelineModule methods below (deepspeed_compat's list)
        self.given_parts = None if parts is None else list(parts)
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method="uniform"):
        if self.given_parts is None:
            super()._partition_layers(method)
            return
        parts = self.given_parts
        if (len(parts) != self.num_stages + 1 or parts[0] != 0 or parts[-1] != len(self._layer_specs)
                or any(b < a for a, b in zip(parts, parts[1:]))):
            raise ValueError(f"pipeline parts {parts} do not cut the {len(self._layer_specs)} pipeline layers into "
                             f"{self.num_stages} stages")
        self.parts = list(parts)
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])


class InterleavedPipelineModule(PartedPipelineModule):
    """A ``PipelineModule`` cut into p * v stages; this rank builds stages r, r + p, ... as its v chunks."""

    def __init__(self, *args, num_virtual_stages: int, **kwargs):
        require("pipeline_schedule")  # the private PipelineModule methods below (deepspeed_compat's list)
        self.num_virtual_stages = num_virtual_stages
        self.active_chunk = 0
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method="uniform"):
        ranks = self.num_stages
        self.num_stages = ranks * self.num_virtual_stages  # DeepSpeed's partitioner cuts num_stages parts
        super()._partition_layers(method)
        self.num_stages = ranks
        self.chunk_bounds = [(self.parts[c * ranks + self.stage_id], self.parts[c * ranks + self.stage_id + 1])
                             for c in range(self.num_virtual_stages)]

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline rank holding ``layer_idx`` (its virtual stage modulo p): ties are found by rank."""
        assert 0 <= layer_idx < self._num_layers
        virtual_stages = self.num_stages * self.num_virtual_stages
        for stage in range(virtual_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage % self.num_stages
        raise RuntimeError(f"layer {layer_idx} is in no part of {self.parts}")

    def _build(self):
        self.chunk_funcs, self.chunk_checkpointable = [], [[] for _ in self.chunk_bounds]
        for start, stop in self.chunk_bounds:
            self._set_bounds(start, stop)
            self.forward_funcs = []
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
        self.activate_chunk(0)

    def activate_chunk(self, chunk: int) -> None:
        """Make chunk ``chunk`` this module's forward (and its layer range the one checkpoints number)."""
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        self.is_checkpointable_results = self.chunk_checkpointable[chunk]
        self._local_start, self._local_stop = self.chunk_bounds[chunk]

    def _precompute_checkpointable_values(self):
        for chunk in range(self.num_virtual_stages):
            self.activate_chunk(chunk)
            self.is_checkpointable_results_interval = None  # cached per interval: not across chunks
            super()._precompute_checkpointable_values()
            self.chunk_checkpointable[chunk] = self.is_checkpointable_results
        self.activate_chunk(0)

    def save_state_dict(self, *args, **kwargs):
        for chunk in range(self.num_virtual_stages):
            self.activate_chunk(chunk)
            super().save_state_dict(*args, **kwargs)
        self.activate_chunk(0)

    def load_state_dir(self, *args, **kwargs):
        for chunk in range(self.num_virtual_stages):
            self.activate_chunk(chunk)
            super().load_state_dir(*args, **kwargs)
        self.activate_chunk(0)


class InterleavedPipelineEngine(PipelineEngine):
    """DeepSpeed's ``PipelineEngine`` running ``InterleavedSchedule`` over an ``InterleavedPipelineModule``.

    ``is_first_stage`` / ``is_last_stage`` mean the first and the last virtual stage while a chunk runs,
    and the pipeline ranks 0 and p-1 otherwise (data loading, loss broadcast), as DeepSpeed's own code
    asks them in both senses.
    """

    def __init__(self, *args, **kwargs):
        require("pipeline_schedule")  # the private PipelineEngine methods below (deepspeed_compat's list)
        self._active_chunk: Optional[int] = None
        super().__init__(*args, **kwargs)
        if not isinstance(self.module, InterleavedPipelineModule):
            raise TypeError("InterleavedPipelineEngine runs an InterleavedPipelineModule")
        # Each TP rank sends the whole activation: DeepSpeed's partitioned send assumes one chunk per rank.
        self.is_pipe_partitioned = self.is_grad_partitioned = False
        self.num_virtual_stages = self.module.num_virtual_stages
        self.pipe_buffers["grads"] = []
        self.pipe_buffers["losses"] = []
        self._recvs: dict[tuple[int, int], list] = {}
        self._sends: list = []
        self._sent_meta: set[int] = set()
        self._recv_specs: dict[int, list] = {}

    # -- which stage a pass is -------------------------------------------------------------------------
    def _virtual_stage(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage_id

    def is_first_stage(self):
        if self._active_chunk is None:
            return super().is_first_stage()
        return self._virtual_stage(self._active_chunk) == 0

    def is_last_stage(self):
        if self._active_chunk is None:
            return super().is_last_stage()
        return self._virtual_stage(self._active_chunk) == self.num_stages * self.num_virtual_stages - 1

    @contextmanager
    def _chunk(self, chunk: int):
        self._active_chunk = chunk
        self.module.activate_chunk(chunk)
        try:
            yield
        finally:
            self._active_chunk = None

    def _train_schedule(self):
        return InterleavedSchedule(self.micro_batches, self.num_stages, self.stage_id, self.num_virtual_stages)

    def _inference_schedule(self, micro_batches):
        return InterleavedSchedule(micro_batches, self.num_stages, self.stage_id, self.num_virtual_stages,
                                   forward_only=True)

    def reset_activation_shape(self):
        super().reset_activation_shape()
        self._sent_meta, self._recv_specs = set(), {}

    def _exec_schedule(self, pipe_schedule):
        self._micro_batches_now = pipe_schedule.micro_batches
        super()._exec_schedule(pipe_schedule)

    # -- point-to-point ----------------------------------------------------------------------------------
    def _peer(self, virtual_stage: int) -> int:
        return self.grid.stage_to_global(virtual_stage % self.num_stages)

    @staticmethod
    def _tag(receiving_stage: int, kind: int) -> int:
        return 3 * receiving_stage + kind

    def _isend(self, tensors: list, receiver: int, kind: int) -> None:
        """Send ``tensors`` to virtual stage ``receiver``; the request keeps each tensor alive until delivered."""
        self._sends = [(request, t) for request, t in self._sends if not request.is_completed()]
        peer, tag = self._peer(receiver), self._tag(receiver, kind)
        self._sends += [(dist.isend(t, peer, tag=tag), t) for t in (t.contiguous() for t in tensors)]

    def _irecv(self, tensors: list, sender: int, receiver: int, kind: int) -> list:
        """Post receives of ``tensors`` from virtual stage ``sender`` into (this rank's) ``receiver``."""
        peer, tag = self._peer(sender), self._tag(receiver, kind)
        return [dist.irecv(t, peer, tag=tag) for t in tensors]

    def _wait_recv(self, kind: int, buffer_id: int) -> None:
        for request in self._recvs.pop((kind, buffer_id), []):
            request.wait()

    def _exec_wait_sends(self):
        for request, _ in self._sends:
            request.wait()
        self._sends = []

    def _send_meta(self, tensors: list, virtual_stage: int) -> None:
        meta = [len(tensors)]
        for t in tensors:
            meta += [self.DTYPE_TO_ID[t.dtype], t.dim(), *t.shape]
        if len(meta) > _META_SIZE:
            raise ValueError(f"a pipeline activation of {len(tensors)} tensors needs {len(meta)} > {_META_SIZE} "
                             f"metadata entries")
        buffer = torch.zeros(_META_SIZE, dtype=torch.int64)
        buffer[:len(meta)] = torch.tensor(meta, dtype=torch.int64)
        self._isend([buffer], virtual_stage, _META)

    def _recv_meta(self, sender: int, receiver: int) -> list:
        buffer = torch.zeros(_META_SIZE, dtype=torch.int64)
        for request in self._irecv([buffer], sender, receiver, _META):
            request.wait()
        meta, specs, at = buffer.tolist(), [], 1
        for _ in range(meta[0]):
            dtype, ndim = self.ID_TO_DTYPE[meta[at]], meta[at + 1]
            specs.append((tuple(meta[at + 2:at + 2 + ndim]), dtype))
            at += 2 + ndim
        return specs

    # -- instructions ------------------------------------------------------------------------------------
    def _exec_load_micro_batch(self, buffer_id):
        """``buffer_id`` is the micro-batch: inputs go to chunk 0's slot, labels to the last chunk's."""
        super()._exec_load_micro_batch(buffer_id)  # outside any chunk: rank 0 inputs, rank p-1 labels
        last = (self.num_virtual_stages - 1) * self._micro_batches_now + buffer_id
        if last != buffer_id:
            self.pipe_buffers["labels"][last] = self.pipe_buffers["labels"][buffer_id]
            self.pipe_buffers["labels"][buffer_id] = None

    def _exec_forward_pass(self, buffer_id, chunk):
        self._wait_recv(_ACTIVATION, buffer_id)
        with self._chunk(chunk):
            super()._exec_forward_pass(buffer_id)
            last = self.is_last_stage()
        if last and torch.is_grad_enabled():
            self.pipe_buffers["losses"][buffer_id] = self.loss  # its backward may come passes later
        if not torch.is_grad_enabled():
            self.pipe_buffers["inputs"][buffer_id] = None
            self.pipe_buffers["labels"][buffer_id] = None
            if last:
                self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_backward_pass(self, buffer_id, chunk):
        with self._chunk(chunk):
            if self.is_last_stage():
                self.loss = self.pipe_buffers["losses"][buffer_id]
                self.pipe_buffers["losses"][buffer_id] = None
            else:
                self._wait_recv(_GRADIENT, buffer_id)
                self.grad_layer = self.pipe_buffers["grads"][buffer_id]
                self.pipe_buffers["grads"][buffer_id] = None
            first = self.is_first_stage()
            super()._exec_backward_pass(buffer_id)
        self.pipe_buffers["outputs"][buffer_id] = None
        self.pipe_buffers["labels"][buffer_id] = None
        if first:
            self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_send_activations(self, buffer_id, chunk):
        outputs = _as_list(self.pipe_buffers["outputs"][buffer_id])
        receiver = self._virtual_stage(chunk) + 1
        if chunk not in self._sent_meta:
            self._sent_meta.add(chunk)
            self._send_meta(outputs, receiver)
        self._isend(outputs, receiver, _ACTIVATION)
        if not torch.is_grad_enabled():
            self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id, chunk):
        receiver = self._virtual_stage(chunk)
        if chunk not in self._recv_specs:
            self._recv_specs[chunk] = self._recv_meta(receiver - 1, receiver)
        received = [torch.empty(shape, dtype=dtype, device=self.device, requires_grad=dtype.is_floating_point)
                    for shape, dtype in self._recv_specs[chunk]]
        self._recvs[(_ACTIVATION, buffer_id)] = self._irecv(received, receiver - 1, receiver, _ACTIVATION)
        self.pipe_buffers["inputs"][buffer_id] = received[0] if len(received) == 1 else tuple(received)

    def _exec_send_grads(self, buffer_id, chunk):
        inputs = _as_list(self.pipe_buffers["inputs"][buffer_id])
        grads = [t.grad for t in inputs if t.is_floating_point()]
        assert all(g is not None for g in grads), "an activation this chunk received got no gradient"
        self._isend(grads, self._virtual_stage(chunk) - 1, _GRADIENT)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id, chunk):
        outputs = _as_list(self.pipe_buffers["outputs"][buffer_id])
        grads = [torch.empty_like(t) for t in outputs if t.is_floating_point()]
        receiver = self._virtual_stage(chunk)
        self._recvs[(_GRADIENT, buffer_id)] = self._irecv(grads, receiver + 1, receiver, _GRADIENT)
        # DeepSpeed's backward pairs a tuple of outputs (e.g. (hidden, document_ids)) with a list of gradients of
        # its floating-point members, one output with one tensor
        single = not isinstance(self.pipe_buffers["outputs"][buffer_id], tuple)
        self.pipe_buffers["grads"][buffer_id] = grads[0] if single else grads

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds_schedule.LoadMicroBatch: _exec_load_micro_batch,
        ds_schedule.ForwardPass: _exec_forward_pass,
        ds_schedule.BackwardPass: _exec_backward_pass,
        ds_schedule.SendActivation: _exec_send_activations,
        ds_schedule.RecvActivation: _exec_recv_activations,
        ds_schedule.SendGrad: _exec_send_grads,
        ds_schedule.RecvGrad: _exec_recv_grads,
        WaitSends: _exec_wait_sends,
    }
