"""Autoregressive text generation with a TP=1 GPTModel and its KV cache: greedy, top-k, top-p, temperature.

    generator = Generator.from_checkpoint("CKPT")                      # any TP / PP, merged in one process
    [completion] = generator.generate(["Once upon"], SamplingParams(max_new_tokens=32, greedy=True))
    completion.token_ids, completion.text                               # the generated ids only, and their text

Each prompt is decoded on its own (batch 1): the prompt goes through the model once, filling one
KV cache per layer, then every new token is a one-position forward that attends to the cache.
Generation stops after ``max_new_tokens`` or when the end-of-document token is produced (it is
kept as the last id of ``token_ids`` and left out of ``text``). Only real vocabulary ids are ever
produced: the padding rows of the embedding (ids >= original_vocab_size) are masked.

Sampling: logits / temperature, then keep the ``top_k`` largest (0: all), then the smallest set
whose probability reaches ``top_p`` (1.0: all), then draw from a ``torch.Generator`` seeded with
``seed``: the same seed gives the same text.

Shape letters: s sequence, b micro-batch, h hidden, v vocabulary (unpadded), vp padded vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from megatron.config import ModelConfig, TokenizerConfig
from megatron.data.tokenizers import build_tokenizer
from megatron.checkpoint.merge import load_full_state_dict
from megatron.model import GPTModel

__all__ = ["SamplingParams", "Completion", "Generator", "sample_next_token", "generate_token_ids",
           "tokenizer_from_record", "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token."""

    max_new_tokens: int = 32       # tokens generated at most per prompt
    greedy: bool = False           # argmax; the sampling fields below are then ignored
    temperature: float = 1.0       # > 0; logits are divided by it
    top_k: int = 0                 # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0             # keep the smallest set with this total probability; 1.0 keeps all
    seed: Optional[int] = None     # seed of the sampling generator; None: torch's default generator

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (use greedy for argmax decoding), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        return self


@dataclasses.dataclass
class Completion:
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]           # the generated ids only (ending with the end-of-document id if it was produced)
    text: str                      # the generated text (without the end-of-document token)
    finish_reason: str             # 'eod' or 'length'

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "token_ids": list(self.token_ids), "text": self.text,
                "finish_reason": self.finish_reason, "prompt_token_ids": list(self.prompt_token_ids)}


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
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [v]
    return int(torch.multinomial(probs, 1, generator=generator).item())


@torch.inference_mode()
def generate_token_ids(model: GPTModel, prompt_ids: Sequence[int], params: SamplingParams, *, vocab_size: int,
                       eod: Optional[int], generator: Optional[torch.Generator] = None,
                       use_cache: bool = True) -> tuple[list[int], str]:
    """(generated ids, finish reason) for one prompt. ``use_cache=False`` recomputes the whole sequence
    every step (the reference the cached path must equal)."""
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
                        tokenizer=None, **tokenizer_overrides) -> "Generator":
        """Load a training checkpoint of any TP / PP into one TP=1 GPTModel (dropout off) in ``dtype``
        ('fp32', 'bf16', 'fp16', or 'saved': the checkpoint's params_dtype)."""
        if dtype not in DTYPES and dtype != "saved":
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}, saved")
        config, state, record = load_full_state_dict(ckpt_dir, tag)
        dtype = config.params_dtype if dtype == "saved" else dtype
        config = dataclasses.replace(config, params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0)
        model = GPTModel(config)
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

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Completion]:
        params.validate()
        encoded = [self.tokenizer.tokenize(prompt) for prompt in prompts]
        for ids in encoded:
            self.check_length(len(ids), params.max_new_tokens)
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator().manual_seed(params.seed)
        eod = getattr(self.tokenizer, "eod", None)
        completions = []
        for prompt, ids in zip(prompts, encoded):
            generated, reason = generate_token_ids(self.model, ids, params, vocab_size=self.vocab_size, eod=eod,
                                                   generator=generator)
            text_ids = generated[:-1] if reason == "eod" else generated
            completions.append(Completion(prompt, list(ids), generated, self.tokenizer.detokenize(text_ids), reason))
        return completions
