"""Deferred weight gradients for zero-bubble pipeline schedules (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline
Parallelism").

A linear layer's backward is two independent products: the input gradient dX = dY A (what the previous
pipeline stage waits for) and the weight gradient dA = dY^T X (what only the optimizer step needs). ZB-H1 runs
the first in the backward pass (B) and keeps the second as a closure (W) that the schedule runs later, in a slot
where the stage would otherwise wait.

    store = WeightGradStore()
    defer_weight_grads(module, store)      every layer that can split its backward now defers into store
    loss.backward()                        B: input gradients (and biases); weight products queued
    store.close_micro_batch()              the queued products form one W pass
    store.run_oldest()                     W: dA accumulated into weight.grad, oldest micro-batch first

A layer that can defer carries ``weight_grad_store`` (None: the plain ``F.linear`` / ``torch.bmm``, autograd
computes both products, bit for bit as before). Column/RowParallelLinear, the vocab-parallel heads, the MoE
router (``linear`` on a weight of another dtype: it computes in the input's, fp32) and the grouped experts
(``grouped_linear``: one batched product per matrix over G padded groups; ``segment_linear``: one
``torch._grouped_mm`` per matrix over G sorted, unpadded row segments) do.

Shape letters: t tokens (every leading dim flattened), h input features, o output features, G groups (experts).
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["WeightGradStore", "linear", "grouped_linear", "segment_linear", "defer_weight_grads", "defer_weight_grad"]


class WeightGradStore:
    """A queue of deferred weight-gradient products, grouped by the backward pass (micro-batch) that made them."""

    def __init__(self):
        self._open: list[Callable[[], None]] = []            # products of the backward pass running now
        self._closed: deque[list[Callable[[], None]]] = deque()  # one W pass each, oldest first

    def defer(self, product: Callable[[], None]) -> None:
        self._open.append(product)

    def close_micro_batch(self) -> None:
        """End of a backward pass: what it deferred becomes one W pass (possibly empty: a stage without linears)."""
        self._closed.append(self._open)
        self._open = []

    @property
    def num_pending(self) -> int:
        """W passes waiting to run."""
        return len(self._closed)

    def run_oldest(self) -> None:
        """Run the oldest W pass: accumulate its weight gradients into ``.grad``."""
        if not self._closed:
            raise AssertionError("a W pass was scheduled with no deferred backward pass waiting")
        for product in self._closed.popleft():
            product()

    def assert_empty(self) -> None:
        if self._open or self._closed:
            raise AssertionError(f"{len(self._closed)} W passes (and {len(self._open)} products of an open backward "
                                 f"pass) still deferred: the optimizer would step on incomplete gradients")


def _accumulate(weight: torch.nn.Parameter, grad_weight: torch.Tensor) -> None:
    grad_weight = grad_weight.to(weight.dtype)  # a weight cast to the input's dtype: autograd's cast back
    if weight.grad is None:
        weight.grad = grad_weight
    else:
        weight.grad.add_(grad_weight)


@torch.no_grad()
def _accumulate_weight_grad(weight: torch.nn.Parameter, x: torch.Tensor, grad_output: torch.Tensor) -> None:
    # dA [o, h] = dY^T [o, t] @ X [t, h]
    _accumulate(weight, grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1])))


def defer_weight_grad(store: "WeightGradStore", weight: torch.nn.Parameter, x: torch.Tensor,
                      grad_output: torch.Tensor) -> None:
    """Defer a linear layer's dW = dY^T X (accumulated into ``weight.grad``) to ``store``'s weight pass."""
    store.defer(partial(_accumulate_weight_grad, weight, x, grad_output))


@torch.no_grad()
def _accumulate_grouped_weight_grad(weight: torch.nn.Parameter, x: torch.Tensor, grad_output: torch.Tensor) -> None:
    # dW [G, o, h] = dY^T [G, o, t] @ X [G, t, h]
    _accumulate(weight, torch.bmm(grad_output.transpose(1, 2), x))


class _LinearDeferredWeightGrad(torch.autograd.Function):
    """Y = X A^T + b (A in X's dtype) whose backward returns dX and db and defers dA to the store."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x)
        # The parameter itself, not a saved tensor: under activation recomputation a saved tensor comes back as
        # a recomputed alias, and a .grad set on that alias would never reach the parameter.
        ctx.weight, ctx.store, ctx.has_bias = weight, store, bias is not None
        return F.linear(x, weight.to(x.dtype), bias)  # [.., o]

    @staticmethod
    def backward(ctx, grad_output):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_input = grad_output.matmul(weight.to(grad_output.dtype)) if ctx.needs_input_grad[0] else None  # [.., h]
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.has_bias else None  # [o]
        if ctx.needs_input_grad[1]:
            ctx.store.defer(partial(_accumulate_weight_grad, weight, x, grad_output))
        return grad_input, None, grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           store: Optional[WeightGradStore]) -> torch.Tensor:
    """``F.linear(x, weight.to(x.dtype), bias)`` (the cast a no-op where the dtypes agree); with a store, the
    weight gradient is deferred to it, cast back to the weight's dtype (outside grad mode, e.g. evaluation,
    nothing is deferred)."""
    if store is None or not torch.is_grad_enabled():
        return F.linear(x, weight.to(x.dtype), bias)
    return _LinearDeferredWeightGrad.apply(x, weight, bias, store)


