"""DeepSpeed-Ulysses sequence parallelism (``--ds-sequence-parallel-size``, Jacobs et al. 2023).

Every rank of a sequence-parallel (SP) group holds the same weights and s / sp tokens of the same samples.
Each layer runs on those tokens, except the core attention: DeepSpeed's ``DistributedAttention`` all-to-alls
q, k and v from [s/sp, b, np, hn] (this rank's tokens, all of its TP rank's heads) to [s, b, np/sp, hn]
(every token, 1/sp of the heads), attends causally over the whole sequence, and all-to-alls the context
back. 4 all-to-alls per layer forward, 4 in backward (each one's adjoint is the reverse all-to-all).

The loss of a micro-batch is Megatron's sum(loss * mask) / sum(mask) over the WHOLE sequence: each SP rank
returns its tokens' part, sum over its tokens / the mask count all-reduced over the SP group. DeepSpeed
(engine, ZeRO 1-3, BF16_Optimizer) reduces gradients over the sequence-data-parallel group (dp x sp ranks)
dividing by dp x sp / sp = dp, i.e. it SUMS over the SP ranks and averages over data parallelism: the
sum of the SP ranks' parts is exactly the full-sequence loss, so its gradient is the (1, 1, 1) gradient.
Except ZeRO-3: the pinned DeepSpeed's stage 3 reduce-scatter path (``__avg_scatter_grads``, its default
``reduce_scatter: true``, which the DeepSpeed config pins for Ulysses runs) averages over all dp x sp ranks,
so there each rank's part is multiplied by sp before the backward (:func:`backward_loss_scale`); measured:
without it the grad norm of a ZeRO-3 SP=2 run is exactly half the (1, 1, 1) one.

How it is wired, all of it at construction (this file and ``megatron/model/attention.py``):

- :func:`ulysses_exchange` turns this rank's ``ParallelState`` (its sp group, rank and size) into the model's
  ``SequenceExchange``; ``build_model_module`` passes it to ``GPTModel`` with the groups, and every
  ``SelfAttention`` is built complete from it: the rank's token offset (positions), the ALiBi slopes of the
  heads it attends with after the all-to-all, and :func:`distributed_attention` around its core attention.
  A model of an SP rank built without it is refused (``GPTModel``), so none is ever half configured;
- the batch: ``megatron.training.batches.sequence_slice`` gives each rank its s / sp tokens;
- the loss: ``ModelEngine`` (``megatron.engine.model_engine``) calls :func:`sequence_parallel_loss` and
  scales it by :func:`backward_loss_scale`; its ``DeepSpeedMPU`` hands DeepSpeed the dp x sp group.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
from deepspeed.sequence.layer import DistributedAttention

from megatron.model.attention import SequenceExchange
from megatron.parallel.state import ParallelState

__all__ = ["backward_loss_scale", "distributed_attention", "sequence_parallel_loss", "ulysses_exchange"]

# DistributedAttention's all-to-all indices for sequence-first [s, b, heads, hn] tensors: forward scatter the
# heads (dim 2) and gather the sequence (dim 0); the context goes back the other way.
SCATTER_HEADS, GATHER_SEQUENCE = 2, 0


def distributed_attention(sp_group, local_attention: Callable) -> DistributedAttention:
    """DeepSpeed's all-to-all attention over ``sp_group`` around ``local_attention`` (one per layer)."""
    return DistributedAttention(local_attention, sp_group, scatter_idx=SCATTER_HEADS, gather_idx=GATHER_SEQUENCE)


def ulysses_exchange(state: ParallelState) -> Optional[SequenceExchange]:
    """What the model's attention layers need for Ulysses over ``state.sp_group`` (``GPTModel``'s
    ``sequence_exchange``), each layer wrapping its core attention in its own DistributedAttention; None at SP 1."""
    if state.sp_size == 1:
        return None
    return SequenceExchange(state.sp_rank, state.sp_size, functools.partial(distributed_attention, state.sp_group))


def sequence_parallel_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, sp_group) -> torch.Tensor:
    """This rank's part of the micro-batch loss: sum over its tokens of loss * mask / the whole sequence's
    mask count (all-reduced over ``sp_group``, no gradient). per_token_loss, loss_mask [b, s/sp] -> scalar fp32.

    The SP ranks' parts add up to sum(loss * mask) / sum(mask) over the whole sequence, whatever the mask's
    spread over the slices (EOD masking). clamp: a micro-batch with nothing to count gives 0, not NaN.
    """
    mask = loss_mask.to(torch.float32)
    count = mask.sum()
    dist.all_reduce(count, group=sp_group)
    return (per_token_loss.float() * mask).sum() / count.clamp(min=1.0)


def backward_loss_scale(zero_stage: int, sp_size: int) -> float:
    """What this rank's loss part is multiplied by before the backward so that DeepSpeed's gradient
    reduction gives the whole-sequence gradient: sp under ZeRO-3 (it averages over dp x sp), else 1 (it
    sums over the SP ranks, averages over dp)."""
    return float(sp_size) if zero_stage == 3 else 1.0
