"""Autoregressive text generation with a TP=1 GPTModel and its KV cache: greedy, top-k, top-p, temperature.

    generator = Generator.from_checkpoint("CKPT")                      # any TP / PP, merged in one process
    [completion] = generator.generate(["Once upon"], SamplingParams(max_new_tokens=32, greedy=True))
    completion.token_ids, completion.text                               # the generated ids only, and their text

Each prompt is decoded on its own (batch 1): the prompt goes through the model once, filling one
KV cache per layer, then every new token is a one-position forward that attends to the cache.
(The server decodes many prompts together, ``megatron.inference.batching``; this is its reference.)
Generation stops after ``max_new_tokens``, when the end-of-document token is produced (it is
kept as the last id of ``token_ids`` and left out of ``text``), or when the text contains one of
``stop`` (the text is cut before it; ``token_ids`` keep the token that completed it). Only real
vocabulary ids are ever produced: the padding rows of the embedding (ids >= original_vocab_size)
are masked. ``on_text(index, piece)`` receives the text while it is generated, in pieces that later
tokens cannot change (a character whose bytes are not all out yet, or a possible start of a stop
string, is held back): the pieces of a prompt add up to its final ``text``.

Sampling: logits / temperature, then keep the ``top_k`` largest (0: all), then the smallest set
whose probability reaches ``top_p`` (1.0: all; the most likely token always stays), then draw from
a ``torch.Generator`` seeded with ``seed`` (prompt i of a request: ``seed + i``): the same seed gives
the same text. The logits are fp32:
a temperature below ``MIN_TEMPERATURE`` is refused, as logits / 1e-300 overflow to +-inf (and the
softmax of those is NaN).

Shape letters: s sequence, b micro-batch, h hidden, v vocabulary (unpadded), vp padded vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import torch

from megatron.checkpoint.single_process import load_full_state_dict
from megatron.checkpoint.tp_shards import split_for_tp
from megatron.config import ModelConfig, TokenizerConfig
from megatron.data.tokenizers import build_tokenizer
from megatron.model import GPTModel, parameter_layout
from megatron.parallel.state import ParallelState

__all__ = ["SamplingParams", "Completion", "Generator", "StreamingText", "sample_next_token", "generate_token_ids",
           "tokenizer_from_record", "sequence_generator", "DTYPES", "MIN_TEMPERATURE"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIN_TEMPERATURE = 1e-4  # far below it sampling is argmax in all but name; at 1e-300 the fp32 logits overflow


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token."""

    max_new_tokens: int = 32       # tokens generated at most per prompt
    greedy: bool = False           # argmax; the sampling fields below are then ignored
    temperature: float = 1.0       # > 0; logits are divided by it
    top_k: int = 0                 # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0             # keep the smallest set with this total probability; 1.0 keeps all
    seed: Optional[int] = None     # seed of the sampling generator; None: torch's default generator
    stop: tuple[str, ...] = ()     # generation ends once the text contains one of these (the text is cut before it)

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not MIN_TEMPERATURE <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= {MIN_TEMPERATURE} (use greedy for argmax "
                             f"decoding), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        return self


@dataclasses.dataclass
class Completion:
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]           # the generated ids only (ending with the end-of-document id if it was produced)
    text: str                      # the generated text (without the end-of-document token)
    finish_reason: str             # 'eod', 'length' or 'stop' (a stop string)

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "token_ids": list(self.token_ids), "text": self.text,
                "finish_reason": self.finish_reason, "prompt_token_ids": list(self.prompt_token_ids)}


def sequence_generator(params: SamplingParams, index: int = 0) -> Optional[torch.Generator]:
    """The sampling generator of a request's ``index``-th prompt: seeded with ``seed + index`` (so that copies
    of one prompt differ, and each prompt draws the same tokens whatever is generated beside it); None
    (torch's default generator) without a seed or when greedy."""
    if params.seed is None or params.greedy:
        return None
    return torch.Generator().manual_seed((params.seed + index) % 2 ** 63)


