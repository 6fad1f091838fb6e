"""Blending: the C++ greedy order against a Python reference, its prefix-share bounds and the
BlendableDataset (the --data-path / weighted split paths parser is tested in test_dataset_utils)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.data import _helpers
from megatron.data.blendable_dataset import BlendableDataset


def reference_blending(weights, size):
    weights = [w / sum(weights) for w in weights]
    counts = [0] * len(weights)
    chosen, sample = [], []
    for t in range(size):
        deficits = [w * (t + 1) - c for w, c in zip(weights, counts)]
        d = deficits.index(max(deficits))  # first maximum: ties go to the lowest index
        chosen.append(d)
        sample.append(counts[d])
        counts[d] += 1
    return chosen, sample


def prefix_deviation(dataset_index, weights):
    """[size, K] of count_d(n) - weight_d * n over every prefix length n = 1..size."""
    weights = np.asarray(weights) / np.sum(weights)
    counts = np.cumsum(np.eye(len(weights))[dataset_index], axis=0)
    n = np.arange(1, len(dataset_index) + 1)[:, None]
    return counts - weights * n


weights_strategy = st.lists(st.floats(0.001, 1.0), min_size=2, max_size=6)


@settings(max_examples=60, deadline=None)
@given(weights=weights_strategy, size=st.integers(0, 1500))
def test_cpp_matches_reference_and_prefix_bounds(weights, size):
    dataset_index, dataset_sample_index = _helpers.build_blending_indices(np.array(weights), size)
    assert dataset_index.dtype == np.uint8 and dataset_sample_index.dtype == np.int64
    chosen, sample = reference_blending(weights, size)
    assert dataset_index.tolist() == chosen and dataset_sample_index.tolist() == sample
    if size == 0:
        return
    deviation = prefix_deviation(dataset_index, weights)  # count - weight * n
    k = len(weights)
    # For every prefix length n: no share exceeds its weight by 1/n, none falls short by (K-1)/n.
    assert deviation.max() < 1 + 1e-9
    assert -deviation.min() < k - 1 + 1e-9
    if k == 2:  # two datasets: |count - weight * n| <= 1/2, i.e. shares within 1/(2n)
        assert np.abs(deviation).max() <= 0.5 + 1e-9


def test_shortfall_can_exceed_one_over_n_with_four_datasets():
    """Pins why the documented bound for K > 2 is (K-1)/n, not 1/n."""
    weights = [0.5321525747402271, 0.0018645506872337159, 0.4532811771139732, 0.012701697458565833]
    dataset_index, _ = _helpers.build_blending_indices(np.array(weights), 400)
    assert -prefix_deviation(dataset_index, weights).min() > 1.0


def test_many_datasets_and_bad_weights():
    dataset_index, _ = _helpers.build_blending_indices(np.ones(300), 600)
    assert dataset_index.dtype == np.int16 and np.bincount(dataset_index).tolist() == [2] * 300
    for weights in ([], [0.0, 0.0], [1.0, -1.0], [np.nan, 1.0]):
        with pytest.raises(ValueError):
            _helpers.build_blending_indices(np.array(weights, dtype=np.float64), 10)


def test_blendable_dataset():
    a = [("a", i) for i in range(40)]
    b = [("b", i) for i in range(70)]
    blend = BlendableDataset([a, b], [3, 7], 100)
    items = [blend[i] for i in range(len(blend))]
    assert sum(1 for name, _ in items if name == "a") == 30
    assert [i for name, i in items if name == "b"] == list(range(70))  # each dataset read in order
    assert blend[-1] == items[-1]
    with pytest.raises(ValueError, match="dataset 1 .* drawn 70 times but holds 60"):
        BlendableDataset([a, b[:60]], [3, 7], 100)
    with pytest.raises(ValueError, match="one weight per dataset"):
        BlendableDataset([a, b], [1.0], 10)

