"""From dataset samples to what the pipeline engine consumes.

A sample is ``seq_length + 1`` tokens; a micro-batch for DeepSpeed's pipeline engine is

    ((input_ids [b, s], position_ids [b, s]), (labels [b, s], loss_mask [b, s]))

the first tuple read by the first stage, the second by the last stage's loss. Every tensor-parallel
rank of a stage reads the same samples itself (the sampler depends on the data-parallel rank only),
so nothing is broadcast.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch


def gpt_micro_batch(tokens: torch.Tensor):
    """tokens [b, s + 1] -> ((input_ids, position_ids), (labels, loss_mask)), all [b, s]; every token counts."""
    tokens = tokens.long()
    input_ids = tokens[:, :-1].contiguous()  # [b, s]
    labels = tokens[:, 1:].contiguous()      # [b, s]
    b, s = input_ids.shape
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()  # [b, s]
    loss_mask = torch.ones((b, s), dtype=torch.float32)
    return (input_ids, position_ids), (labels, loss_mask)


class MicroBatchIterator:
    """Wraps a DataLoader of {'text': [b, s + 1]} batches into pipeline micro-batches. It ends with the
    loader: training never wraps around its data (the sampler covers the whole run)."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self._it: Optional[Iterator] = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(self.loader)
        return gpt_micro_batch(next(self._it)["text"])
