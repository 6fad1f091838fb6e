"""ALiBi slopes and biases, rotary embeddings."""

import math

import pytest
import torch

from megatron.model.positional import alibi_bias, alibi_slopes, alibi_slopes_for_rank, apply_rotary, rotary_cos_sin
from megatron.testing.tolerance import tolerance


def _bloom_powers(num_heads: int) -> list[int]:
    """The power transformers' build_alibi_tensor raises its fp32 base to for each head: 1, 2, ... for the heads of
    the closest power of two, then 1, 3, 5, ... of the second base for the remaining heads."""
    closest = 2 ** math.floor(math.log2(num_heads))
    return list(range(1, closest + 1)) + list(range(1, 2 * (num_heads - closest), 2))


@pytest.mark.parametrize("num_heads", [1, 2, 4, 5, 6, 8, 12, 16, 24, 48, 112])
def test_alibi_slopes_match_transformers_bloom(num_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    # Position 1 of an all-ones mask holds exactly slope * 1 for every head.
    alibi = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)  # [heads, 1, 2]
    expected = alibi[:, 0, 1]
    ours = torch.tensor(alibi_slopes(num_heads), dtype=torch.float32)
    assert ours.shape == (num_heads,)
    # transformers rounds the base to fp32 and raises it to the n-th power (pow: condition number n), ours rounds
    # the float64 slope once: one rounding on a number n times the slope's size.
    for head, (mine, theirs, power) in enumerate(zip(ours.tolist(), expected.tolist(), _bloom_powers(num_heads))):
        bound = tolerance(torch.float32, 1, 1, scale=power * theirs)
        assert abs(mine - theirs) <= bound, (num_heads, head, mine, theirs)


def test_alibi_slopes_power_of_two_is_geometric():
    assert alibi_slopes(8) == pytest.approx([2.0 ** -(i + 1) for i in range(8)])
    # 6 heads: the 4-head sequence, then the 1st and 3rd slopes of the 8-head sequence.
    assert alibi_slopes(6) == pytest.approx([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3])


@pytest.mark.parametrize("num_heads,tp_size", [(4, 2), (6, 2), (12, 4), (6, 3)])
def test_alibi_slopes_for_rank_are_slices_of_the_full_list(num_heads, tp_size):
    full = torch.tensor(alibi_slopes(num_heads), dtype=torch.float32)
    per_rank = [alibi_slopes_for_rank(num_heads, r, tp_size) for r in range(tp_size)]
    assert all(s.shape == (num_heads // tp_size,) for s in per_rank)
    torch.testing.assert_close(torch.cat(per_rank), full, rtol=0, atol=0)


def test_alibi_slopes_reject_bad_sizes():
    with pytest.raises(ValueError, match="num_heads 6 is not divisible"):
        alibi_slopes_for_rank(6, 0, 4)
    with pytest.raises(ValueError, match="tp_rank 2"):
        alibi_slopes_for_rank(4, 2, 2)


def test_alibi_bias_is_linear_in_distance_and_causal():
    slopes = torch.tensor([0.5, 0.25])
    bias = alibi_bias(slopes, torch.arange(3, 5), torch.arange(5))  # queries 3, 4 after 3 cached keys
    assert bias.shape == (2, 2, 5)
    assert bias[0, 0, 0].item() == -1.5 and bias[1, 1, 2].item() == -0.5 and bias[0, 1, 4].item() == 0.0
    assert bias[0, 0, 4].item() == float("-inf") and torch.isfinite(bias[:, 1]).all()


def test_rotary_keeps_norms_and_depends_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)  # [s, b, np, hn]

    def rotated(x, position):
        cos, sin = rotary_cos_sin(torch.tensor([position]), 8, 10000.0)
        return apply_rotary(x, cos, sin)

    # cos / sin, the rotation's products and sum, the norm's squares, sum and root: depth 5, summing 8 terms.
    norm_diff = (rotated(q, 7).norm() - q.norm()).abs().item()
    assert norm_diff <= tolerance(torch.float32, 5, 8, scale=q.norm().item()), norm_diff
    score = lambda i, j: (rotated(q, i) * rotated(k, j)).sum().item()  # noqa: E731
    # The same, and the dot product; an angle (position x frequency, up to 13 radians) rounds relative to its
    # size, so the rotated pairs move by up to 13 roundings of the products' size |q| |k|.
    score_diff = abs(score(5, 2) - score(13, 10))
    assert score_diff <= tolerance(torch.float32, 5, 8, scale=13 * (q.norm() * k.norm()).item()), score_diff
    assert abs(score(5, 2) - score(5, 4)) > 1e-3
    # Position 0 is the identity, exactly: cos 0 = 1 and sin 0 = 0, so x * 1 - y * 0 is x.
    assert torch.equal(rotated(q, 0), q)
    # The first pair rotates by exactly `position` radians: one fp32 cosine against Python's float64 one; the
    # second half of the head dim repeats the first.
    cos, _ = rotary_cos_sin(torch.tensor([3]), 8, 10000.0)
    cos_diff = abs(cos[0, 0].item() - math.cos(3.0))
    assert cos_diff <= tolerance(torch.float32, 1, 1), cos_diff
    assert cos[0, 4].item() == cos[0, 0].item()


def test_rotary_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even head dimension, got 7"):
        rotary_cos_sin(torch.arange(4), 7, 10000.0)
