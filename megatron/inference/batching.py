"""Continuous batching: sequences join a running batch as they arrive and leave it as they finish.

    runner = BatchRunner(model, vocab_size)               # the model and the batch's KV caches
    decoder = BatchDecoder(runner, eod=tokenizer.eod)
    decoder.add(GeneratingSequence(prompt_ids, params))   # its prompt runs alone, then it joins
    while decoder.rows:
        for sequence in decoder.step():                   # one token for every row; the finished ones
            ...                                           # have left, their slots are free

A joining prompt goes through the model alone (batch 1, as ``generate_token_ids`` runs it), filling a
KV cache of its own that becomes one row of the batch's ``BatchKVCache`` s; every step then decodes
one token for each row, at that row's own position (ALiBi, rotary and learned positions read the
per-row lengths: nothing is left-padded). Each sequence samples with its own settings and its own
``torch.Generator`` (a seeded sequence draws the same tokens whatever else is in the batch) and stops
on its own conditions (max_new_tokens, the end-of-document token, a stop string). A finished row is
dropped from the caches and the rest keep decoding.

Identity with generation alone: the prompt pass is the same computation. A batched step multiplies
[b, h] activations where the alone path multiplies [1, h]: matrix kernels may sum in another order
for another b, so logits can differ in the last bits (measured: 1e-5 in fp32, one bf16 rounding step
in bf16; tests/inference/test_batching.py), and a greedy token can differ only where the two best
logits are that close.

Everything the model does goes through ``BatchRunner`` (prefill, decode, keep_rows), so that under
tensor parallelism rank 0 can send each of those calls to the other ranks (``megatron.inference.tp``).

Shape letters: s sequence, b rows (sequences in the batch), v vocabulary (unpadded), vp padded vocabulary.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron.inference.generation import Completion, SamplingParams, StreamingText, sample_next_token
from megatron.model import BatchKVCache
from megatron.parallel.mappings import gather_from_tensor_model_parallel_region

__all__ = ["BatchRunner", "GeneratingSequence", "BatchDecoder"]


class BatchRunner:
    """The model and the KV caches of the batch's rows: token ids in, full-vocabulary logits out.

    The logits of a tensor-parallel model are vocab-parallel; they are gathered over its TP group
    (a collective every rank of the group must join: see ``megatron.inference.tp``).
    """

    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        self.caches: list[BatchKVCache] = [BatchKVCache() for _ in model.layers]

    @property
    def num_rows(self) -> int:
        return self.caches[0].num_rows

    def _logits(self, input_ids: torch.Tensor, caches) -> torch.Tensor:
        logits = self.model(input_ids, kv_caches=caches)[-1]  # [b, vp / tp]
        logits = gather_from_tensor_model_parallel_region(logits, self.model.tp_group)  # [b, vp]
        return logits[:, :self.vocab_size].float()  # [b, v]

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Run one prompt alone and add it as the last row; the logits [v] of its next token."""
        caches = self.model.new_kv_caches()
        logits = self._logits(torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device), caches)
        for batch, alone in zip(self.caches, caches):
            batch.add_row(alone.key, alone.value)
        return logits[0]  # [v]

    @torch.inference_mode()
    def decode(self, tokens: Sequence[int]) -> torch.Tensor:
        """One new token per row (its last one) -> the logits [b, v] of each row's next token."""
        input_ids = torch.tensor([[token] for token in tokens], dtype=torch.long, device=self.device)  # [b, 1]
        return self._logits(input_ids, self.caches)

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep these rows, in this order (the others have finished or were cancelled)."""
        for cache in self.caches:
            cache.keep_rows(rows)

    def reset(self) -> None:
        """Drop every row (after a failed step, whose caches may be half written)."""
        self.caches = [BatchKVCache() for _ in self.model.layers]

    def idle(self) -> None:
        """Called while nothing runs, every ``IDLE_SECONDS`` at least (a tensor-parallel runner tells the
        other ranks, which would otherwise time out waiting)."""


class GeneratingSequence:
    """One prompt being generated: its settings, sampling generator, ids so far and stop state.

    ``on_text(piece)`` (optional) receives the text as it is generated, in pieces later tokens cannot
    change; it must not raise (a step of the whole batch would stop half done). ``tag``: the caller's.
    """

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                 generator: Optional[torch.Generator] = None, tokenizer=None, eod: Optional[int] = None, on_text: Optional[Callable[[str], None]] = None,
                 tag=None):
        if not prompt_ids:
            raise ValueError("the prompt has no tokens; give at least one")
        self.prompt_ids, self.params, self.generator = list(prompt_ids), params, generator
        self.tokenizer, self.eod, self.on_text, self.tag = tokenizer, eod, on_text, tag
        # Following the text token by token costs a detokenize per token: only when it is needed.
        needs_text = bool(params.stop) or on_text is not None
        self.text = StreamingText(tokenizer, params.stop) if needs_text else None
        self.token_ids: list[int] = []
        self.finish_reason: Optional[str] = None  # 'eod', 'stop', 'length' once finished

    def accept(self, logits: torch.Tensor) -> bool:
        """Sample the next id from logits [v] (fp32); True once the sequence is finished."""
        token = sample_next_token(logits, self.params, self.generator)
        self.token_ids.append(token)
        if token == self.eod:
            self.finish_reason = "eod"
        elif self.text is not None and self.text.add(token):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        if self.on_text is not None:
            final = self.finish_reason is not None
            if piece := self.text.take(final=final):
                self.on_text(piece)
        return self.finish_reason is not None

    def completion(self, prompt: str) -> Completion:
        """The finished sequence as a Completion (its text without the end-of-document token)."""
        if self.text is not None:
            text = self.text.text
        else:
            text = self.tokenizer.detokenize(self.token_ids[:-1] if self.finish_reason == "eod" else self.token_ids)
        return Completion(prompt, self.prompt_ids, self.token_ids, text, self.finish_reason)


class BatchDecoder:
    """The running batch: ``add`` a sequence (its prompt runs, it joins unless already finished), ``step``
    (a token for every row; returns the sequences that finished, which have left), ``remove`` (cancel)."""

    def __init__(self, runner: BatchRunner, max_batch_size: int = 16):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.rows: list[GeneratingSequence] = []  # row i of the caches is rows[i]

    def reset(self) -> None:
        """Forget every row (after a failure inside the model)."""
        self.runner.reset()
        self.rows = []

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self.rows)

    def add(self, sequence: GeneratingSequence) -> bool:
        """Run its prompt and sample its first token; True if that already finished it (it never joins)."""
        if self.free_slots < 1:
            raise ValueError(f"the batch is full ({self.max_batch_size} rows); wait for a free slot")
        logits = self.runner.prefill(sequence.prompt_ids)  # [v]
        self.rows.append(sequence)
        finished = sequence.accept(logits)
        if finished:
            self.remove([sequence])
        return finished

    def step(self) -> list[GeneratingSequence]:
        """One token for every row; the sequences this finished (they have left the batch)."""
        if not self.rows:
            return []
        logits = self.runner.decode([sequence.token_ids[-1] for sequence in self.rows])  # [b, v]
        finished = [sequence for row, sequence in enumerate(self.rows) if sequence.accept(logits[row])]
        self.remove(finished)
        return finished

    def remove(self, sequences: Sequence[GeneratingSequence]) -> None:
        """Drop these rows (finished or cancelled); the others keep their caches and order."""
        gone = {id(sequence) for sequence in sequences}
        keep = [row for row, sequence in enumerate(self.rows) if id(sequence) not in gone]
        if len(keep) != len(self.rows):
            self.runner.keep_rows(keep)
            self.rows = [self.rows[row] for row in keep]
