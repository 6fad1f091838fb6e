"""The model engine: ZeRO-2 / ZeRO-3 data parallelism with our tensor parallelism, a whole GPTModel on DeepSpeed's
``DeepSpeedEngine`` ("model" in run_state.json and ``--target-engine``; the other engine is the pipeline engine).

DeepSpeed's pipeline engine refuses ZeRO stages 2 and 3, so a run with ``--zero-stage 2`` or ``3``
(and ``--pipeline-model-parallel-size 1``) trains the same ``megatron.model.GPTModel`` on
``deepspeed.DeepSpeedEngine``:

- ``DeepSpeedMPU`` gives DeepSpeed our ``ParallelState``'s groups (its "mpu"): ZeRO partitions over
  the data-parallel group, and its gradient norm counts TP-sliced parameters (tagged
  ``tensor_model_parallel``) on every TP rank and replicated ones once;
- with ZeRO-3 the model is built inside ``deepspeed.zero.Init``: each module's parameters are
  partitioned over the data-parallel ranks as soon as the module is built (after its own
  initialization, which draws from (seed, parameter name) only), so no rank ever holds the whole
  model, and the weights equal those of a (1, 1, 1) run; each MoE layer is one ZeRO-3 leaf module (its
  parameters, router and experts included, gathered before its forward and again before its backward: the
  router returns a ``Routing``, not a tensor ZeRO-3's backward hooks could see);
- ``ModelEngine`` puts the engine behind the few methods of DeepSpeed's ``PipelineEngine`` that
  the training loop calls (``train_batch`` / ``eval_batch`` over the same micro-batch iterator,
  the loss averaged over micro-batches and data-parallel ranks as the pipeline engine does).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron.config import RunConfig
from megatron.engine import deepspeed_compat
from megatron.engine.timers import NO_TIMERS
from megatron.engine.ulysses import backward_loss_scale, sequence_parallel_loss, ulysses_exchange
from megatron.model import GPTModel
from megatron.model.moe import MoELayer, moe_layers
from megatron.parallel.random import RNGStatesTracker, tracked_checkpoint_func
from megatron.parallel.state import ParallelState

__all__ = ["DeepSpeedMPU", "ModelEngine", "build_model_module", "hpz_group_ranks", "set_hpz_group",
           "zero_stage3_init"]


def _groups_of(lists: list[list[int]], rank: int):
    """Every group of ``lists`` created (collective: all ranks, same order), this rank's one returned;
    unlike ``ParallelState``, groups of one rank are real groups too (DeepSpeed reads None as the world)."""
    mine = None
    for ranks in lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


class DeepSpeedMPU:
    """DeepSpeed's model-parallel-unit interface over a one-stage ``ParallelState`` (TP x DP, x SP with
    DeepSpeed-Ulysses: DeepSpeed then reduces gradients and shards ZeRO state over the sequence-data-parallel
    group, dp x sp ranks, ``deepspeed.utils.groups._get_sequence_data_parallel_group``)."""

    def __init__(self, state: ParallelState):
        if state.pp_size != 1:
            raise ValueError(f"DeepSpeed's model engine runs one pipeline stage; this layout has {state.pp_size}")
        self.state = state
        layout = state.layout
        self._tp_group = state.tp_group if state.tp_size > 1 else _groups_of(layout.tensor, state.rank)
        self._dp_group = state.dp_group if state.dp_size > 1 else _groups_of(layout.data, state.rank)
        self._dp_ranks = next(ranks for ranks in layout.data if state.rank in ranks)
        self._tp_ranks = next(ranks for ranks in layout.tensor if state.rank in ranks)
        # The sequence axis is Ulysses' or context parallelism's (CP: DeepSpeed reduces over dp x cp the same way).
        # Size 1: the sequence-data-parallel group is the data-parallel group, as DeepSpeed's default
        self._sp_group = state.seq_group
        self._sp_data_group = state.sp_data_group if state.seq_size > 1 else self._dp_group
        self._sp_data_ranks = next(ranks for ranks in layout.sequence_data if state.rank in ranks)

    # tensor (= model, with one stage) parallelism
    def get_model_parallel_rank(self) -> int:
        return self.state.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.state.tp_size

    def get_model_parallel_group(self):
        return self._tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._tp_ranks[0]

    # data parallelism
    def get_data_parallel_rank(self) -> int:
        return self.state.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.state.dp_size

    def get_data_parallel_group(self):
        return self._dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._dp_ranks)

    # DeepSpeed-Ulysses
    def get_sequence_parallel_world_size(self) -> int:
        return self.state.seq_size

    def get_sequence_parallel_rank(self) -> int:
        return self.state.seq_rank

    def get_sequence_parallel_group(self):
        if self._sp_group is None:
            raise KeyError("this run has no sequence-parallel group (--ds-sequence-parallel-size 1 and "
                           "--context-parallel-size 1)")
        return self._sp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.state.dp_size * self.state.seq_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self._sp_data_ranks.index(self.state.rank)

    def get_sequence_data_parallel_group(self):
        return self._sp_data_group

    # one pipeline stage
    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


def hpz_group_ranks(state: ParallelState, size: int) -> list[list[int]]:
    """The hpZ groups (``--zero-hpz-partition-size``): each group ZeRO shards over (the data-parallel ranks of one
    TP rank; with Ulysses their sequence-parallel ranks too, the SP ranks of one replica next to each other) cut
    into runs of ``size`` consecutive ranks of it."""
    return [ranks[i:i + size] for ranks in state.layout.sequence_data for i in range(0, len(ranks), size)]


def set_hpz_group(state: ParallelState, size: int) -> Optional[list[int]]:
    """Give DeepSpeed this run's hpZ group (None when ``size`` is 1); the ranks of this rank's group.

    DeepSpeed's own would mix tensor-parallel peers (``deepspeed_compat.set_zero_param_intra_group``).
    """
    deepspeed_compat.set_zero_param_intra_group(None)
    if size == 1:
        return None
    lists = hpz_group_ranks(state, size)
    deepspeed_compat.set_zero_param_intra_group(_groups_of(lists, state.rank))
    return next(ranks for ranks in lists if state.rank in ranks)


def zero_stage3_init(rc: RunConfig, config: dict, mpu: DeepSpeedMPU):
    """The context the model is built in: ``deepspeed.zero.Init`` for ZeRO-3 (parameters partitioned
    as each module is built), nothing otherwise."""
    if rc.deepspeed_zero_stage != 3:
        return contextlib.nullcontext()
    # partitioned over dp x sp ranks with Ulysses (the engine reduces gradients over that group)
    return deepspeed_compat.zero3_init(mpu.get_sequence_data_parallel_group(), config, mpu)


def build_model_module(rc: RunConfig, state: ParallelState, config: dict, mpu: DeepSpeedMPU,
                         tracker: Optional[RNGStatesTracker] = None) -> GPTModel:
    """This rank's TP slice of the model (partitioned over DP under ZeRO-3), recomputing its layers'
    activations with --checkpoint-activations (every --checkpoint-num-layers)."""
    deepspeed_compat.silence_renamed_collectives()
    with zero_stage3_init(rc, config, mpu):
        model = GPTModel(rc.model, state, rng_tracker=tracker, sequence_exchange=ulysses_exchange(state))
    if rc.deepspeed_zero_stage == 3 and moe_layers(model):
        deepspeed_compat.zero3_leaf_modules(model, [MoELayer])  # the router's output is no tensor
    t = rc.training
    if t.checkpoint_activations:
        model.recompute_activations(tracked_checkpoint_func(tracker), t.checkpoint_num_layers)
    return model


class ModelEngine:
    """A ``deepspeed.DeepSpeedEngine`` with ``train_batch`` / ``eval_batch`` as the pipeline engine has them.

    Anything else (``optimizer``, ``module``, ``save_checkpoint``, ``was_step_applied``, ...) is the
    engine's own.
    """

    def __init__(self, engine, state: ParallelState, mpu: DeepSpeedMPU, hpz_ranks: Optional[list[int]] = None):
        self.engine = engine
        self.state = state
        self.mpu = mpu
        self.hpz_ranks = hpz_ranks  # this rank's hpZ group (world ranks), or None
        self.phase_timers = NO_TIMERS  # the training loop sets its own (--timing-log-level)
        # context parallelism reduces like Ulysses: the sequence axis' parts summed, averaged over dp
        deepspeed_compat.check_zero3_ulysses(engine.zero_optimization_stage(), state.seq_size)
        self.backward_scale = backward_loss_scale(engine.zero_optimization_stage(), state.seq_size)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _loss(self, micro_batch) -> torch.Tensor:
        """The micro-batch loss (with Ulysses or CP this rank's part of it, megatron.engine.ulysses)."""
        (input_ids, position_ids, *documents), (labels, loss_mask) = micro_batch
        device = self.engine.device
        # --reset-attention-mask: the document ids [b, s] (Ulysses: the whole sample's; CP: this rank's tokens')
        extra = {"document_ids": documents[0].to(device)} if documents else {}
        if self.state.seq_size == 1:
            return self.engine(input_ids.to(device), position_ids.to(device), labels.to(device), loss_mask.to(device),
                               **extra)
        per_token = self.engine(input_ids.to(device), position_ids.to(device), labels.to(device),
                                **extra)  # [b, s/sp]
        return sequence_parallel_loss(per_token, loss_mask.to(device), self.state.seq_group)

    @torch.no_grad()
    def logits(self, inputs) -> torch.Tensor:
        """The model's logits [s', b, vp/tp] for one micro-batch's inputs (input ids, positions and, with
        --reset-attention-mask, document ids; s' this rank's tokens under Ulysses or CP); no gradient. Every rank of
        the run calls it together (ZeRO-3 gathers each module's parameters for its forward; the live harness)."""
        input_ids, position_ids, *documents = inputs
        device = self.engine.device
        extra = {"document_ids": documents[0].to(device)} if documents else {}
        return self.engine(input_ids.to(device), position_ids.to(device), **extra)

    def _mean_over_data_parallel(self, total: torch.Tensor, count: int) -> torch.Tensor:
        """Mean over micro-batches and data-parallel ranks; with Ulysses the SP ranks' parts are summed first."""
        loss = total.detach().float() / count
        if self.state.dp_size * self.state.seq_size > 1:
            dist.all_reduce(loss, group=self.mpu.get_sequence_data_parallel_group())
            loss /= self.state.dp_size
        return loss

    def train_batch(self, data_iter: Iterator) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; their mean loss."""
        steps = self.engine.gradient_accumulation_steps()
        total = torch.zeros((), device=self.engine.device)
        timers = self.phase_timers
        for _ in range(steps):
            with timers("forward-backward", 1):
                micro_batch = next(data_iter)  # the training loop times it ('batch-generator')
                with timers("forward-compute", 2):
                    loss = self._loss(micro_batch)
                with timers("backward-compute", 2):
                    # scaled by 1 / steps inside, as the pipeline engine does (backward_scale: Ulysses, ZeRO-3)
                    self.engine.backward(loss * self.backward_scale if self.backward_scale != 1.0 else loss)
            with timers("optimizer", 1):
                self.engine.step()  # applies the update at the accumulation boundary only
            total += loss.detach().float()
        return self._mean_over_data_parallel(total, steps)

    @contextlib.contextmanager
    def universal_tp_restore(self) -> Iterator[None]:
        """Within: DeepSpeed's ZeRO-3 universal loader cuts each full tensor to this rank's TP slice before
        partitioning it over DP (by itself it partitions the full tensor over DP only, and fails at TP > 1).
        It does so for parameters carrying AutoTP's restore record (``ds_autotp_uc_meta``: the split dim and
        full shape, or replicated) with DeepSpeed's tensor-parallel group set; both are given for the load only."""
        tp = self.state.tp_size
        if tp == 1 or self.engine.zero_optimization_stage() != 3:
            yield
            return
        with deepspeed_compat.universal_tp_restore(list(self.engine.module.parameters()), tp,
                                                   self.mpu.get_tensor_model_parallel_group()):
            yield

    def eval_batch(self, data_iter: Iterator) -> torch.Tensor:
        steps = self.engine.gradient_accumulation_steps()
        total = torch.zeros((), device=self.engine.device)
        with torch.no_grad():
            for _ in range(steps):
                total += self._loss(next(data_iter)).float()
        return self._mean_over_data_parallel(total, steps)

    def train(self, mode: bool = True):
        self.engine.train(mode)
        return self

    def eval(self):
        self.engine.eval()
        return self
