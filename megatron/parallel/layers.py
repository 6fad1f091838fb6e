"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Each layer takes its tensor-parallel group explicitly (``tp_group``; ``None`` = one rank) and reads
no globals. Initialization does not depend on the TP size: every rank fills the FULL fp32 weight
with ``init_method`` (the caller seeds it identically on all TP ranks), keeps its own slice and
casts it to ``params_dtype``, so TP=1 and TP=4 start from the same model. The full weight lives on
the CPU only while the layer is built.

Sharded parameters carry ``tensor_model_parallel=True`` with their ``partition_dim`` and
``partition_stride`` (always 1 here); replicated ones carry ``tensor_model_parallel=False``.

Shape letters: s sequence, b micro-batch, h input features, o output features, v / vp vocabulary
(per partition), tp the TP group size. Activations are sequence-first, [s, b, h]; any leading dims
work except with sequence parallelism, which splits dim 0.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.parallel.fp8_linear import fp8_linear
from megatron.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.parallel.state import group_rank, group_size
from megatron.parallel.utils import divide, fp32_empty, set_tensor_model_parallel_attributes
from megatron.parallel.weight_grad_store import linear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "default_init_method"]

InitMethod = Callable[[torch.Tensor], object]


def default_init_method(weight: torch.Tensor) -> torch.Tensor:
    """normal(0, 0.02) from the default torch generator, in place on the full weight."""
    return torch.nn.init.normal_(weight, mean=0.0, std=0.02)


def _sharded_weight(full_shape: tuple[int, int], partition_dim: int, tp_group,
                    init_method: Optional[InitMethod], params_dtype: torch.dtype,
                    device: Optional[torch.device]) -> torch.nn.Parameter:
    """Fill the full fp32 weight with init_method, keep this rank's slice along partition_dim."""
    master = fp32_empty(full_shape)  # full, unsharded, on the CPU
    (init_method or default_init_method)(master)
    per_partition = full_shape[partition_dim] // group_size(tp_group)
    start = group_rank(tp_group) * per_partition
    shard = master.narrow(partition_dim, start, per_partition)
    weight = torch.nn.Parameter(shard.to(device=device, dtype=params_dtype, copy=True))
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=1)
    return weight


def _zero_bias(size: int, is_parallel: bool, params_dtype: torch.dtype,
               device: Optional[torch.device]) -> torch.nn.Parameter:
    bias = torch.nn.Parameter(torch.zeros(size, dtype=params_dtype, device=device))
    set_tensor_model_parallel_attributes(bias, is_parallel=is_parallel, dim=0, stride=1)
    return bias


