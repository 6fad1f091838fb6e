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


def gpt_micro_batch(tokens: torch.Tensor, eod_token: Optional[int] = None, eod_mask_loss: bool = False):
    """tokens [b, s + 1] -> ((input_ids, position_ids), (labels, loss_mask)), all [b, s]."""
    tokens = tokens.long()
    input_ids = tokens[:, :-1].contiguous()  # [b, s]
    labels = tokens[:, 1:].contiguous()      # [b, s]
    b, s = input_ids.shape
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()  # [b, s]
    loss_mask = torch.ones((b, s), dtype=torch.float32)
    if eod_mask_loss and eod_token is not None:
        loss_mask[input_ids == eod_token] = 0.0
    return (input_ids, position_ids), (labels, loss_mask)


class MicroBatchIterator:
    """Wraps a DataLoader of {'text': [b, s + 1]} batches into pipeline micro-batches, endlessly
    restarting it only if asked (evaluation re-reads its split; training never wraps)."""

    def __init__(self, loader: Iterable, *, eod_token: Optional[int] = None, eod_mask_loss: bool = False,
                 device: Optional[torch.device] = None, cycle: bool = False):
        self.loader = loader
        self.eod_token = eod_token
        self.eod_mask_loss = eod_mask_loss
        self.device = device
        self.cycle = cycle
        self._it: Optional[Iterator] = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(self.loader)
        try:
            batch = next(self._it)
        except StopIteration:
            if not self.cycle:
                raise
            self._it = iter(self.loader)
            batch = next(self._it)
        inputs, labels = gpt_micro_batch(batch["text"], self.eod_token, self.eod_mask_loss)
        if self.device is not None and self.device.type != "cpu":
            inputs = tuple(t.to(self.device, non_blocking=True) for t in inputs)
            labels = tuple(t.to(self.device, non_blocking=True) for t in labels)
        return inputs, labels
