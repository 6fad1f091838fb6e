"""This rank's experts as one batched matmul: El MLPs of width f, each h -> f -> h (GeLU) or SwiGLU.

    W1 [El, fp, h] (SwiGLU: [El, 2 fp, h], rows interleaved [fp, 2]: gate, up; as ParallelMLP)
    W2 [El, h, fp]
    y = (act(x_e W1_e^T + b1_e) * p) W2_e^T + p b2_e     for the rows x_e of each local expert e, p each row's
                                                         routing weight (None: p = 1)

The routing weight is applied inside the activation, in its own dtype (--moe-router-dtype), as Megatron-LM's grouped
experts do (``_WeightedActivation``: it keeps only the first GEMM's output and the weights, and runs the activation
again in backward), so the combine needs no copy of the experts' outputs for the weights' gradient.

The rows arrive sorted by local expert (``counts`` each), i.e. as sorted segments, and run unpadded through
``torch._grouped_mm`` once per matrix (``weight_grad_store.segment_linear``; CPU fp32 / bf16, CUDA bf16). For
SwiGLU the interleaved gate / up rows of W1 are de-interleaved into a copy for the product (checkpoints keep the
interleaved layout); its output is [gate | up]. Where the kernel cannot run (another dtype or device, rows of
h or fp not a multiple of 16 bytes) the rows of all local experts are padded to the busiest expert's count C
and run through ``torch.bmm`` once per matrix (``weight_grad_store.grouped_linear``); one local expert needs
no padding and runs as one bmm. Measured (benchmarks/bench_moe.py, docs/performance.md): on CPU the segments
beat the padded bmm (whose waste grows with the imbalance) and a per-expert ``mm`` loop. Under ZB-H1
(``weight_grad_store`` set by ``defer_weight_grads``) both products defer their weight gradients to the store;
the biases' stay in the backward pass. With --fp8-format (``fp8``, set by ``fp8_linear.enable_fp8``) each
local expert's two products run as ``fp8_linear`` on its slices of W1 and W2 (one FP8 scaling per matrix for
all local experts; the weight gradients are not deferred under ZB-H1). Tensor
parallelism splits every expert along f exactly as the dense MLP is split: the input enters
through copy-to-TP (backward: all-reduce), the partial outputs are all-reduced before the bias.

Each expert's weights are drawn as the dense MLP's would be, under its own global name
(``layers.{i}.mlp.experts.{e}.dense_h_to_4h.weight``), full and then sliced: any EP x TP layout starts from the
same weights. The parameters carry ``expert_parallel = True`` (their gradients are averaged over the
expert-data-parallel group only) and the TP tags (``partition_dim`` 1 for W1, 2 for W2).

Shape letters: M rows (choices) this rank's experts got, El local experts, C the padded rows per expert,
h hidden, f expert width, fp = f / tp.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.moe.dispatch import local_expert_order, unpermute
from megatron.parallel.all_to_all import all_to_all
from megatron.parallel.fp8_linear import fp8_linear
from megatron.parallel.mappings import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region
from megatron.parallel.recompute import OutputDiscardingCheckpoint
from megatron.parallel.state import group_rank, group_size
from megatron.parallel.utils import fp32_empty, set_tensor_model_parallel_attributes
from megatron.parallel.weight_grad_store import grouped_linear, segment_linear

__all__ = ["GroupedExperts", "mark_expert_parallel", "is_expert_parallel"]


def mark_expert_parallel(param: torch.Tensor) -> None:
    param.expert_parallel = True


def is_expert_parallel(param: torch.Tensor) -> bool:
    """True for a parameter of one rank's experts (different experts on every EP rank)."""
    return bool(getattr(param, "expert_parallel", False))


