"""This rank's experts as one batched matmul: El MLPs of width f, each h -> f -> h (GeLU) or SwiGLU.

    W1 [El, fp, h] (SwiGLU: [El, 2 fp, h], rows interleaved [fp, 2]: gate, up; as ParallelMLP)
    W2 [El, h, fp]
    y = act(x_e W1_e^T + b1_e) W2_e^T + b2_e     for the rows x_e of each local expert e

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

    def _activation(self, hidden: torch.Tensor, pairs: str) -> torch.Tensor:
        """GeLU (tanh), or SwiGLU silu(gate) * up of ``hidden``'s halves ("halves": [gate | up]) or interleaved
        pairs ("interleaved": [fp, 2])."""
        if not self.swiglu:
            return F.gelu(hidden, approximate="tanh")
        gate, up = hidden.chunk(2, -1) if pairs == "halves" else hidden.unflatten(-1, (-1, 2)).unbind(-1)
        return F.silu(gate) * up

    def _activation_then(self, hidden: torch.Tensor, pairs: str, second) -> torch.Tensor:
        """``second(activation(hidden))``; with ``recompute_activation`` (--recompute-modules moe_act) the
        activation's output and its intermediates are freed once ``second`` ran and recomputed in backward
        (megatron.parallel.recompute)."""
        if not (self.recompute_activation and torch.is_grad_enabled() and hidden.requires_grad):
            return second(self._activation(hidden, pairs))
        part = OutputDiscardingCheckpoint()
        out = second(part(lambda x: self._activation(x, pairs), hidden))
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

    def _segments(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
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
            hidden, "halves", lambda act: segment_linear(act, self.w2, offs, self.weight_grad_store))  # [M, h]

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """x [El, C, h] -> partial output [El, C, h] (this TP rank's share of f)."""
        hidden = grouped_linear(x, self.w1, self.weight_grad_store)  # [El, C, fp] (swiglu: [El, C, 2 fp])
        if self.fc1_bias is not None:
            hidden = hidden + self.fc1_bias[:, None, :]
        return self._activation_then(  # swiglu: interleaved pairs -> [El, C, fp]
            hidden, "interleaved", lambda act: grouped_linear(act, self.w2, self.weight_grad_store))  # [El, C, h]

    def _fp8_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [M, h] grouped by local expert -> partial output [M, h]: each expert's two products with FP8
        operands (``fp8_linear`` on its slices of W1 and W2; the weight gradients through autograd, not deferred)."""
        outputs = []
        for e, part in enumerate(rows.split(counts.tolist())):  # [M_e, h]
            if part.shape[0] == 0:
                outputs.append(part)
                continue
            hidden = fp8_linear(part, self.w1[e], None if self.fc1_bias is None else self.fc1_bias[e],
                                self.fp8["w1"])  # [M_e, fp] (swiglu: [M_e, 2 fp], interleaved pairs)
            outputs.append(self._activation_then(hidden, "interleaved", lambda act, e=e: fp8_linear(
                act, self.w2[e], None, self.fp8["w2"])))  # [M_e, h]
        return torch.cat(outputs)

    def _partial(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [M, h] grouped by local expert -> this TP rank's partial output [M, h] (no output bias)."""
        if self.fp8 is not None:
            return self._fp8_experts(rows, counts)
        if self.w1.shape[0] == 1:
            return self._mlp(rows[None])[0]  # [M, h]
        if self.uses_segments(rows):
            return self._segments(rows, counts)
        expert, slot, capacity = _padded_rows(counts)
        grid = rows.new_zeros(self.w1.shape[0], capacity, rows.shape[-1])  # [El, C, h]
        grid = grid.index_put((expert, slot), rows)
        return self._mlp(grid)[expert, slot]  # [M, h]

    def _output_bias(self, out: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return out + bias[torch.repeat_interleave(torch.arange(counts.numel(), device=out.device), counts)]

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [M, h] grouped by local expert, ``counts`` [El] rows each -> [M, h] (every TP rank holds the same
        rows)."""
        rows = copy_to_tensor_model_parallel_region(rows, self.tp_group)
        out = reduce_from_tensor_model_parallel_region(self._partial(rows, counts), self.tp_group)
        return out if self.fc2_bias is None else self._output_bias(out, counts, self.fc2_bias)

    def forward_tp_shards(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [M, h] grouped by local expert, ``counts`` [El] rows each -> [M, h], where each TP rank holds other
        rows (Megatron-LM's all-to-all order under sequence parallelism: the TP ranks routed their own tokens):
        every TP rank's rows gathered (M_t each; backward: the partial input gradients summed back to their rank),
        regrouped by local expert, this rank's share of f computed on all of them, and the partial outputs
        reduce-scattered to the rows' ranks (summed over TP in rank order); then the output bias, whose gradient,
        from this rank's rows only, enters through copy-to-TP (summed over TP)."""
        tp = group_size(self.tp_group)
        if tp == 1:
            return self.forward(rows, counts)
        every = [torch.empty_like(counts) for _ in range(tp)]
        torch.distributed.all_gather(every, counts, group=self.tp_group)
        every = torch.stack(every)  # [tp, El]
        sizes, mine = every.sum(1).tolist(), rows.shape[0]
        gathered = all_to_all(rows.repeat(tp, 1), self.tp_group, sizes, [mine] * tp)  # [sum M_t, h] by source
        order = local_expert_order(every)  # by local expert, then source rank
        out = self._partial(gathered.index_select(0, order), every.sum(0))
        by_source = unpermute(out, order)
        out = all_to_all(by_source, self.tp_group, [mine] * tp, sizes).view(tp, mine, -1).sum(0)  # [M, h]
        if self.fc2_bias is None:
            return out
        return self._output_bias(out, counts, copy_to_tensor_model_parallel_region(self.fc2_bias, self.tp_group))