class ColumnParallelLinear(torch.nn.Module):
    """Y = XA + b, A split along its columns across the tensor-parallel group: A = [A_1, ..., A_tp].

    Rank i holds A_i as ``weight`` [o/tp, h] and b_i as ``bias`` [o/tp] and computes Y_i = X A_i + b_i.

    Args:
        input_size: h, the first dimension of A.
        output_size: o, the second dimension of A; must be divisible by the TP size.
        tp_group: the tensor-parallel process group (None: one rank).
        bias: whether to add a (column-split) bias.
        gather_output: all-gather Y so every rank gets [.., o]; else each keeps Y_i [.., o/tp].
        skip_bias_add: do not add the bias; return it as the second output so the caller can fuse it.
        init_method: fills the FULL fp32 [o, h] weight in place; default normal(0, 0.02).
        sequence_parallel: the input is this rank's [s/tp, b, h] chunk; it is all-gathered along
            dim 0 first (backward: reduce-scatter).
        params_dtype: dtype of the parameters (initialized in fp32, then cast).
        device: where the parameters live (default: the CPU).

    forward(x) returns ``(output, bias or None)``; the bias is returned only with skip_bias_add.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False,
                 init_method: Optional[InitMethod] = None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None):
        super().__init__()
        tp = group_size(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(
            output_size, tp, f"ColumnParallelLinear output size (across {tp} tensor-parallel ranks)")
        self.tp_group, self.gather_output, self.skip_bias_add = tp_group, gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.weight = _sharded_weight((output_size, input_size), 0, tp_group, init_method,
                                      params_dtype, device)  # [o/tp, h]
        if bias:
            self.bias = _zero_bias(self.output_size_per_partition, True, params_dtype, device)
        else:
            self.register_parameter("bias", None)
        self.weight_grad_store = None  # ZB-H1: where the weight gradient is deferred (weight_grad_store.py)
        self.fp8 = None  # an FP8Scaling: the GEMMs in FP8 (fp8_linear.enable_fp8)
        self.fp8_operand_sharding = (False, True, True)  # input (gathered: whole), weight, output gradient: split

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, bias, self.fp8, self.weight_grad_store)
        return linear(x, self.weight, bias, self.weight_grad_store)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.sequence_parallel:
            total_input = gather_from_sequence_parallel_region(x, self.tp_group)  # [s, b, h]
        else:
            total_input = copy_to_tensor_model_parallel_region(x, self.tp_group)  # [s, b, h]
        bias = None if self.skip_bias_add else self.bias
        output_parallel = self._linear(total_input, bias)  # [s, b, o/tp]
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output_parallel, self.tp_group)  # [s, b, o]
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, "
                f"output_size_per_partition={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(torch.nn.Module):
    """Y = XA + b, A split along its rows across the tensor-parallel group: A = [A_1; ...; A_tp].

    X is split along its last dim to match, X = [X_1, ..., X_tp]; rank i holds A_i as ``weight``
    [o, h/tp] and computes X_i A_i; the partial products are summed by an all-reduce (or, with
    sequence parallelism, a reduce-scatter along dim 0) and then the replicated bias b [o] is added.

    Args:
        input_size: h, the first dimension of A; must be divisible by the TP size.
        output_size: o, the second dimension of A.
        tp_group: the tensor-parallel process group (None: one rank).
        bias: whether to add a bias. It is replicated on every TP rank (tensor_model_parallel=False).
        input_is_parallel: the input is already this rank's [.., h/tp] (e.g. a column-parallel
            output); else the full [.., h] input is split here.
        skip_bias_add: do not add the bias; return it as the second output so the caller can fuse it.
        init_method: fills the FULL fp32 [o, h] weight in place; default normal(0, 0.02).
        sequence_parallel: reduce-scatter the output to this rank's [s/tp, b, o] chunk. Needs
            input_is_parallel. The bias gradient is then summed over the TP group inside the layer
            (each rank sees only its tokens), so the replicated bias stays identical on every rank.
        params_dtype: dtype of the parameters (initialized in fp32, then cast).
        device: where the parameters live (default: the CPU).

    forward(x) returns ``(output, bias or None)``; the bias is returned only with skip_bias_add.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool = True,
                 input_is_parallel: bool = False, skip_bias_add: bool = False,
                 init_method: Optional[InitMethod] = None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None):
        super().__init__()
        tp = group_size(tp_group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel=True needs "
                             "input_is_parallel=True (its input is a column-parallel output)")
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(
            input_size, tp, f"RowParallelLinear input size (across {tp} tensor-parallel ranks)")
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        self.skip_bias_add, self.sequence_parallel = skip_bias_add, sequence_parallel
        self.weight = _sharded_weight((output_size, input_size), 1, tp_group, init_method,
                                      params_dtype, device)  # [o, h/tp]
        if bias:
            self.bias = _zero_bias(output_size, False, params_dtype, device)
            # its gradient is summed over the TP group in forward (_bias_for_use); tooling reads the tag
            self.bias.sequence_parallel = sequence_parallel and tp > 1
        else:
            self.register_parameter("bias", None)
        self.weight_grad_store = None  # ZB-H1: where the weight gradient is deferred (weight_grad_store.py)
        self.fp8 = None  # an FP8Scaling: the GEMMs in FP8 (fp8_linear.enable_fp8)
        self.fp8_operand_sharding = (True, True, False)  # input and weight split; output gradient whole

    def _bias_for_use(self) -> Optional[torch.Tensor]:
        # With sequence parallelism each rank adds the bias to its own tokens only, so the gradient
        # of the replicated bias must be summed over the TP group: copy_to's backward does that.
        if self.bias is not None and self.sequence_parallel:
            return copy_to_tensor_model_parallel_region(self.bias, self.tp_group)
        return self.bias

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.input_is_parallel:
            input_parallel = x  # [s, b, h/tp]
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(x, self.tp_group)  # [s, b, h/tp]
        if self.fp8 is not None:
            output_parallel = fp8_linear(input_parallel, self.weight, None, self.fp8, self.weight_grad_store)
        else:
            output_parallel = linear(input_parallel, self.weight, None, self.weight_grad_store)  # [s, b, o], partial sum
        if self.sequence_parallel:
            # [s, b, o] partial sums -> [s/tp, b, o] full sums of this rank's tokens
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)  # [s, b, o]
        bias = self._bias_for_use()
        if self.skip_bias_add or bias is None:
            return output, bias
        return output + bias, None

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, "
                f"input_size_per_partition={self.input_size_per_partition}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(torch.nn.Module):
    """E[ids] with the table E [v, h] split along the vocabulary across the tensor-parallel group.

    Rank i holds rows [i * v/tp, (i+1) * v/tp) as ``weight`` [vp, h]. Each rank looks up the ids in
    its slice, writes zeros for the others, and an all-reduce over the TP group sums the partial
    results (exactly one rank contributes each row).

    Args:
        num_embeddings: v, the vocabulary size; must be divisible by the TP size (pad it).
        embedding_dim: h.
        tp_group: the tensor-parallel process group (None: one rank).
        init_method: fills the FULL fp32 [v, h] table in place; default normal(0, 0.02).
        params_dtype: dtype of the parameters (initialized in fp32, then cast).
        device: where the parameters live (default: the CPU).

    forward(input_ids [any shape]) -> [*input_ids.shape, h]. Ids outside [0, v) raise ValueError.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group,
                 init_method: Optional[InitMethod] = None,
                 params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None):
        super().__init__()
        tp = group_size(tp_group)
        if num_embeddings % tp != 0:
            padded = ((num_embeddings + tp - 1) // tp) * tp
            raise ValueError(
                f"vocabulary size {num_embeddings} is not divisible by the tensor-parallel size "
                f"{tp}; pad the vocabulary to a multiple of {tp} (e.g. {padded}, see "
                f"--make-vocab-size-divisible-by)")
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, tp_group
        self.num_embeddings_per_partition = num_embeddings // tp
        self.vocab_start_index = group_rank(tp_group) * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = _sharded_weight((num_embeddings, embedding_dim), 0, tp_group, init_method,
                                      params_dtype, device)  # [vp, h]
        self.weight.vocab_parallel = True  # rows are the padded vocabulary (checkpoint converters read it)

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        # One fused comparison and one host sync per forward: cheap next to the lookup itself.
        bad = (input_ids < 0) | (input_ids >= self.num_embeddings)
        if bad.any():
            offending = input_ids[bad].flatten()[0].item()
            raise ValueError(f"token id {offending} is outside the vocabulary [0, "
                             f"{self.num_embeddings}); check the tokenizer and --vocab-size / "
                             f"padded vocabulary size {self.num_embeddings}")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(input_ids)
        if group_size(self.tp_group) == 1:
            return F.embedding(input_ids, self.weight)  # [.., h]
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill_(outside, 0)
        output_parallel = F.embedding(local_ids, self.weight)  # [.., h]
        # The embedding backward keeps only the ids, so zeroing its output in place is safe.
        output_parallel.masked_fill_(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)  # [.., h]

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"vocab_start_index={self.vocab_start_index}, vocab_end_index={self.vocab_end_index}")
