"""Continuous batching: sequences join a running batch as they arrive and leave it as they finish.

    runner = BatchRunner(model, vocab_size)                 # the model and the batch's KV caches
    decoder = BatchDecoder(runner, max_batch_size=32)
    decoder.add([GeneratingSequence(prompt_ids, params)])   # their prompts run, then they join
    while decoder.rows:
        for sequence in decoder.step():                     # one token for every row; the finished ones
            ...                                             # have left, their slots are free

The prompts that join at one step go through the model together: sorted by length and split into
groups whose padding stays small (``prefill_groups``), each group one pass right-padded to its
longest prompt, from position 0 (so every real position sees what the prompt alone would: its own
earlier tokens). The KV cache of the pass becomes the group's rows of the batch's ``BatchKVCache`` s,
cut at each prompt's length; every step then decodes one token for each row, at that row's own
position (ALiBi, rotary and learned positions read the per-row lengths: nothing is left-padded).
Each sequence samples with its own settings and its own ``torch.Generator`` (a seeded sequence draws
the same tokens whatever else is in the batch) and stops on its own conditions (max_new_tokens, the
end-of-document token, a stop string). A finished row is dropped from the caches and the rest keep
decoding.

Identity with generation alone: a pass over [k, s] or a step over [b, 1] multiplies more rows than
the alone path's [1, s] or [1, 1]: matrix kernels may sum in another order for another shape, so
logits can differ in the last bits (measured: 1e-5 in fp32, one bf16 rounding step in bf16;
tests/inference/test_batching.py), and a greedy token can differ only where the two best logits are
that close.

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

__all__ = ["BatchRunner", "GeneratingSequence", "BatchDecoder", "next_tokens", "prefill_groups"]

# A prompt pass of its own costs about as much as this many more padded positions in a shared one: the
# fixed cost of a forward (0.5 ms) against 0.08 ms per position, measured at 4 layers x 256 on one CPU thread.
PAD_BUDGET = 8


class BatchRunner:
    """The model and the KV caches of the batch's rows: token ids in, full-vocabulary logits out.

    The logits of a tensor-parallel model are vocab-parallel; they are gathered over its TP group
    (a collective every rank of the group must join: see ``megatron.inference.tp``).
    """

    def __init__(self, model, vocab_size: int):
        if getattr(model, "config", None) is not None and model.config.mla is not None:
            raise ValueError("--multi-latent-attention has no batched KV cache: the inference server and the "
                             "harness's batched generation are not implemented for it; generate with "
                             "tools/generate.py")
        self.model = model
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        self.caches: list[BatchKVCache] = [BatchKVCache() for _ in model.layers]

    @property
    def num_rows(self) -> int:
        return self.caches[0].num_rows

    def _full_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        logits = gather_from_tensor_model_parallel_region(logits, self.model.tp_group)  # [b, vp]
        return logits[:, :self.vocab_size].float()  # [b, v]

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run these prompts in one pass and add them as the last rows; the logits [k, v] of their next tokens.

        The prompts are right-padded to the longest: every row starts at position 0, so the model's
        causal mask and positions are those of each prompt alone, and a padded position (id 0) only
        ever sits after a row's real ones, where nothing real attends to it; its keys are dropped.
        """
        lengths = [len(prompt) for prompt in prompts]
        width = max(lengths)
        input_ids = torch.tensor([list(prompt) + [0] * (width - len(prompt)) for prompt in prompts],
                                 dtype=torch.long, device=self.device)  # [k, s]
        caches = self.model.new_kv_caches()
        logits = self.model(input_ids, kv_caches=caches)  # [s, k, vp / tp]
        last = torch.tensor(lengths, device=self.device) - 1  # [k]: each row's last real position
        logits = logits[last, torch.arange(len(prompts), device=self.device)]  # [k, vp / tp]
        for batch, filled in zip(self.caches, caches):
            batch.add_rows(filled.key, filled.value, lengths)
        return self._full_vocabulary(logits)  # [k, v]

    @torch.inference_mode()
    def decode(self, tokens: Sequence[int]) -> torch.Tensor:
        """One new token per row (its last one) -> the logits [b, v] of each row's next token."""
        input_ids = torch.tensor([[token] for token in tokens], dtype=torch.long, device=self.device)  # [b, 1]
        return self._full_vocabulary(self.model(input_ids, kv_caches=self.caches)[-1])  # [b, v]

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
                 generator: Optional[torch.Generator] = None, tokenizer=None, eod: Optional[int] = None,
                 on_text: Optional[Callable[[str], None]] = None,
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

    def accept(self, token: int) -> bool:
        """Take the next id (sampled by ``next_tokens``); True once the sequence is finished."""
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


def next_tokens(logits: torch.Tensor, sequences: Sequence[GeneratingSequence]) -> list[int]:
    """Each row's next id from logits [b, v] (fp32), by its sequence's settings and generator: one argmax
    for all the greedy rows, ``sample_next_token`` for each sampling one."""
    greedy = logits.argmax(dim=-1).tolist() if any(s.params.greedy for s in sequences) else None  # [b]
    return [greedy[row] if sequence.params.greedy else sample_next_token(logits[row], sequence.params, sequence.generator)
            for row, sequence in enumerate(sequences)]


def prefill_groups(sequences: Sequence[GeneratingSequence], pad_budget: int = PAD_BUDGET
                   ) -> list[list[GeneratingSequence]]:
    """Split joining sequences into prompt passes: by prompt length, each joins the pass before it unless
    widening that pass to its length adds more than ``pad_budget`` padded positions."""
    groups: list[list[GeneratingSequence]] = []
    for sequence in sorted(sequences, key=lambda s: len(s.prompt_ids)):
        if groups and len(groups[-1]) * (len(sequence.prompt_ids) - len(groups[-1][-1].prompt_ids)) <= pad_budget:
            groups[-1].append(sequence)
        else:
            groups.append([sequence])
    return groups


class BatchDecoder:
    """The running batch: ``add`` sequences (their prompts run, they join unless already finished), ``step``
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

    def add(self, sequences: Sequence[GeneratingSequence]) -> list[GeneratingSequence]:
        """Run their prompts (``prefill_groups``: one pass per group) and sample each first token; the
        sequences that this already finished (they never join)."""
        if len(sequences) > self.free_slots:
            raise ValueError(f"{len(sequences)} sequences do not fit the {self.free_slots} free slots of the batch "
                             f"({self.max_batch_size} rows); wait for free slots")
        finished = []
        for group in prefill_groups(sequences):
            logits = self.runner.prefill([sequence.prompt_ids for sequence in group])  # [k, v]
            self.rows.extend(group)
            finished += [s for s, token in zip(group, next_tokens(logits, group)) if s.accept(token)]
        self.remove(finished)
        return finished

    def step(self) -> list[GeneratingSequence]:
        """One token for every row; the sequences this finished (they have left the batch)."""
        if not self.rows:
            return []
        logits = self.runner.decode([sequence.token_ids[-1] for sequence in self.rows])  # [b, v]
        finished = [s for s, token in zip(self.rows, next_tokens(logits, self.rows)) if s.accept(token)]
        self.remove(finished)
        return finished

    def remove(self, sequences: Sequence[GeneratingSequence]) -> None:
        """Drop these rows (finished or cancelled); the others keep their caches and order."""
        gone = {id(sequence) for sequence in sequences}
        keep = [row for row, sequence in enumerate(self.rows) if id(sequence) not in gone]
        if len(keep) != len(self.rows):
            self.runner.keep_rows(keep)
            self.rows = [self.rows[row] for row in keep]
