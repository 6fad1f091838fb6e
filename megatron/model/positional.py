"""Position information inside attention: ALiBi biases and rotary embeddings.

(Learned absolute positions live in ``embedding.py``: they are added to the input, not applied here.)

Shape letters: s sequence (sq queries, sk keys), b micro-batch, h hidden, np heads per partition,
hn head dim, hp = np * hn, v / vp vocabulary (per partition).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.parallel.utils import fp32_tensor

__all__ = ["alibi_slopes", "alibi_slopes_for_rank", "alibi_bias", "rotary_inv_freq", "rotary_cos_sin", "rotate_half",
           "apply_rotary"]


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi slopes for every head (Press et al. 2021), for ANY head count, as BLOOM uses them.

    For a power of two n the slopes are the geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8).
    Otherwise take the sequence of the closest power of two below, n2, and append every other
    slope of the 2 * n2 sequence (the odd-indexed ones) until there are num_heads slopes.
    """
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(closest)
    if closest != num_heads:
        slopes += geometric(2 * closest)[0::2][: num_heads - closest]
    return slopes


def alibi_slopes_for_rank(num_heads: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slopes of this TP rank's heads: its contiguous slice of the full list, fp32 [np]."""
    if num_heads % tp_size:
        raise ValueError(f"num_heads {num_heads} is not divisible by the tensor-parallel size {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside a tensor-parallel group of {tp_size}")
    per_rank = num_heads // tp_size
    full = alibi_slopes(num_heads)
    return fp32_tensor(full[tp_rank * per_rank:(tp_rank + 1) * per_rank])


def alibi_bias(slopes: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
               ) -> torch.Tensor:
    """Additive attention bias [np, sq, sk] in fp32: slope * (key - query), -inf on future keys.

    query_positions [sq], or [b, sq] for rows at different positions (a batch of sequences of
    different lengths decoding together): the bias is then [b, np, sq, sk].
    The bias -slope * distance penalizes far keys linearly. Using the relative distance (rather
    than slope * key position, which gives the same softmax) keeps the values of nearby keys small
    and therefore exact even when the bias is later rounded to bf16.
    """
    # [..., sq, sk]: how far each key lies before each query (negative or zero where visible)
    relative = (key_positions - query_positions[..., None]).to(torch.float32)
    bias = slopes.to(torch.float32)[:, None, None] * relative[..., None, :, :]  # [..., np, sq, sk]
    future = relative > 0  # [..., sq, sk]
    return bias.masked_fill(future[..., None, :, :], float("-inf"))


def rotary_inv_freq(head_dim: int, base: float, scaling: Optional[tuple[float, float, float, int]] = None,
                    device=None) -> torch.Tensor:
    """The rotary frequencies base^(-2i / hn), i < hn/2 (fp32 [hn/2]), optionally with Llama 3.1's scaling.

    scaling (factor, low_freq_factor, high_freq_factor, original_max_positions): a frequency whose wavelength
    2 pi / f is longer than original / low_freq_factor is divided by factor (those positions were never seen
    in training), one shorter than original / high_freq_factor is kept, and the band between is interpolated
    linearly in original / wavelength.
    """
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)  # [hn/2]
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelength = 2 * math.pi / inv_freq
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short waves
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, base: float,
                   scaling: Optional[tuple[float, float, float, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [s, hn] (fp32) of the rotary angles position * base^(-2i / hn) (Su et al. 2021);
    ``scaling``: see :func:`rotary_inv_freq`.

    The i-th frequency is used for the pair (x[i], x[i + hn/2]) that :func:`rotate_half` forms,
    hence each frequency appears twice (GPT-NeoX / Megatron layout).
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head dimension, got {head_dim}")
    inv_freq = rotary_inv_freq(head_dim, base, scaling, positions.device)  # [hn/2]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [s, hn/2]
    angles = torch.cat((angles, angles), dim=-1)  # [s, hn]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)  # 2 x [..., hn/2]
    return torch.cat((-x2, x1), dim=-1)  # [..., hn]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys x [s, b, np, hn] by their positions' angles (cos, sin: [s, hn], or
    [s, b, hn] when each row of the batch is at positions of its own).

    Computed in fp32 and cast back: the angles of late positions need more than bf16's precision.
    """
    cos = cos[:, None, None, :] if cos.dim() == 2 else cos[:, :, None, :]  # [s, 1 or b, 1, hn]
    sin = sin[:, None, None, :] if sin.dim() == 2 else sin[:, :, None, :]  # [s, 1 or b, 1, hn]
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)
