"""How many micro-batches make the current step: constant, or growing with Megatron's batch-size rampup.

``--rampup-batch-size START INCREMENT RAMPUP_SAMPLES`` with ``--global-batch-size G`` starts at a
global batch of START and adds INCREMENT every ``RAMPUP_SAMPLES / ((G - START) / INCREMENT)``
consumed samples, reaching G once more than RAMPUP_SAMPLES samples are consumed. BLOOM-176B:
``192 16 9_765_625`` with G = 2048: 116 increments of about 84,186 samples each.

Same arithmetic as Megatron's ``RampupBatchsizeNumMicroBatches`` (float division included), so a
run resumed from a checkpoint's consumed-samples count lands on the same batch size. Pure logic.
"""

from __future__ import annotations

from megatron.config import BatchConfig, check_rampup_batch_size


class ConstantNumMicroBatches:
    """A global batch that never changes."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int):
        BatchConfig(micro_batch_size, global_batch_size).validate(data_parallel_size)
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.global_batch_size = global_batch_size
        self.num_micro_batches = global_batch_size // (micro_batch_size * data_parallel_size)

    def update(self, consumed_samples: int) -> None:
        """Nothing changes; present so the loop can call it unconditionally."""

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.global_batch_size


class RampupBatchsizeNumMicroBatches:
    """Global batch START, START + INCREMENT, ... up to the full global batch, driven by consumed samples."""

    def __init__(self, start_batch_size: int, batch_size_increment: int, rampup_samples: int,
                 global_batch_size: int, micro_batch_size: int, data_parallel_size: int):
        BatchConfig(micro_batch_size, global_batch_size).validate(data_parallel_size)
        check_rampup_batch_size((start_batch_size, batch_size_increment, rampup_samples), global_batch_size,
                                micro_batch_size, data_parallel_size)
        self.start_batch_size = start_batch_size
        self.batch_size_increment = batch_size_increment
        self.rampup_samples = rampup_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.num_increments = (global_batch_size - start_batch_size) // batch_size_increment
        self.rampup_samples_per_increment = rampup_samples / self.num_increments
        self.update(0)

    def update(self, consumed_samples: int) -> None:
        """Set the batch size for the step that starts after ``consumed_samples`` samples."""
        if consumed_samples > self.rampup_samples:
            current = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            current = self.start_batch_size + steps * self.batch_size_increment
        assert current <= self.global_batch_size and current % self.micro_batch_times_data_parallel_size == 0
        self.current_global_batch_size = current
        self.num_micro_batches = current // self.micro_batch_times_data_parallel_size

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size


def build_num_microbatches_calculator(batch: BatchConfig, data_parallel_size: int):
    """The calculator for a run's ``BatchConfig`` (rampup when ``batch.rampup_batch_size`` is set)."""
    rampup = batch.rampup_batch_size
    if rampup is None:
        return ConstantNumMicroBatches(batch.global_batch_size, batch.micro_batch_size, data_parallel_size)
    start, increment, samples = rampup
    return RampupBatchsizeNumMicroBatches(start, increment, samples, batch.global_batch_size,
                                          batch.micro_batch_size, data_parallel_size)
