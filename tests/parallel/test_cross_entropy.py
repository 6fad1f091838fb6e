"""vocab_parallel_cross_entropy equals F.cross_entropy on the gathered logits: per-token loss and
the gradient of the logits, at TP = 1, 2, 4, with and without label smoothing, for logits of
magnitude 1e4 (no inf / nan) and for bf16 logits (math in fp32), within the tolerances of their depth
(megatron.testing.tolerance)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.state import group_rank, group_size
from megatron.testing.tolerance import tolerance
from tests.helpers.parallel import randn, rel_err, run_on_tp

S, B, V = 5, 3, 32  # V divisible by 4
# Relative to the largest reference value (rel_err), both sides fp32 on the same logits:
# the loss: the shift by the max, exp, the sum over the vocabulary (split over the ranks, then all-reduced),
# log, the target's subtraction, and label smoothing's mean of the shifted logits and mix (3): depth 8.
LOSS_RTOL = tolerance(torch.float32, 8, V)
# the gradient: the shift, exp, the sum, the division, the one-hot's subtraction, the upstream product: depth 6.
GRAD_RTOL = tolerance(torch.float32, 6, V)
# bf16 logits: that fp32 gradient rounded once to bf16 (at most half a bf16 epsilon: the bound holds with a
# factor of 2 on any CPU).
BF16_GRAD_RTOL = tolerance(torch.bfloat16, 1, 1) + GRAD_RTOL


def _reference(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, eps: float):
    """(per-token loss, d sum(loss * weight) / d logits) from F.cross_entropy on the full vocabulary."""
    logits = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(logits.view(-1, V), target.view(-1), reduction="none",
                           label_smoothing=eps).view(target.shape)
    (loss * weight).sum().backward()
    return loss.detach(), logits.grad


def _compare(tp_group, logits: torch.Tensor, target, eps: float) -> dict:
    tp, rank = group_size(tp_group), group_rank(tp_group)
    weight = randn(S, B, seed=3)  # per-token upstream gradient, e.g. a loss mask / mean
    ref_loss, ref_grad = _reference(logits, target, weight, eps)
    local = logits.chunk(tp, -1)[rank].clone().requires_grad_()  # [s, b, vp]
    local_before = local.detach().clone()
    loss = vocab_parallel_cross_entropy(local, target, tp_group, label_smoothing=eps)
    (loss * weight).sum().backward()
    assert torch.equal(local.detach(), local_before), f"rank {rank}: the logits were modified"
    assert loss.dtype == torch.float32 and local.grad.dtype == logits.dtype, f"rank {rank}"
    assert torch.isfinite(loss).all() and torch.isfinite(local.grad).all(), f"rank {rank}: inf/nan"
    return {"loss": rel_err(loss, ref_loss),
            "grad": rel_err(local.grad.float(), ref_grad.chunk(tp, -1)[rank])}


def _cross_entropy_worker(tp_group) -> dict:
    logits = randn(S, B, V, seed=1) * 3.0
    target = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(2))
    target[0, :2] = torch.tensor([0, V - 1])  # first and last id: owned by the first / last rank
    errors = {}
    for name, values, eps in [("plain", logits, 0.0), ("label smoothing 0.1", logits, 0.1),
                              ("logits ~1e4", logits * 1e4 / 3.0, 0.0),
                              ("logits ~1e4, smoothing", logits * 1e4 / 3.0, 0.2)]:
        for what, err in _compare(tp_group, values, target, eps).items():
            errors[f"{name} {what}"] = err
    # bf16 logits: the loss is fp32 math on the bf16 values; the gradient is rounded to bf16.
    bf16 = _compare(tp_group, logits.to(torch.bfloat16), target, 0.0)
    errors["bf16 loss"] = bf16["loss"]
    errors["bf16 grad"] = bf16["grad"]
    return errors


TP_SIZES = [1, pytest.param(2, marks=pytest.mark.multiprocess),
            pytest.param(4, marks=pytest.mark.multiprocess)]


@pytest.mark.parametrize("tp", TP_SIZES)
def test_matches_torch_cross_entropy(tp):
    results = run_on_tp(_cross_entropy_worker, tp)
    assert len(results[0]) == 10, sorted(results[0])
    for rank, errors in enumerate(results):
        for name, err in errors.items():
            where = f"rank {rank} of tp={tp}: {name} relative error {err:.3g}"
            if name == "bf16 grad":
                assert err <= BF16_GRAD_RTOL, where
            elif name.endswith("grad"):
                assert err <= GRAD_RTOL, where
            else:
                assert err <= LOSS_RTOL, where


def test_huge_logits_stay_finite_and_exact():
    # One dominant logit at 1e4: a naive exp() overflows to inf; the shifted form gives loss 0 / 1e4.
    logits = torch.zeros(1, 2, 8)
    logits[0, :, 3] = 1e4
    target = torch.tensor([[3, 5]])
    loss = vocab_parallel_cross_entropy(logits, target, None)
    assert torch.isfinite(loss).all(), loss
    # Exact: the shifted logits are 0 and -1e4, exp gives 1 and 0, so the log-sum-exp is log 1 = 0.
    assert loss[0, 0].item() == 0.0 and loss[0, 1].item() == 1e4, loss


def test_any_leading_dims_and_shape_check():
    logits = randn(7, V, seed=4).requires_grad_()
    target = torch.arange(7)
    loss = vocab_parallel_cross_entropy(logits, target, None)
    expected = F.cross_entropy(logits, target, reduction="none")
    assert rel_err(loss, expected) <= LOSS_RTOL
    with pytest.raises(ValueError, match=r"\(7, 32\).*\(6,\)"):
        vocab_parallel_cross_entropy(logits, torch.arange(6), None)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        vocab_parallel_cross_entropy(logits, target, None, label_smoothing=1.0)


def test_second_backward_is_refused_not_wrong():
    # The backward writes the gradient into the saved softmax buffer to avoid a second copy.
    logits = randn(2, 3, V, seed=5).requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long), None).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
