"""Batch samplers that resume from ``consumed_samples`` and give each data-parallel rank its slice.

Global micro-batch step k covers samples [consumed + k*G, consumed + (k+1)*G) with
G = micro_batch_size * data_parallel_size; DP rank r takes the r-th run of micro_batch_size
indices of it. Restarting with the consumed count saved in a checkpoint continues exactly where
the run stopped: no sample is skipped or repeated.
"""

from __future__ import annotations

from typing import Iterator


class MegatronPretrainingSampler:
    """Sequential batch sampler: yields this DP rank's ``micro_batch_size`` indices per global step."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"total_samples must be > 0, got {total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} must be in [0, total_samples={total_samples}); "
                f"the dataset is exhausted: build it with more samples (train_samples / train_iters)"
            )
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and data_parallel_size ({data_parallel_size}) must be > 0")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} must be in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    @property
    def global_micro_batch_size(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        """Micro-batches this sampler yields (Megatron's sampler reports total_samples instead)."""
        remaining = self.total_samples - self.consumed_samples
        full, partial = divmod(remaining, self.global_micro_batch_size)
        return full + (1 if partial and not self.drop_last and self._partial_slice_nonempty(partial) else 0)

    def _partial_slice_nonempty(self, partial: int) -> bool:
        return self.data_parallel_rank * self.micro_batch_size < partial

    def __iter__(self) -> Iterator[list[int]]:
        step = self.global_micro_batch_size
        rank_start = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + step <= self.total_samples:
            first = start + rank_start
            yield list(range(first, first + self.micro_batch_size))
            start += step
        if start < self.total_samples and not self.drop_last:
            # A short last step: ranks take what is left in order; some may get fewer (or none).
            first = start + rank_start
            last = min(first + self.micro_batch_size, self.total_samples)
            if first < last:
                yield list(range(first, last))


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int = 0, drop_last: bool = True, worker_init_fn=None):
    """A torch DataLoader over ``dataset`` driven by ``MegatronPretrainingSampler`` (None if no dataset);
    ``worker_init_fn`` runs first in each worker process (the training loop's signal set-up)."""
    if dataset is None:
        return None
    import torch  # noqa: PLC0415 (data/ loads without torch (the preprocessing tools); only the loader's sampler needs it)

    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         data_parallel_rank, data_parallel_size, drop_last)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       pin_memory=torch.cuda.is_available(),
                                       persistent_workers=num_workers > 0, worker_init_fn=worker_init_fn)
