"""A weighted mix of datasets in a fixed, deterministic order (Megatron's ``BlendableDataset``).

Sample ``i`` of the blend is sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``;
both arrays come from the C++ greedy rule ``_helpers.build_blending_indices``: each sample goes to
the dataset furthest below its target count ``weight * (i + 1)``. For every prefix of n samples and
each of K datasets, ``count - weight * n < 1`` (no share ever exceeds its weight by 1/n) and
``weight * n - count < K - 1`` (the deficits sum to zero); with K = 2, ``|count - weight * n| <= 1/2``,
so both shares stay within 1/(2n) of their weights. For K >= 4 a share can fall more than 1/n below
its weight (tests/data/test_blending.py pins an example). The order does not depend on the seed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron.data import _helpers


class BlendableDataset:
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (normalized here)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int):
        if len(datasets) == 0 or len(datasets) != len(weights):
            raise ValueError(f"BlendableDataset needs one weight per dataset: {len(datasets)} datasets, {len(weights)} weights")
        weights = np.asarray(weights, dtype=np.float64)
        if np.any(~np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
            raise ValueError(f"BlendableDataset weights {weights.tolist()} must be finite, >= 0 and sum to > 0")
        if size < 0:
            raise ValueError(f"BlendableDataset size must be >= 0, got {size}")
        self.datasets = list(datasets)
        self.weights = weights / weights.sum()
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = _helpers.build_blending_indices(self.weights, self.size)
        # Each dataset must hold every sample the blend draws from it.
        drawn = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for i, (count, dataset) in enumerate(zip(drawn, self.datasets)):
            if count > len(dataset):
                raise ValueError(
                    f"BlendableDataset: dataset {i} (weight {self.weights[i]:.4f}) is drawn {count} times "
                    f"but holds {len(dataset)} samples; build it with at least {count} samples"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not -self.size <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        dataset = int(self.dataset_index[idx])
        return self.datasets[dataset][int(self.dataset_sample_index[idx])]
