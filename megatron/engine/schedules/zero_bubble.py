"""ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", its memory-neutral H1 schedule) on DeepSpeed's
PipelineEngine: ``--enable-zbh1-pipeline --enable-zbh1-exact-semantics`` (Megatron-DeepSpeed's flags).

1F1B runs each micro-batch's backward as one block B+W. Here the backward pass (DeepSpeed's ``BackwardPass``)
computes only the input gradients (B: what the previous stage waits for; the tensor-parallel linears and the
vocab-parallel head push their weight products to a ``WeightGradStore``, megatron/parallel/weight_grad_store.py),
and a new instruction, ``WeightPass``, runs one micro-batch's deferred weight products (W) later:

    ZeroBubbleH1Schedule   DeepSpeed's TrainSchedule (the same forwards, backwards and p2p pairs in the same
                           order, so no send can meet a different receive) with WeightPass inserted: stage s lets
                           up to s W passes wait; after a backward pass that makes s + 1 wait, the oldest runs at
                           the start of the next step, after that step's sends (a neighbour never waits on a W).
                           The s waiting at the end run after the last backward pass, while the earlier stages
                           still drain theirs: the cool-down bubble 1F1B leaves idle.
    exact semantics        every W pass runs before ReduceTiedGrads, ReduceGrads and OptimizerStep, so gradient
                           clipping and the step see complete gradients (``ZeroBubblePipelineEngine`` asserts it).

With unit costs F = B = W, each stage of p idles (p - 1)(F + B - W) = p - 1 slots per step against 1F1B's
(p - 1)(F + B + W) = 3(p - 1), once there are at least p micro-batches (the registry's
``megatron.config.schedules.idle_slots`` counts them from the instruction streams). Activations in flight are
1F1B's; stage s also holds up to s W passes' inputs and output gradients.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import (
    BackwardPass,
    PipeInstruction,
    RecvGrad,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)

from megatron.engine.deepspeed_compat import require
from megatron.parallel.weight_grad_store import WeightGradStore, defer_weight_grads

__all__ = ["WeightPass", "ZeroBubbleH1Schedule", "ZeroBubblePipelineEngine", "enable_zero_bubble"]


class WeightPass(PipeInstruction):
    """Run the oldest deferred weight-gradient pass (W) of this stage."""


def _after_leading_sends(cmds: list) -> int:
    """Index just after the sends a step opens with (DeepSpeed sends the previous step's results first)."""
    index = 0
    while index < len(cmds) and isinstance(cmds[index], (SendActivation, SendGrad)):
        index += 1
    return index


class ZeroBubbleH1Schedule(TrainSchedule):
    """1F1B's order of forwards, backwards and p2p, with each stage's deferred W passes placed as ZB-H1 does."""

    def steps(self):
        waiting, due = 0, 0  # W passes deferred; of those, how many run at the start of the next step
        max_waiting = self.stage_id
        for cmds in super().steps():
            cmds = list(cmds)
            if due:
                at = _after_leading_sends(cmds)
                cmds[at:at] = [WeightPass() for _ in range(due)]
                waiting, due = waiting - due, 0
            for index, cmd in enumerate(cmds):
                if isinstance(cmd, ReduceTiedGrads):  # exact semantics: every W before the reductions
                    cmds[index:index] = [WeightPass() for _ in range(waiting)]
                    waiting = 0
                    break
                if isinstance(cmd, BackwardPass):
                    waiting += 1
                    due = max(0, waiting - max_waiting)
            yield cmds


class ZeroBubblePipelineEngine(PipelineEngine):
    """DeepSpeed's PipelineEngine running ``ZeroBubbleH1Schedule`` (made by ``enable_zero_bubble``).

    ``executed_steps``: the instruction names of the last schedule it ran, one list per step.
    """

    weight_grad_store: WeightGradStore
    executed_steps: list

    def __init__(self, *args, **kwargs):
        require("pipeline_schedule")  # the private PipelineEngine methods below (deepspeed_compat's list)
        super().__init__(*args, **kwargs)

    def _train_schedule(self):
        return ZeroBubbleH1Schedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def _exec_backward_pass(self, buffer_id):
        PipelineEngine._exec_backward_pass(self, buffer_id)  # B: input gradients; weight products deferred
        self.weight_grad_store.close_micro_batch()

    def _exec_recv_grads(self, buffer_id):
        # DeepSpeed receives every micro-batch's output gradient into one reused buffer (``grad_layer``). The last
        # linear of the stage keeps that very tensor as dY for its deferred W pass, so the backward pass gets a
        # copy of its own and the buffer goes back to DeepSpeed before the next receive.
        buffer = getattr(self, "_received_grad_buffer", None)
        if buffer is not None and self.grad_layer is not None:
            self.grad_layer = buffer
        PipelineEngine._exec_recv_grads(self, buffer_id)
        self._received_grad_buffer = self.grad_layer
        if isinstance(self.grad_layer, torch.Tensor):
            self.grad_layer = self.grad_layer.clone()
        else:
            self.grad_layer = type(self.grad_layer)(t.clone() for t in self.grad_layer)

    def _exec_weight_pass(self):
        # BF16_Optimizer keeps the fp32 gradients apart: it adds every bf16 .grad into them after each backward
        # pass (and zeroes the .grad before the next). A W pass does the same for its own products only.
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()
        self.weight_grad_store.run_oldest()
        if self.using_bf16_optimizer:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    def _exec_reduce_tied_grads(self):
        self.weight_grad_store.assert_empty()  # exact semantics
        PipelineEngine._exec_reduce_tied_grads(self)

    def _exec_schedule(self, pipe_schedule):
        # DeepSpeed's loop (reserve the buffers, run each step's instructions), recording what ran.
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        self.executed_steps = []
        for step_cmds in pipe_schedule:
            self.executed_steps.append([cmd.name for cmd in step_cmds])
            for cmd in step_cmds:
                if type(cmd) not in self._INSTRUCTION_MAP:
                    raise RuntimeError(f"{type(self).__name__} does not understand instruction {cmd!r}")
                self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)

    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, BackwardPass: _exec_backward_pass,
                        RecvGrad: _exec_recv_grads, ReduceTiedGrads: _exec_reduce_tied_grads,
                        WeightPass: _exec_weight_pass}