def _stacked(full_shape: tuple[int, int], partition_dim: int, tp_group, init_methods: Sequence) -> nn.Parameter:
    """[El, *shard] from one full fp32 [o, i] weight per expert, each sliced along ``partition_dim`` for this TP
    rank."""
    per_partition = full_shape[partition_dim] // group_size(tp_group)
    start = group_rank(tp_group) * per_partition
    shards = []
    for init in init_methods:
        full = fp32_empty(full_shape)
        init(full)
        shards.append(full.narrow(partition_dim, start, per_partition))
    weight = nn.Parameter(torch.stack(shards))  # [El, ...]
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim + 1)
    mark_expert_parallel(weight)
    return weight


def _bias(num_experts: int, size: int, split: bool) -> nn.Parameter:
    bias = nn.Parameter(torch.zeros(num_experts, size))
    set_tensor_model_parallel_attributes(bias, is_parallel=split, dim=1)
    mark_expert_parallel(bias)
    return bias


def _padded_rows(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For rows grouped by expert (``counts`` [El]): each row's (expert, slot) in an [El, C] grid, and C."""
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)  # [M]
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(expert.numel(), device=counts.device) - starts[expert]  # [M]
    return expert, slot, int(counts.max()) if counts.numel() else 0


def _activation(hidden: torch.Tensor, swiglu: bool, pairs: str) -> torch.Tensor:
    """GeLU (tanh), or SwiGLU silu(gate) * up of ``hidden``'s halves ("halves": [gate | up]) or interleaved
    pairs ("interleaved": [fp, 2])."""
    if not swiglu:
        return F.gelu(hidden, approximate="tanh")
    gate, up = hidden.chunk(2, -1) if pairs == "halves" else hidden.unflatten(-1, (-1, 2)).unbind(-1)
    return F.silu(gate) * up


def _weighted(hidden: torch.Tensor, weight: torch.Tensor, swiglu: bool, pairs: str) -> torch.Tensor:
    """act(hidden) * weight per row, the product in the weight's dtype (--moe-router-dtype), in hidden's dtype."""
    return (_activation(hidden, swiglu, pairs).to(weight.dtype) * weight[..., None]).to(hidden.dtype)