class _GroupedDeferredWeightGrad(torch.autograd.Function):
    """Y_g = X_g W_g^T for every group g (one ``torch.bmm``) whose backward returns dX and defers dW."""

    @staticmethod
    def forward(ctx, x, weight, store):
        ctx.save_for_backward(x)
        ctx.weight, ctx.store = weight, store  # the parameter itself (see _LinearDeferredWeightGrad)
        return torch.bmm(x, weight.transpose(1, 2))  # [G, t, o]

    @staticmethod
    def backward(ctx, grad_output):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_input = torch.bmm(grad_output, weight) if ctx.needs_input_grad[0] else None  # [G, t, h]
        if ctx.needs_input_grad[1]:
            ctx.store.defer(partial(_accumulate_grouped_weight_grad, weight, x, grad_output))
        return grad_input, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, store: Optional[WeightGradStore]) -> torch.Tensor:
    """x [G, t, h], weight [G, o, h] -> [G, t, o]: ``torch.bmm(x, weight^T)``; with a store, the weight gradient
    is deferred to it (outside grad mode nothing is)."""
    if store is None or not torch.is_grad_enabled():
        return torch.bmm(x, weight.transpose(1, 2))
    return _GroupedDeferredWeightGrad.apply(x, weight, store)


def _paired_to_halves(weight: torch.Tensor) -> torch.Tensor:
    """[G, 2n, h] with rows a_0, b_0, a_1, b_1, ... -> a copy with rows a_0 .. a_n-1, b_0 .. b_n-1."""
    return weight.unflatten(1, (-1, 2)).transpose(1, 2).reshape(weight.shape)


def _halves_to_paired(weight: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_paired_to_halves``."""
    return weight.unflatten(1, (2, -1)).transpose(1, 2).reshape(weight.shape)


def _segment_weight_grad(x: torch.Tensor, grad_output: torch.Tensor, offs: torch.Tensor,
                         paired_rows: bool) -> torch.Tensor:
    # dW [G, o, h]: dY_g^T [o, t_g] @ X_g [t_g, h] for every segment g (zeros for an empty one)
    grad = torch._grouped_mm(grad_output.t(), x, offs=offs)
    return _halves_to_paired(grad) if paired_rows else grad


@torch.no_grad()
def _accumulate_segment_weight_grad(weight: torch.nn.Parameter, x: torch.Tensor, grad_output: torch.Tensor,
                                    offs: torch.Tensor, paired_rows: bool) -> None:
    _accumulate(weight, _segment_weight_grad(x, grad_output, offs, paired_rows))


class _SegmentLinear(torch.autograd.Function):
    """Y_g = X_g W_g^T for every sorted row segment g (one ``torch._grouped_mm``); the backward returns dX and
    computes dW at once (no store) or defers it to the store."""

    @staticmethod
    def forward(ctx, x, weight, offs, store, paired_rows):
        ctx.save_for_backward(x, offs)
        ctx.weight, ctx.store, ctx.paired_rows = weight, store, paired_rows  # the parameter (_LinearDeferred...)
        w = _paired_to_halves(weight) if paired_rows else weight
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)  # [t, o]

    @staticmethod
    def backward(ctx, grad_output):
        (x, offs), weight = ctx.saved_tensors, ctx.weight
        grad_output = grad_output.contiguous()  # the kernel wants 16-byte aligned strides
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            w = _paired_to_halves(weight) if ctx.paired_rows else weight
            grad_input = torch._grouped_mm(grad_output, w.to(grad_output.dtype), offs=offs)  # [t, h]
        if ctx.needs_input_grad[1]:
            if ctx.store is None:
                grad_weight = _segment_weight_grad(x, grad_output, offs, ctx.paired_rows)
            else:
                ctx.store.defer(partial(_accumulate_segment_weight_grad, weight, x, grad_output, offs,
                                        ctx.paired_rows))
        return grad_input, grad_weight, None, None, None


def segment_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, store: Optional[WeightGradStore],
                   paired_rows: bool = False) -> torch.Tensor:
    """x [t, h] sorted into G segments ending at ``offs`` (int32 [G], cumulative row counts), weight [G, o, h]
    -> [t, o]: ``X_g W_g^T`` per segment, no padding. ``paired_rows``: the weight's rows are interleaved pairs
    (a_0, b_0, a_1, ...; SwiGLU's gate / up) and the output's columns come out as halves [a | b] (the product
    runs on a de-interleaved copy; gradients reach the weight in its own layout). With a store, the weight
    gradient is deferred to it (outside grad mode nothing is). Needs ``torch._grouped_mm`` for x's device and
    dtype and 16-byte aligned rows (h and o)."""
    if not torch.is_grad_enabled():
        w = _paired_to_halves(weight) if paired_rows else weight
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    return _SegmentLinear.apply(x, weight, offs, store, paired_rows)


def defer_weight_grads(module: torch.nn.Module, store: Optional[WeightGradStore]) -> int:
    """Point every sub-module that can defer its weight gradient (it carries ``weight_grad_store``) at ``store``
    (None: back to plain autograd); the number of such modules."""
    layers = [m for m in module.modules() if hasattr(m, "weight_grad_store")]
    for layer in layers:
        layer.weight_grad_store = store
    return len(layers)
