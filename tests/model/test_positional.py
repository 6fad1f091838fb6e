"""ALiBi slopes and biases, rotary embeddings."""

import math

import pytest
import torch

from megatron.model.positional import alibi_bias, alibi_slopes, alibi_slopes_for_rank, apply_rotary, rotary_cos_sin


@pytest.mark.parametrize("num_heads", [1, 2, 4, 5, 6, 8, 12, 16, 24, 48, 112])
def test_alibi_slopes_match_transformers_bloom(num_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    # Position 1 of an all-ones mask holds exactly slope * 1 for every head.
    alibi = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)  # [heads, 1, 2]
    expected = alibi[:, 0, 1]
    ours = torch.tensor(alibi_slopes(num_heads), dtype=torch.float32)
    assert ours.shape == (num_heads,)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)


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

    torch.testing.assert_close(rotated(q, 7).norm(), q.norm())
    score = lambda i, j: (rotated(q, i) * rotated(k, j)).sum().item()  # noqa: E731
    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3
    # Position 0 is the identity; the first pair rotates by exactly `position` radians.
    torch.testing.assert_close(rotated(q, 0), q)
    cos, _ = rotary_cos_sin(torch.tensor([3]), 8, 10000.0)
    assert cos[0, 0].item() == pytest.approx(math.cos(3.0)) and cos[0, 4].item() == pytest.approx(math.cos(3.0))


def test_rotary_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even head dimension, got 7"):
        rotary_cos_sin(torch.arange(4), 7, 10000.0)