def sample_next_token(logits: torch.Tensor, params: SamplingParams,
                      generator: Optional[torch.Generator] = None) -> int:
    """One token id from logits [v] (fp32) by ``params``."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    logits = logits / params.temperature  # [v]
    if params.top_k and params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)  # [v]
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # [v]
        # drop a token when the ones before it already reach top_p (the most likely one always stays)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        # ... even when top_p is below fp32's smallest number (1e-300 compares as 0 >= 0)
        drop_sorted[0] = False
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [v]
    return int(torch.multinomial(probs, 1, generator=generator).item())


@torch.inference_mode()
def generate_token_ids(model: GPTModel, prompt_ids: Sequence[int], params: SamplingParams, *, vocab_size: int,
                       eod: Optional[int], generator: Optional[torch.Generator] = None,
                       use_cache: bool = True,
                       on_token: Optional[Callable[[int], bool]] = None) -> tuple[list[int], str]:
    """(generated ids, finish reason) for one prompt. ``use_cache=False`` recomputes the whole sequence
    every step (the reference the cached path must equal). ``on_token(id)`` sees every new id but the
    end-of-document one; when it returns True generation ends there, with finish reason 'stop'."""
    if not prompt_ids:
        raise ValueError("the prompt has no tokens; give at least one")
    device = next(model.parameters()).device
    caches = model.new_kv_caches() if use_cache else None
    sequence = list(prompt_ids)
    step_input = torch.tensor([sequence], dtype=torch.long, device=device)  # [1, s]
    generated: list[int] = []
    for _ in range(params.max_new_tokens):
        logits = model(step_input, kv_caches=caches)  # [s, 1, vp]
        token = sample_next_token(logits[-1, 0, :vocab_size].float(), params, generator)
        generated.append(token)
        if token == eod:
            return generated, "eod"
        if on_token is not None and on_token(token):
            return generated, "stop"
        sequence.append(token)
        if use_cache:
            step_input = torch.tensor([[token]], dtype=torch.long, device=device)  # [1, 1]
        else:
            step_input = torch.tensor([sequence], dtype=torch.long, device=device)  # [1, s]
    return generated, "length"


def tokenizer_from_record(record: Optional[dict], **overrides):
    """The tokenizer a checkpoint recorded (type and files), with any of its fields overridden."""
    config = TokenizerConfig.from_record(record, **overrides)
    if config.tokenizer_type is None:
        raise ValueError("the checkpoint records no tokenizer; pass --tokenizer-type and its files")
    return build_tokenizer(config)


class Generator:
    """A model, its tokenizer and the limits of the model's positions; generates text for prompts."""

    def __init__(self, model: GPTModel, tokenizer, config: ModelConfig):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = config.original_vocab_size or config.padded_vocab_size

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str, *, tag: Optional[str] = None, dtype: str = "fp32",
                        tokenizer=None, parallel_state: Optional[ParallelState] = None,
                        **tokenizer_overrides) -> "Generator":
        """Load a training checkpoint of any TP / PP into one TP=1 GPTModel (dropout off) in ``dtype``
        ('fp32', 'bf16', 'fp16', or 'saved': the checkpoint's params_dtype); with ``parallel_state``, this
        rank's part of a GPTModel split over its tensor-parallel group (merged to TP=1, then split again)."""
        if dtype not in DTYPES and dtype != "saved":
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}, saved")
        config, state, record = load_full_state_dict(ckpt_dir, tag)
        dtype = config.params_dtype if dtype == "saved" else dtype
        # Decoding feeds one token at a time: no sequence to split, whatever the training run used.
        config = dataclasses.replace(config, params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
                                     sequence_parallel=False)
        model = GPTModel(config, parallel_state)
        if parallel_state is not None and parallel_state.tp_size > 1:
            layout, tp = parameter_layout(config), parallel_state.tp_size
            state = {name: split_for_tp(layout[name], tensor, tp)[parallel_state.tp_rank]
                     for name, tensor in state.items()}
        model.load_state_dict({name: tensor.to(DTYPES[dtype]) for name, tensor in state.items()})
        if tokenizer is None:
            tokenizer = tokenizer_from_record(record.get("tokenizer", {}), **tokenizer_overrides)
        return cls(model, tokenizer, config)

    def max_total_tokens(self) -> Optional[int]:
        """Positions the model can address (learned positions only); None: unbounded (ALiBi, rotary)."""
        return self.config.max_positions if self.config.position_embedding_type == "absolute" else None

    def check_length(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        limit = self.max_total_tokens()
        if num_prompt_tokens < 1:
            raise ValueError("the prompt has no tokens; give at least one")
        if limit is not None and num_prompt_tokens + max_new_tokens > limit:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens + max_new_tokens {max_new_tokens} exceeds the "
                             f"model's {limit} learned positions; shorten the prompt or lower max_new_tokens")

    def generate(self, prompts: Sequence[str], params: SamplingParams, *,
                 on_text: Optional[Callable[[int, str], None]] = None,
                 prompt_ids: Optional[Sequence[Sequence[int]]] = None) -> list[Completion]:
        """One completion per prompt. ``on_text(index, piece)``: the text of prompt ``index`` as it is
        generated (an exception it raises ends the generation). ``prompt_ids``: the prompts already tokenized."""
        params.validate()
        encoded = [self.tokenizer.tokenize(prompt) for prompt in prompts] if prompt_ids is None else prompt_ids
        for ids in encoded:
            self.check_length(len(ids), params.max_new_tokens)
        eod = getattr(self.tokenizer, "eod", None)
        completions = []
        for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
            # Following the text token by token costs a detokenize per token: only when it is needed.
            text = StreamingText(self.tokenizer, params.stop) if params.stop or on_text is not None else None

            def on_token(token: int) -> bool:
                stopped = text.add(token)
                if on_text is not None and (piece := text.take()):
                    on_text(index, piece)
                return stopped

            generated, reason = generate_token_ids(self.model, ids, params, vocab_size=self.vocab_size, eod=eod,
                                                   generator=sequence_generator(params, index),
                                                   on_token=on_token if text else None)
            if text is None:
                final = self.tokenizer.detokenize(generated[:-1] if reason == "eod" else generated)
            else:
                final = text.text
                if on_text is not None and (piece := text.take(final=True)):
                    on_text(index, piece)
            completions.append(Completion(prompt, list(ids), generated, final, reason))
        return completions


class StreamingText:
    """The text of a growing list of generated ids, cut before the first stop string, handed out in pieces.

    ``take()`` gives the text not handed out yet that no later token can change: it holds back a trailing
    U+FFFD (a character whose bytes are split over tokens decodes to it until its last byte comes) and a
    trailing piece that could be the start of a stop string. ``take(final=True)`` gives the rest.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._taken = 0           # characters of self.text handed out
        self.text = ""
        self.stopped = False

    def add(self, token: int) -> bool:
        """Append one id; True once the text holds a stop string (it is then cut before it)."""
        self._ids.append(token)
        text = self._tokenizer.detokenize(self._ids)
        cuts = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if cuts:
            text, self.stopped = text[:min(cuts)], True
        self.text = text
        return self.stopped

    def take(self, final: bool = False) -> str:
        end = len(self.text)
        if not (final or self.stopped):
            while end > self._taken and self.text[end - 1] == "\ufffd":
                end -= 1
            held = max((k for s in self._stop for k in range(1, len(s)) if self.text.endswith(s[:k], 0, end)),
                       default=0)
            end -= held
        piece = self.text[self._taken:end] if end > self._taken else ""
        self._taken = max(self._taken, end)
        return piece
