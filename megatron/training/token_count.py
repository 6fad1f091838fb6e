"""Megatron-LM's ``--calculate-per-token-loss`` where a loss mask makes micro-batches count different tokens.

The step's loss is then the sum of every counted token's loss over the global batch divided by the number of
counted tokens, N. DeepSpeed's pipeline engine averages the micro-batch losses (1 / micro-batches) and the
gradients over the data-parallel ranks (1 / DP), so each micro-batch's loss is its masked sum divided by
N / (micro-batches x DP): the averages then give exactly sum / N. N is known before the step: the loop reads the
step's micro-batches first (``StepTokenCount.step_iterator``), counts their masks and sums the count over the
data-parallel group (tensor-parallel ranks read the same samples), and the pipeline's loss function
(``megatron.engine.pipeline.GPTLossFn.tokens_per_micro_batch``) divides by it. Evaluation keeps the mean of
micro-batch means.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megatron.parallel.state import collective_device


class StepTokenCount:
    """Sets ``loss_fn.tokens_per_micro_batch`` for each step from the global batch's loss masks."""

    def __init__(self, loss_fn, dp_group=None, dp_size: int = 1):
        self.loss_fn, self.dp_group, self.dp_size = loss_fn, dp_group, dp_size

    def step_iterator(self, iterator: Iterator, micro_batches: int) -> Iterator:
        """This step's ``micro_batches`` micro-batches of ``iterator`` (read now), the loss function set for them."""
        batches = [next(iterator) for _ in range(micro_batches)]
        local = sum(float(loss_mask.sum()) for (_, (_, loss_mask)) in batches)
        count = torch.tensor([local], dtype=torch.float64, device=collective_device())
        if self.dp_size > 1:
            dist.all_reduce(count, group=self.dp_group)
        # clamp: a global batch with nothing to count gives loss 0, as a micro-batch's masked mean does
        self.loss_fn.tokens_per_micro_batch = max(float(count.item()), 1.0) / (micro_batches * self.dp_size)
        return iter(batches)

    def end_step(self) -> None:
        """Back to each micro-batch's own mean (evaluation, or a step trained without counting)."""
        self.loss_fn.tokens_per_micro_batch = None
