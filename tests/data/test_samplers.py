"""MegatronPretrainingSampler: per-rank slices, resume from consumed_samples, and the DataLoader."""

import numpy as np
import pytest
import torch

from megatron.data.samplers import MegatronPretrainingSampler, build_pretraining_data_loader


def all_ranks(total, consumed, micro_batch_size, dp_size, drop_last=True):
    """Per global step, the list of each rank's indices."""
    per_rank = [list(MegatronPretrainingSampler(total, consumed, micro_batch_size, r, dp_size, drop_last))
                for r in range(dp_size)]
    return per_rank


@pytest.mark.parametrize("micro_batch_size,dp_size", [(1, 1), (3, 2), (2, 4)])
def test_ranks_partition_each_global_step(micro_batch_size, dp_size):
    total = 101
    per_rank = all_ranks(total, 0, micro_batch_size, dp_size)
    global_batch = micro_batch_size * dp_size
    assert all(len(batches) == total // global_batch for batches in per_rank)
    for step in range(len(per_rank[0])):
        step_indices = [i for rank in range(dp_size) for i in per_rank[rank][step]]
        assert step_indices == list(range(step * global_batch, (step + 1) * global_batch))
        for rank in range(dp_size):
            assert per_rank[rank][step][0] == step * global_batch + rank * micro_batch_size
    assert len(MegatronPretrainingSampler(total, 0, micro_batch_size, 0, dp_size)) == total // global_batch


@pytest.mark.parametrize("stop_step", [0, 1, 5, 16])
def test_resume_neither_skips_nor_repeats(stop_step):
    total, micro_batch_size, dp_size = 100, 3, 2
    uninterrupted = all_ranks(total, 0, micro_batch_size, dp_size)
    consumed = stop_step * micro_batch_size * dp_size  # what the checkpoint records
    resumed = all_ranks(total, consumed, micro_batch_size, dp_size)
    for rank in range(dp_size):
        assert uninterrupted[rank][:stop_step] + resumed[rank] == uninterrupted[rank]
    seen = [i for rank in range(dp_size) for batch in uninterrupted[rank][:stop_step] + resumed[rank] for i in batch]
    assert sorted(seen) == list(range(len(seen))) and len(set(seen)) == len(seen)


def test_drop_last_false_yields_the_tail():
    per_rank = all_ranks(10, 0, 3, 2, drop_last=False)
    assert per_rank == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9]]]
    assert [len(MegatronPretrainingSampler(10, 0, 3, r, 2, drop_last=False)) for r in range(2)] == [2, 2]
    assert all_ranks(7, 0, 3, 2, drop_last=False)[1] == [[3, 4, 5]]


def test_invalid_arguments():
    for args, message in [((0, 0, 1, 0, 1), "total_samples"), ((10, 10, 1, 0, 1), "exhausted"),
                          ((10, 0, 0, 0, 1), "micro_batch_size"), ((10, 0, 1, 2, 2), "data_parallel_rank")]:
        with pytest.raises(ValueError, match=message):
            MegatronPretrainingSampler(*args)


def test_data_loader_batches():
    dataset = [{"text": np.arange(5, dtype=np.int64) + i} for i in range(20)]
    loader = build_pretraining_data_loader(dataset, consumed_samples=4, micro_batch_size=2,
                                           data_parallel_rank=1, data_parallel_size=2, num_workers=0)
    batches = [b["text"] for b in loader]
    assert len(batches) == len(loader) == 4
    assert batches[0].dtype == torch.int64 and batches[0].shape == (2, 5)
    assert [b[:, 0].tolist() for b in batches] == [[6, 7], [10, 11], [14, 15], [18, 19]]
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None