class _WeightedActivation(torch.autograd.Function):
    """act(hidden) * weight, keeping for backward only its inputs (the first GEMM's output and the routing weights)
    and running the activation again there, as Megatron-LM's fused weighted SwiGLU does: the routing weights'
    gradient comes from act(hidden), so the experts' outputs need not be kept for it at the combine."""

    @staticmethod
    def forward(ctx, hidden, weight, swiglu: bool, pairs: str):
        ctx.save_for_backward(hidden, weight)
        ctx.swiglu, ctx.pairs = swiglu, pairs
        return _weighted(hidden, weight, swiglu, pairs)

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight = (t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _weighted(hidden, weight, ctx.swiglu, ctx.pairs)
        inputs = [t for t in (hidden, weight) if t.requires_grad]
        grads = iter(torch.autograd.grad(out, inputs, grad_output))
        return (next(grads) if hidden.requires_grad else None, next(grads) if weight.requires_grad else None,
                None, None)


class _WeightedBias(torch.autograd.Function):
    """bias[expert] * weight per row ([M, h]), in the weight's dtype; keeps the index and the weights for backward,
    not the gathered [M, h] rows (the weights' gradient gathers them again)."""

    @staticmethod
    def forward(ctx, bias, expert, weight):
        ctx.save_for_backward(bias, expert, weight)
        return bias[expert].to(weight.dtype) * weight[:, None]

    @staticmethod
    def backward(ctx, grad):
        bias, expert, weight = ctx.saved_tensors
        grad_weight = (grad * bias[expert].to(grad.dtype)).sum(-1) if ctx.needs_input_grad[2] else None
        grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_bias = torch.zeros_like(bias, dtype=grad.dtype).index_add(0, expert, grad * weight[:, None])
            grad_bias = grad_bias.to(bias.dtype)
        return grad_bias, None, grad_weight


_GROUPED_MM: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``device`` in ``dtype`` (probed once on a toy, then cached)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM:
        try:
            x = torch.zeros(4, 16, device=device, dtype=dtype)
            w = torch.zeros(2, 16, 16, device=device, dtype=dtype)
            torch._grouped_mm(x, w, offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
            _GROUPED_MM[key] = True
        except (RuntimeError, AttributeError, NotImplementedError):
            _GROUPED_MM[key] = False
    return _GROUPED_MM[key]


class GroupedExperts(nn.Module):
    """The experts ``expert_ids`` (global indices) of one layer, tensor-parallel over ``tp_group``.

    Args:
        hidden_size, ffn_size: h and f.
        expert_ids: the global indices of the experts this rank holds.
        swiglu: SwiGLU experts (else GeLU, tanh approximation).
        bias: biases (fc1_bias, fc2_bias) per expert.
        w1_init, w2_init: ``f(expert_id) -> init_method`` filling a full fp32 [o, i] weight.
        tp_group: the tensor-parallel group (None: one rank).
    """

    def __init__(self, hidden_size: int, ffn_size: int, expert_ids: Sequence[int], *, swiglu: bool, bias: bool,
                 w1_init, w2_init, tp_group=None):
        super().__init__()
        self.swiglu, self.tp_group = swiglu, tp_group
        width = 2 * ffn_size if swiglu else ffn_size
        self.w1 = _stacked((width, hidden_size), 0, tp_group, [w1_init(e) for e in expert_ids])  # [El, fp, h]
        self.w2 = _stacked((hidden_size, ffn_size), 1, tp_group, [w2_init(e) for e in expert_ids])  # [El, h, fp]
        self.fc1_bias = _bias(len(expert_ids), width // group_size(tp_group), True) if bias else None
        self.fc2_bias = _bias(len(expert_ids), hidden_size, False) if bias else None
        self.weight_grad_store = None  # ZB-H1: where W1's and W2's gradients are deferred (weight_grad_store.py)
        self.recompute_activation = False  # --recompute-modules moe_act: the activation recomputed in backward
        # --fp8-format: a ModuleDict {"w1", "w2"} of FP8Scaling (fp8_linear.enable_fp8), one per matrix for all
        # local experts; W1 is split over TP by its rows (its output), W2 by its columns (its input)
        self.fp8 = None
        self.fp8_operand_sharding = {"w1": (False, True, True), "w2": (True, True, False)}
        self.path = "auto"  # "segments" (torch._grouped_mm), "padded" (bmm) or "auto": segments where they run

    def _activation(self, hidden: torch.Tensor, pairs: str, weight=None) -> torch.Tensor:
        """GeLU (tanh), or SwiGLU silu(gate) * up of ``hidden``'s halves ("halves": [gate | up]) or interleaved
        pairs ("interleaved": [fp, 2]); times the rows' routing ``weight`` (hidden's shape less its last dim) when
        given (``_WeightedActivation``)."""
        if weight is None:
            return _activation(hidden, self.swiglu, pairs)
        if not torch.is_grad_enabled():
            return _weighted(hidden, weight, self.swiglu, pairs)
        return _WeightedActivation.apply(hidden, weight, self.swiglu, pairs)

    def _activation_then(self, hidden: torch.Tensor, pairs: str, second, weight=None) -> torch.Tensor:
        """``second(activation(hidden) [* weight])``; with ``recompute_activation`` (--recompute-modules moe_act)
        the activation's output is freed once ``second`` ran and recomputed in backward
        (megatron.parallel.recompute)."""
        if not (self.recompute_activation and torch.is_grad_enabled() and hidden.requires_grad):
            return second(self._activation(hidden, pairs, weight))
        part = OutputDiscardingCheckpoint()
        if weight is None:
            out = second(part(lambda x: self._activation(x, pairs), hidden))
        else:
            out = second(part(lambda x, w: self._activation(x, pairs, w), hidden, weight))
        part.discard(out)
        return out

    def uses_segments(self, rows: torch.Tensor) -> bool:
        """Whether ``rows`` go through the unpadded segments (``path``, the kernel, 16-byte aligned strides)."""
        if self.path == "padded":
            return False
        width = rows.element_size()
        aligned = all(n * width % 16 == 0 for n in (rows.shape[-1], self.w1.shape[1], self.w2.shape[-1]))
        runs = aligned and self.w1.dtype == rows.dtype and grouped_mm_runs(rows.device, rows.dtype)
        if self.path == "segments" and not runs:
            raise ValueError(f"torch._grouped_mm does not run here ({rows.device.type}, {rows.dtype}, h "
                             f"{rows.shape[-1]}, W1 rows {self.w1.shape[1]}, fp {self.w2.shape[-1]})")
        return runs

    def _segments(self, rows: torch.Tensor, counts: torch.Tensor, weight=None) -> torch.Tensor:
        """rows [M, h] sorted by expert -> partial output [M, h], unpadded (this TP rank's share of f)."""
        offs = torch.cumsum(counts, 0).to(device=rows.device, dtype=torch.int32)  # [El] each segment's end
        hidden = segment_linear(rows.contiguous(), self.w1, offs, self.weight_grad_store, paired_rows=self.swiglu)
        if self.fc1_bias is not None:  # [M, fp] (swiglu: [M, 2 fp], [gate | up])
            bias = self.fc1_bias
            if self.swiglu:
                bias = bias.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # [El, 2 fp] as [gate | up]
            expert = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts.to(rows.device))
            hidden = hidden + bias[expert]  # [M, 2 fp]
        return self._activation_then(  # swiglu: [gate | up] -> [M, fp]
            hidden, "halves", lambda act: segment_linear(act, self.w2, offs, self.weight_grad_store),
            weight)  # [M, h]

    def _mlp(self, x: torch.Tensor, weight=None) -> torch.Tensor:
        """x [El, C, h] (and its rows' weights [El, C]) -> partial output [El, C, h] (this TP rank's share of f)."""
        hidden = grouped_linear(x, self.w1, self.weight_grad_store)  # [El, C, fp] (swiglu: [El, C, 2 fp])
        if self.fc1_bias is not None:
            hidden = hidden + self.fc1_bias[:, None, :]
        return self._activation_then(  # swiglu: interleaved pairs -> [El, C, fp]
            hidden, "interleaved", lambda act: grouped_linear(act, self.w2, self.weight_grad_store),
            weight)  # [El, C, h]

    def _fp8_experts(self, rows: torch.Tensor, counts: torch.Tensor, weight=None) -> torch.Tensor:
        """rows [M, h] grouped by local expert -> partial output [M, h]: each expert's two products with FP8
        operands (``fp8_linear`` on its slices of W1 and W2; the weight gradients through autograd, not deferred)."""
        outputs = []
        sizes = counts.tolist()
        weights = weight.split(sizes) if weight is not None else [None] * len(sizes)
        for e, (part, part_weight) in enumerate(zip(rows.split(sizes), weights)):  # [M_e, h], [M_e]
            if part.shape[0] == 0:
                outputs.append(part)
                continue
            hidden = fp8_linear(part, self.w1[e], None if self.fc1_bias is None else self.fc1_bias[e],
                                self.fp8["w1"])  # [M_e, fp] (swiglu: [M_e, 2 fp], interleaved pairs)
            outputs.append(self._activation_then(hidden, "interleaved", lambda act, e=e: fp8_linear(
                act, self.w2[e], None, self.fp8["w2"]), part_weight))  # [M_e, h]
        return torch.cat(outputs)

    def _partial(self, rows: torch.Tensor, counts: torch.Tensor, weight=None) -> torch.Tensor:
        """rows [M, h] grouped by local expert -> this TP rank's partial output [M, h] (no output bias)."""
        if self.fp8 is not None:
            return self._fp8_experts(rows, counts, weight)
        if self.w1.shape[0] == 1:
            return self._mlp(rows[None], None if weight is None else weight[None])[0]  # [M, h]
        if self.uses_segments(rows):
            return self._segments(rows, counts, weight)
        expert, slot, capacity = _padded_rows(counts)
        grid = rows.new_zeros(self.w1.shape[0], capacity, rows.shape[-1])  # [El, C, h]
        grid = grid.index_put((expert, slot), rows)
        if weight is not None:
            weight = weight.new_zeros(self.w1.shape[0], capacity).index_put((expert, slot), weight)  # [El, C]
        return self._mlp(grid, weight)[expert, slot]  # [M, h]

    def _output_bias(self, out: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor, weight=None) -> torch.Tensor:
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=out.device), counts)  # [M]
        if weight is None:
            return out + bias[expert]
        return out + _WeightedBias.apply(bias, expert, weight).to(out.dtype)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, weight=None) -> torch.Tensor:
        """rows [M, h] grouped by local expert, ``counts`` [El] rows each -> [M, h] (every TP rank holds the same
        rows). ``weight`` [M]: the rows' routing weights (in the dtype the weighting runs in, --moe-router-dtype),
        applied in the activation (act(x W1^T + b1) * w, then W2, + w b2: Megatron-LM's order): the outputs are
        then summed per token as they are (None: unweighted outputs)."""
        rows = copy_to_tensor_model_parallel_region(rows, self.tp_group)
        # each TP rank's share of f gives a part of the weights' gradient: summed over TP (the output bias's part is
        # whole on every rank: not summed)
        shared = None if weight is None else copy_to_tensor_model_parallel_region(weight, self.tp_group)
        out = reduce_from_tensor_model_parallel_region(self._partial(rows, counts, shared), self.tp_group)
        return out if self.fc2_bias is None else self._output_bias(out, counts, self.fc2_bias, weight)

    def forward_tp_shards(self, rows: torch.Tensor, counts: torch.Tensor, weight=None) -> torch.Tensor:
        """rows [M, h] grouped by local expert, ``counts`` [El] rows each -> [M, h], where each TP rank holds other
        rows (Megatron-LM's all-to-all order under sequence parallelism: the TP ranks routed their own tokens):
        every TP rank's rows gathered (M_t each; backward: the partial input gradients summed back to their rank),
        regrouped by local expert, this rank's share of f computed on all of them, and the partial outputs
        reduce-scattered to the rows' ranks (summed over TP in rank order); then the output bias, whose gradient,
        from this rank's rows only, enters through copy-to-TP (summed over TP)."""
        tp = group_size(self.tp_group)
        if tp == 1:
            return self.forward(rows, counts, weight)
        every = [torch.empty_like(counts) for _ in range(tp)]
        torch.distributed.all_gather(every, counts, group=self.tp_group)
        every = torch.stack(every)  # [tp, El]
        sizes, mine = every.sum(1).tolist(), rows.shape[0]
        gathered = all_to_all(rows.repeat(tp, 1), self.tp_group, sizes, [mine] * tp)  # [sum M_t, h] by source
        order = local_expert_order(every)  # by local expert, then source rank
        every_weight = None
        if weight is not None:  # [sum M_t], the same order
            every_weight = all_to_all(weight[:, None].repeat(tp, 1), self.tp_group, sizes, [mine] * tp)[:, 0]
            every_weight = every_weight.index_select(0, order)
        out = self._partial(gathered.index_select(0, order), every.sum(0), every_weight)
        by_source = unpermute(out, order)
        out = all_to_all(by_source, self.tp_group, [mine] * tp, sizes).view(tp, mine, -1).sum(0)  # [M, h]
        if self.fc2_bias is None:
            return out
        return self._output_bias(out, counts, copy_to_tensor_model_parallel_region(self.fc2_bias, self.tp_group),
                                 weight)
