"""FP8 quantizers and the scaled GEMM they feed: the numerics of ``--fp8-format`` (``megatron.config.fp8``).

A quantized operand of a GEMM is a [rows, K] matrix of FP8 elements, quantized along K (the dimension the
product sums over), with a grid of fp32 dequantization scales, one per block of ``block`` = (rows_per_block,
K_per_block) elements: x ~= data * scale_inv[block]. Per recipe:

    tensorwise / delayed   one block, the whole tensor; scale = fp8_max / amax (delayed: amax from the history,
                           divided by 2^margin); the scale is given, so the same quantizer serves both
    blockwise              (1, 128) for activations and gradients, (128, 128) for weights; the scale of each block
                           fp8_max / amax rounded down to a power of two (Transformer Engine's default)
    mxfp8                  (1, 32) for every operand; the dequantization scale 2^ceil(log2(amax / fp8_max)), an
                           e8m0 value (OCP Microscaling Formats v1.0 as Transformer Engine computes it)

Values are scaled, clamped to +-fp8_max (saturation, as Transformer Engine does: a cast alone would make e4m3's
overflow NaN and e5m2's inf) and cast with round-to-nearest-even. A block of zeros gets scale 1.

``scaled_mm(a, b, out_dtype)`` is a @ b^T with ``torch._scaled_mm`` on the FP8 data: one call with the two
tensor scales for per-tensor operands; for block-scaled ones one call per K block with row-wise scales (every
row of a, every column of b: the block's scales spread over its rows), the partial products summed in fp32, the
way the per-block promotion of DeepSeek-V3's kernels accumulates. On CUDA, row-wise ``_scaled_mm`` writes bf16,
so there each partial product is rounded to bf16 before the fp32 sum.

Shape letters: M rows of a, N rows of b (columns of the product), K the reduction dimension.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["Quantized", "FP8_DTYPES", "fp8_max", "amax", "tensor_scale", "quantize_tensor", "quantize_blocks",
           "scaled_mm", "dequantize"]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


@dataclasses.dataclass
class Quantized:
    """An FP8 matrix [rows, K] quantized along K, and its dequantization scales [ceil(rows / block[0]),
    ceil(K / block[1])] (fp32): element (i, k) is ``data[i, k] * scale_inv[i // block[0], k // block[1]]``."""

    data: torch.Tensor       # [rows, K], an FP8 dtype
    scale_inv: torch.Tensor  # [row blocks, K blocks], fp32
    block: tuple[int, int]

    @property
    def per_tensor(self) -> bool:
        return self.scale_inv.numel() == 1


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 scalar tensor (0-dim)."""
    return x.detach().abs().amax().float()


def tensor_scale(amax_value: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The quantization scale fp8_max / amax / 2^margin (fp32); 1 where amax is 0 or not finite."""
    amax_value = amax_value.float()
    scale = fp8_max(dtype) / amax_value / (2.0 ** margin)
    usable = torch.isfinite(amax_value) & (amax_value > 0)
    return torch.where(usable, scale, torch.ones_like(scale))


def _saturating_cast(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = fp8_max(dtype)
    return scaled.clamp(-limit, limit).to(dtype)


def quantize_tensor(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Quantized:
    """x [rows, K] with one given quantization scale (0-dim fp32): tensorwise and delayed scaling."""
    # contiguous: a transposed operand (W^T, X^T) would keep its strides, and _scaled_mm wants a row-major a and
    # the transpose of a row-major b (CUDA refuses other layouts; so does torch.compile's lowering on CPU)
    data = _saturating_cast(x.float() * scale, dtype).contiguous()
    return Quantized(data, (1.0 / scale).reshape(1, 1), tuple(x.shape))


def _block_view(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """x [R, K] zero-padded to whole blocks, as [R/br, br, K/bk, bk]; and the unpadded shape."""
    rows, k = x.shape
    br, bk = block
    pr, pk = -rows % br, -k % bk
    padded = torch.nn.functional.pad(x.float(), (0, pk, 0, pr)) if pr or pk else x.float()
    return padded.reshape((rows + pr) // br, br, (k + pk) // bk, bk), (rows, k)


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, mx: bool = False) -> Quantized:
    """x [rows, K] with one scale per ``block`` (a block at an edge may be partial): blockwise (power-of-two
    scales rounded down from fp8_max / amax), or with ``mx`` MXFP8's e8m0 dequantization scales
    2^ceil(log2(amax / fp8_max))."""
    blocks, (rows, k) = _block_view(x, block)
    block_amax = blocks.abs().amax(dim=(1, 3))  # [R/br, K/bk]
    if mx:
        exponent = torch.ceil(torch.log2(block_amax / fp8_max(dtype)))
        scale_inv = torch.where(block_amax > 0, torch.exp2(exponent.clamp(-127, 127)), torch.ones_like(block_amax))
    else:
        scale = fp8_max(dtype) / block_amax
        # zero the mantissa: the largest power of two not above the scale
        scale = torch.exp2(torch.floor(torch.log2(scale)).clamp(-127, 127))
        scale_inv = torch.where(block_amax > 0, 1.0 / scale, torch.ones_like(block_amax))
    scaled = blocks / scale_inv[:, None, :, None]
    data = _saturating_cast(scaled, dtype).reshape(blocks.shape[0] * blocks.shape[1], -1)[:rows, :k]
    return Quantized(data.contiguous(), scale_inv.contiguous(), block)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 matrix a quantized operand stands for."""
    rows, k = q.data.shape
    expanded = q.scale_inv.repeat_interleave(q.block[0], 0)[:rows].repeat_interleave(q.block[1], 1)[:, :k]
    return q.data.float() * expanded


def _row_scales(q: Quantized, kb: int) -> torch.Tensor:
    """The dequantization scale of every row for K block ``kb``: [rows]."""
    return q.scale_inv[:, kb].repeat_interleave(q.block[0])[:q.data.shape[0]]


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N] in ``out_dtype``, the products of FP8 elements summed by ``torch._scaled_mm``.
    Both must be quantized along K with the same K blocks (or both per tensor)."""
    if a.per_tensor and b.per_tensor:
        return torch._scaled_mm(a.data, b.data.t(), a.scale_inv.reshape(()), b.scale_inv.reshape(()),
                                out_dtype=out_dtype)
    if a.block[1] != b.block[1]:
        raise ValueError(f"scaled_mm: the operands' K blocks differ ({a.block[1]} and {b.block[1]})")
    k, bk = a.data.shape[1], a.block[1]
    partial_dtype = torch.float32 if a.data.device.type == "cpu" else torch.bfloat16
    out = torch.zeros(a.data.shape[0], b.data.shape[0], dtype=torch.float32, device=a.data.device)
    for kb in range(math.ceil(k / bk)):
        cols = slice(kb * bk, min(k, (kb + 1) * bk))
        a_k, b_k = a.data[:, cols].contiguous(), b.data[:, cols].contiguous()
        out += torch._scaled_mm(a_k, b_k.t(), _row_scales(a, kb)[:, None].contiguous(),
                                _row_scales(b, kb)[None, :].contiguous(), out_dtype=partial_dtype).float()
    return out.to(out_dtype)
