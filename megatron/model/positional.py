"""Position information inside attention: ALiBi biases and rotary embeddings.

(Learned absolute positions live in ``embedding.py``: they are added to the input, not applied here.)

Shape letters: s sequence (sq queries, sk keys), b micro-batch, h hidden, np heads per partition,
hn head dim, hp = np * hn, v / vp vocabulary (per partition).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

from megatron.parallel.utils import fp32_tensor

__all__ = ["alibi_slopes", "alibi_slopes_for_rank", "alibi_bias", "Yarn", "yarn_get_mscale", "rotary_scaling",
           "rotary_inv_freq", "rotary_cos_sin", "rotate_half", "apply_rotary"]


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


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor 0.1 * mscale * ln(scale) + 1 (Peng et al. 2023, eq. 21); 1 for scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN rotary scaling (Peng et al. 2023), as Megatron-LM's ``YarnRotaryEmbedding`` and transformers' yarn
    rope type compute it: the model was trained on ``original_max_positions`` positions and is extended ``factor``
    times.

    Frequencies: a dimension pair turning fewer than ``beta_slow`` times over the original context is interpolated
    (its frequency divided by ``factor``), one turning more than ``beta_fast`` times is kept, and the pairs between
    are mixed by a linear ramp over the pair index (its ends rounded outwards with ``round_to_int``).
    Attention scale: cos and sin are multiplied by ``attention_factor`` (so q.k by its square);
    multi-head latent attention (DeepSeek-V3) also multiplies its softmax scale by ``softmax_factor``.
    """

    factor: float
    original_max_positions: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)

    @property
    def softmax_factor(self) -> float:
        """MLA's softmax scale multiplier (Megatron-LM's and DeepSeek's): mscale(factor, mscale_all_dim)^2."""
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2

    def ramp(self, head_dim: int, base: float, device=None) -> torch.Tensor:
        """fp32 [hn/2]: 0 for the pairs kept (fast), 1 for the pairs interpolated (slow), linear between."""
        def pair(turns: float) -> float:  # the pair index that turns ``turns`` times over the original context
            return head_dim * math.log(self.original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(base))

        low, high = pair(self.beta_fast), pair(self.beta_slow)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # a step instead of a ramp
        index = torch.arange(head_dim // 2, dtype=torch.float32, device=device)
        return ((index - low) / (high - low)).clamp(0.0, 1.0)


# Llama 3.1's scaling (factor, low_freq_factor, high_freq_factor, original_max_positions), or YaRN
RotaryScaling = Union[tuple[float, float, float, int], Yarn]


def rotary_scaling(config) -> Optional[RotaryScaling]:
    """The rotary scaling a ``ModelConfig`` asks for: Llama 3.1's (``rope_scaling_factor``), YaRN
    (``yarn_rotary_scaling_factor``; a factor of 1 is plain rotary, as in Megatron-LM), or None."""
    if config.rope_scaling_factor is not None:
        return (config.rope_scaling_factor, config.rope_scaling_low_freq_factor,
                config.rope_scaling_high_freq_factor, config.rope_scaling_original_max_positions)
    factor = config.yarn_rotary_scaling_factor
    if factor is None or factor == 1.0:
        return None
    return Yarn(factor, config.yarn_original_max_position_embeddings, config.yarn_beta_fast, config.yarn_beta_slow,
                config.yarn_mscale, config.yarn_mscale_all_dim, config.yarn_correction_range_round_to_int)


def rotary_inv_freq(head_dim: int, base: float, scaling: Optional[RotaryScaling] = None,
                    device=None) -> torch.Tensor:
    """The rotary frequencies base^(-2i / hn), i < hn/2 (fp32 [hn/2]), optionally scaled.

    scaling (factor, low_freq_factor, high_freq_factor, original_max_positions), Llama 3.1's: a frequency whose
    wavelength 2 pi / f is longer than original / low_freq_factor is divided by factor (those positions were never
    seen in training), one shorter than original / high_freq_factor is kept, and the band between is interpolated
    linearly in original / wavelength. A :class:`Yarn`: its ramp mixes f / factor and f per pair.
    """
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)  # [hn/2]
    if scaling is None:
        return inv_freq
    if isinstance(scaling, Yarn):
        interpolated = scaling.ramp(head_dim, base, device)  # [hn/2]
        return inv_freq / scaling.factor * interpolated + inv_freq * (1 - interpolated)
    factor, low, high, original = scaling
    wavelength = 2 * math.pi / inv_freq
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short waves
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, base: float,
                   scaling: Optional[RotaryScaling] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [s, hn] (fp32) of the rotary angles position * base^(-2i / hn) (Su et al. 2021);
    ``scaling``: see :func:`rotary_inv_freq` (YaRN also multiplies both by its ``attention_factor``).

    The i-th frequency is used for the pair (x[i], x[i + hn/2]) that :func:`rotate_half` forms,
    hence each frequency appears twice (GPT-NeoX / Megatron layout). ``positions`` are global (under context
    parallelism and Ulysses each rank passes its own tokens' positions in the whole sequence).
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head dimension, got {head_dim}")
    inv_freq = rotary_inv_freq(head_dim, base, scaling, positions.device)  # [hn/2]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [s, hn/2]
    angles = torch.cat((angles, angles), dim=-1)  # [s, hn]
    if isinstance(scaling, Yarn) and scaling.attention_factor != 1.0:
        return angles.cos() * scaling.attention_factor, angles.sin() * scaling.attention_factor
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