def enable_zero_bubble(engine) -> ZeroBubblePipelineEngine:
    """Set up the ZB-H1 engine that ``deepspeed.initialize`` built (``megatron.engine.initialize`` passes it the
    class): its module's linears defer their weight gradients to the engine's store, its schedule runs them."""
    if engine.optimizer is not None and getattr(engine.optimizer, "immediate_grad_update", False):
        raise ValueError("ZB-H1 (--enable-zbh1-pipeline) does not combine with bf16.immediate_grad_update in the "
                         "DeepSpeed config: it adds gradients to the fp32 copy from autograd hooks, which a deferred "
                         "weight gradient never reaches; drop immediate_grad_update")
    if engine.zero_optimization_stage() > 0 and not engine.using_bf16_optimizer:
        raise ValueError(f"ZB-H1 (--enable-zbh1-pipeline) does not combine with {type(engine.optimizer).__name__} "
                         f"(ZeRO stage {engine.zero_optimization_stage()} without BF16_Optimizer): it collects "
                         f"gradients from autograd hooks, which a deferred weight gradient never reaches. Use "
                         f"--zero-stage 0 in fp32, or --bf16 with fp32 gradient accumulation (BF16_Optimizer)")
    if not isinstance(engine, ZeroBubblePipelineEngine):
        raise AssertionError(f"deepspeed.initialize built {type(engine).__name__}, not ZeroBubblePipelineEngine: build "
                             f"it within deepspeed_compat.pipeline_engine_class(ZeroBubblePipelineEngine)")
    engine.weight_grad_store = WeightGradStore()
    engine.executed_steps = []
    defer_weight_grads(engine.module, engine.weight_grad_store)
    return engine
