"""Small helpers shared by the tensor-parallel layers: checked division, splitting, param tags.

Imports torch only. The tags set here (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``) are the attribute names DeepSpeed reads to count a sharded parameter once in
the gradient norm and that the checkpoint converters use to merge shards.

Shape letters: h hidden, hp hidden per partition.
"""

from __future__ import annotations

import torch

__all__ = ["divide", "split_tensor_along_last_dim", "set_tensor_model_parallel_attributes",
           "param_is_tensor_parallel", "fp32_empty", "fp32_tensor"]

# Made at import, outside any deepspeed.zero.Init: new tensors are made from it with Tensor methods.
# Inside zero.Init (ZeRO-3 construction) torch.empty / torch.tensor / ... make tensors of the engine's
# dtype whatever dtype they are asked for; the master weights drawn before slicing and ALiBi's slopes
# must be fp32 whatever it is, so that a bf16 run starts as it does on the pipeline engine.
_FP32_CPU = torch.empty(0, dtype=torch.float32)


def fp32_empty(shape) -> torch.Tensor:
    """An uninitialized fp32 CPU tensor of ``shape``, fp32 even inside ``deepspeed.zero.Init``."""
    return _FP32_CPU.new_empty(shape)


def fp32_tensor(values) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.float32)`` on the CPU, fp32 even inside ``deepspeed.zero.Init``."""
    return _FP32_CPU.new_tensor(values)


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator as an int; ValueError naming both numbers and ``what`` otherwise.

    ``what`` says which quantity is being split, e.g. "ColumnParallelLinear output size across
    tensor-parallel ranks", so the message tells the user which setting to change.
    """
    if denominator <= 0:
        raise ValueError(f"cannot split {what}: the divisor must be positive, got {denominator}")
    if numerator % denominator != 0:
        raise ValueError(
            f"{what}: {numerator} is not divisible by {denominator}; choose a value that is a "
            f"multiple of {denominator} (e.g. {_next_multiple(numerator, denominator)})")
    return numerator // denominator


def _next_multiple(value: int, multiple: int) -> int:
    return ((value + multiple - 1) // multiple) * multiple


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` into ``num_partitions`` equal views along its last dimension.

    [..., h] -> num_partitions x [..., h / num_partitions]. The chunks are views (not contiguous)
    unless ``contiguous_split_chunks``.
    """
    last_dim_size = divide(tensor.size(-1), num_partitions, "last dimension of the tensor to split")
    chunks = torch.split(tensor, last_dim_size, dim=-1)  # num_partitions x [..., hp]
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int = 1) -> None:
    """Tag ``param`` as sharded (or not) across the tensor-parallel group along ``dim``.

    ``stride`` > 1 would mean the shard interleaves ``stride`` blocks of the full tensor; every
    layer in this package uses 1 (a contiguous slice).
    """
    param.tensor_model_parallel = bool(is_parallel)
    param.partition_dim = int(dim)
    param.partition_stride = int(stride)


def param_is_tensor_parallel(param: torch.Tensor) -> bool:
    """True if ``param`` holds only this rank's shard of a tensor-parallel weight."""
    return bool(getattr(param, "tensor_model_parallel", False))


