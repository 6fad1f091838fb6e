"""From dataset samples to what the pipeline engine consumes.

A sample is ``seq_length + 1`` tokens; a micro-batch for DeepSpeed's pipeline engine is

    ((input_ids [b, s], position_ids [b, s]), (labels [b, s], loss_mask [b, s]))

the first tuple read by the first stage, the second by the last stage's loss; with --reset-attention-mask the
first tuple is ``(input_ids, position_ids, document_ids)``, document_ids [b, s] the index of each token's
document inside its sample (``document_ids``). Every tensor-parallel
rank of a stage reads the same samples itself (the sampler depends on the data-parallel rank only),
so nothing is broadcast. With DeepSpeed-Ulysses (``--ds-sequence-parallel-size`` sp) every rank of a
sequence-parallel group reads the same samples too and keeps its slice of the sequence, tokens
sp_rank * s/sp .. (sp_rank + 1) * s/sp - 1 of each of the four tensors (the position ids stay global; the
document ids stay whole: the attention after Ulysses' all-to-all sees every token of the sample).
With context parallelism (``--context-parallel-size`` c) a rank keeps its load-balanced tokens instead:
chunks cp_rank and 2c-1-cp_rank of 2c (``megatron.parallel.context_parallel``).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from megatron.parallel.context_parallel import load_balanced_positions


def document_ids(input_ids: torch.Tensor, eod: int) -> torch.Tensor:
    """input_ids [b, s] -> the document index of every token [b, s] (int64): 0 from the first token, one more on
    the token after each ``eod`` (Megatron-LM's get_ltor_masks_and_position_ids: the eod closes its document)."""
    starts = torch.zeros_like(input_ids, dtype=torch.long)
    starts[:, 1:] = (input_ids[:, :-1] == eod).long()  # [b, s]: a document starts after each eod
    return starts.cumsum(dim=1)  # [b, s]


def gpt_micro_batch(tokens: torch.Tensor, eod: Optional[int] = None, eod_mask_loss: bool = False,
                    reset_position_ids: bool = False, reset_attention_mask: bool = False):
    """tokens [b, s + 1] -> ((input_ids, position_ids), (labels, loss_mask)), all [b, s]; with
    ``reset_attention_mask`` ((input_ids, position_ids, document_ids), (labels, loss_mask)).

    Every token counts, and positions run 0 .. s-1, unless (Megatron's --eod-mask-loss and
    --reset-position-ids, which need ``eod``, the end-of-document id): no loss where the INPUT token is
    ``eod`` (the guess of the next document's first token), and positions restarting at 0 on the token
    after each ``eod``. Megatron's --reset-attention-mask: the document ids, by which attention stays inside
    each document.
    """
    if (eod_mask_loss or reset_position_ids or reset_attention_mask) and eod is None:
        raise ValueError("eod_mask_loss, reset_position_ids and reset_attention_mask need the end-of-document "
                         "token id (eod)")
    tokens = tokens.long()
    input_ids = tokens[:, :-1].contiguous()  # [b, s]
    labels = tokens[:, 1:].contiguous()      # [b, s]
    b, s = input_ids.shape
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()  # [b, s]
    loss_mask = torch.ones((b, s), dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[input_ids == eod] = 0.0
    if reset_position_ids:
        starts = torch.zeros((b, s), dtype=torch.bool)
        starts[:, 1:] = input_ids[:, :-1] == eod  # [b, s]: a document starts after each eod
        document_start = torch.where(starts, position_ids, 0).cummax(dim=1).values  # [b, s]
        position_ids = position_ids - document_start
    if reset_attention_mask:
        return (input_ids, position_ids, document_ids(input_ids, eod)), (labels, loss_mask)
    return (input_ids, position_ids), (labels, loss_mask)


def sequence_slice(micro_batch, sp_rank: int, sp_size: int):
    """This sequence-parallel rank's tokens of a micro-batch: every [b, s] tensor -> [b, s/sp] (the document ids,
    if any, stay whole)."""
    if sp_size == 1:
        return micro_batch
    (input_ids, position_ids, *documents), (labels, loss_mask) = micro_batch
    s = input_ids.shape[1]
    if s % sp_size:
        raise ValueError(f"sequence length {s} is not divisible by the sequence-parallel size {sp_size}")
    part = s // sp_size
    cut = slice(sp_rank * part, (sp_rank + 1) * part)
    return ((input_ids[:, cut].contiguous(), position_ids[:, cut].contiguous(), *documents),
            (labels[:, cut].contiguous(), loss_mask[:, cut].contiguous()))  # 4 x [b, s/sp]


def context_slice(micro_batch, cp_rank: int, cp_size: int):
    """This context-parallel rank's tokens of a micro-batch: every [b, s] tensor -> [b, s/cp], the positions
    load_balanced_positions(s, cp, cp_rank) in that order (ValueError unless 2 x cp divides s)."""
    if cp_size == 1:
        return micro_batch
    inputs, (labels, loss_mask) = micro_batch
    mine = load_balanced_positions(inputs[0].shape[1], cp_size, cp_rank)  # [s/cp]
    return tuple(t[:, mine] for t in inputs), (labels[:, mine], loss_mask[:, mine])  # 4 (5) x [b, s/cp]


class MicroBatchIterator:
    """Wraps a DataLoader of {'text': [b, s + 1]} batches into pipeline micro-batches (this sequence-parallel
    rank's slice of them, or this context-parallel rank's). It ends with the loader: training never wraps around
    its data (the sampler covers the whole run)."""

    def __init__(self, loader: Iterable, sp_rank: int = 0, sp_size: int = 1, eod: Optional[int] = None,
                 eod_mask_loss: bool = False, reset_position_ids: bool = False, cp_rank: int = 0, cp_size: int = 1,
                 reset_attention_mask: bool = False):
        self.loader = loader
        self.sp_rank, self.sp_size = sp_rank, sp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.masking = dict(eod=eod, eod_mask_loss=eod_mask_loss, reset_position_ids=reset_position_ids,
                            reset_attention_mask=reset_attention_mask)
        self._it: Optional[Iterator] = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(self.loader)
        micro_batch = gpt_micro_batch(next(self._it)["text"], **self.masking)
        return context_slice(sequence_slice(micro_batch, self.sp_rank, self.sp_size), self.cp_rank, self.cp_size)

    def close(self) -> None:
        """Stop the loader's worker processes now (they ignore SIGTERM: ``megatron.training.exit``)."""
        shutdown = getattr(self._it, "_shutdown_workers", None)  # torch's multi-process iterator
        if shutdown is not None:
            shutdown()
        self._it = None
