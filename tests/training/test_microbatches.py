"""Batch-size rampup, checked with BLOOM-176B's numbers: --rampup-batch-size 192 16 9_765_625,
--global-batch-size 2048, --micro-batch-size 2, data-parallel size 8 (so micro x DP = 16)."""

import pytest

from megatron.config import BatchConfig
from megatron.training.microbatches import (
    ConstantNumMicroBatches,
    RampupBatchsizeNumMicroBatches,
    build_num_microbatches_calculator,
)

BLOOM = dict(start_batch_size=192, batch_size_increment=16, rampup_samples=9_765_625, global_batch_size=2048,
             micro_batch_size=2, data_parallel_size=8)
PER_INCREMENT = 9_765_625 / 116  # (2048 - 192) / 16 = 116 increments, about 84,186.4 samples each


def test_bloom_rampup_starts_at_192():
    c = RampupBatchsizeNumMicroBatches(**BLOOM)
    assert (c.get_current_global_batch_size(), c.get()) == (192, 12)
    assert c.num_increments == 116 and c.rampup_samples_per_increment == pytest.approx(84186.4224)


@pytest.mark.parametrize("consumed,batch", [
    (0, 192), (84_186, 192), (84_187, 208), (2 * 84_187, 224), (4_882_812, 192 + 57 * 16),
    (9_765_624, 192 + 115 * 16), (9_765_625, 2048), (9_765_626, 2048), (220_000_000, 2048)])
def test_bloom_rampup_batch_size_at(consumed, batch):
    c = RampupBatchsizeNumMicroBatches(**BLOOM)
    c.update(consumed)
    assert c.get_current_global_batch_size() == batch
    assert c.get() == batch // 16


def test_bloom_rampup_as_the_loop_drives_it():
    c = RampupBatchsizeNumMicroBatches(**BLOOM)
    consumed, steps, sizes = 0, 0, []
    while c.get_current_global_batch_size() < 2048:
        sizes.append(c.get_current_global_batch_size())
        consumed += sizes[-1]
        steps += 1
        c.update(consumed)
    assert sizes == sorted(sizes) and all(s % 16 == 0 for s in sizes)
    assert sorted(set(sizes)) == list(range(192, 2048, 16))  # every step of 16 is visited
    # each size is used for about 84,186 samples: ceil(84186.4 / size) steps or one more
    assert consumed == pytest.approx(9_765_625, abs=2048)
    assert c.get() == 128


@pytest.mark.parametrize("change,words", [
    (dict(start_batch_size=200), "start 200 is not a multiple of --micro-batch-size 2 x data-parallel size 8 = 16"),
    (dict(batch_size_increment=8), "increment 8 is not a multiple"),
    (dict(start_batch_size=2048), "start 2048 must be smaller than --global-batch-size 2048"),
    (dict(batch_size_increment=48), "1856 is not a multiple of the increment 48"),
    (dict(global_batch_size=2040), "--global-batch-size 2040 is not a multiple"),
])
def test_rampup_validation(change, words):
    with pytest.raises(ValueError) as info:
        RampupBatchsizeNumMicroBatches(**{**BLOOM, **change})
    assert words in str(info.value)


def test_constant_calculator():
    c = ConstantNumMicroBatches(2048, 2, 8)
    c.update(10 ** 9)
    assert (c.get(), c.get_current_global_batch_size()) == (128, 2048)
    with pytest.raises(ValueError, match="--global-batch-size 100 is not a multiple"):
        ConstantNumMicroBatches(100, 2, 8)


def test_build_from_batch_config():
    assert isinstance(build_num_microbatches_calculator(BatchConfig(2, 2048), 8), ConstantNumMicroBatches)
    c = build_num_microbatches_calculator(BatchConfig(2, 2048, (192, 16, 9_765_625)), 8)
    assert isinstance(c, RampupBatchsizeNumMicroBatches) and c.get() == 12
