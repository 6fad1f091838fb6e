"""Cross-entropy over logits whose vocabulary dimension is split across the tensor-parallel group.

    loss = log(sum_j exp(z_j - m)) - (z_t - m),     m = max_j z_j over the FULL vocabulary

computed without ever gathering the [s, b, v] logits: each rank holds [s, b, vp], and two
all-reduces over the TP group (the MAX of m, then one SUM of three per-token numbers) give every
rank the same per-token loss. The math runs in fp32 whatever the logits' dtype. The backward is the
closed form softmax - onehot, written into the softmax buffer kept from the forward (no second
[s, b, vp] copy is kept).

Shape letters: s sequence, b micro-batch, v / vp vocabulary (per partition), tp the TP group size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.parallel.state import group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy"]


def _all_reduce_(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    # x is always a private buffer created in this file, so reducing in place is safe.
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _shifted_fp32_logits(vocab_parallel_logits: torch.Tensor, group) -> torch.Tensor:
    """z - max(z) in a fresh fp32 buffer; the max is over the full vocabulary (all-reduce MAX)."""
    logits_max = vocab_parallel_logits.max(dim=-1)[0].float()  # [s, b]
    _all_reduce_(logits_max, group, op=dist.ReduceOp.MAX)
    if vocab_parallel_logits.dtype == torch.float32:
        # Never modify the caller's fp32 logits: subtracting out of place makes the one copy.
        return (vocab_parallel_logits - logits_max.unsqueeze(-1)).contiguous()  # [s, b, vp]
    shifted = vocab_parallel_logits.float().contiguous()  # [s, b, vp], the one copy
    return shifted.sub_(logits_max.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """forward: per-token cross-entropy from vocab-split logits, backward: softmax - onehot."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group, label_smoothing):
        vp = vocab_parallel_logits.size(-1)
        vocab_size = vp * group_size(group)
        vocab_start = group_rank(group) * vp
        shifted = _shifted_fp32_logits(vocab_parallel_logits, group)  # [s, b, vp] fp32

        # Targets owned by another rank contribute 0 here; the SUM all-reduce adds the owner's value.
        outside = (target < vocab_start) | (target >= vocab_start + vp)  # [s, b]
        local_target = (target - vocab_start).masked_fill_(outside, 0)  # [s, b]
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [s, b]
        predicted.masked_fill_(outside, 0.0)
        sum_shifted = shifted.sum(dim=-1) if label_smoothing > 0 else torch.zeros_like(predicted)

        exp_logits = torch.exp(shifted, out=shifted)  # [s, b, vp], reuses the buffer
        # One SUM all-reduce for the three per-token numbers instead of three collectives.
        sums = torch.stack([predicted, exp_logits.sum(dim=-1), sum_shifted])  # [3, s, b]
        predicted, sum_exp, sum_shifted = _all_reduce_(sums, group).unbind(0)

        log_sum_exp = torch.log(sum_exp)  # [s, b]
        loss = log_sum_exp - predicted  # [s, b], -log p_target
        if label_smoothing > 0:
            # PyTorch's definition: (1 - eps) * nll + eps * mean_j(-log p_j).
            smooth_loss = log_sum_exp - sum_shifted / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth_loss

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))  # [s, b, vp], still the same buffer
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.logits_dtype = vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, local_target, outside = ctx.saved_tensors
        eps, vocab_size = ctx.label_smoothing, ctx.vocab_size
        # d loss / d z = softmax - (1 - eps) * onehot - eps / v, written into the saved buffer
        # (a second backward through the same graph is then refused by autograd's version check).
        grad_input = softmax
        grad_2d = grad_input.view(-1, grad_input.size(-1))  # [s*b, vp]
        rows = torch.arange(grad_2d.size(0), device=grad_2d.device)
        onehot_weight = (1.0 - eps) * (~outside).reshape(-1).to(grad_2d.dtype)  # [s*b]
        grad_2d[rows, local_target.reshape(-1)] -= onehot_weight
        if eps > 0:
            grad_input.sub_(eps / vocab_size)
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 tp_group, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross-entropy of vocab-split logits; equals F.cross_entropy on the gathered logits.

    Args:
        vocab_parallel_logits: [s, b, vp] (any leading dims), this rank's slice of the vocabulary;
            rank i holds vocabulary entries [i * vp, (i+1) * vp). Any float dtype; math is fp32.
        target: [s, b] integer token ids in [0, vp * tp), the same on every TP rank.
        tp_group: the tensor-parallel process group (None: one rank, plain cross-entropy).
        label_smoothing: eps in [0, 1), as in torch.nn.functional.cross_entropy.

    Returns the fp32 loss with ``target``'s shape, identical on every TP rank.
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(vocab_parallel_logits.shape)} and target "
                         f"{tuple(target.shape)} must agree on every dimension but the last")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group,
                                            float(label_smoothing))
