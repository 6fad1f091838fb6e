"""The server's limits and the checks every request body goes through before it reaches the model.

A body is parsed strictly: UTF-8 JSON without NaN / Infinity (nor numbers that overflow to them),
nesting and integer sizes bounded by Python's own limits (caught, as 400), no lone surrogates in
strings (they cannot be tokenized), no unknown fields, and every field of its type (a bool is not
a number here). A prompt is checked against ``max_prompt_tokens`` without tokenizing all of a text
that is obviously longer (``tokenize_prompt``); a prompt of token ids (OpenAI's completions API allows
them) is checked id by id against the vocabulary. Every refusal is a ``RequestError(status, message)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Sequence

import numpy as np

from megatron.inference.generation import SamplingParams

__all__ = ["ServerLimits", "RequestError", "load_json_object", "typed_field", "check_prompts", "check_unicode",
           "tokenize_prompt", "tokenize_prompts", "check_token_prompt", "parse_generate_request", "sampling_params"]

_GENERATE_FIELDS = {"prompt", "max_new_tokens", "greedy", "temperature", "top_k", "top_p", "seed"}
_PIECE_CHARS = 4096  # characters tokenized at a time while a long prompt is being counted


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_prompt_tokens: int = 1024       # tokens of one prompt
    max_new_tokens_limit: int = 256     # the largest max_new_tokens a request may ask for
    max_request_bytes: int = 1 << 20    # size of a request body
    max_prompts: int = 16               # prompts in one request (for /v1/completions: prompts x n)
    default_max_new_tokens: int = 32
    read_timeout: float = 30.0          # seconds for a request's headers to arrive, and then for its body
    max_connections: int = 1024         # open connections; one more is answered 503 and closed
    max_pending_requests: int = 64      # generation requests waiting or running; one more is answered 503
    max_batch_size: int = 32            # sequences decoded together; the next waits for one to finish

    def validate(self) -> "ServerLimits":
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "read_timeout":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                    raise ValueError(f"--read-timeout must be a positive number of seconds, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{field.name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(f"default max_new_tokens {self.default_max_new_tokens} exceeds --max-new-tokens-limit "
                             f"{self.max_new_tokens_limit}")
        return self


class RequestError(Exception):
    """A request refused: HTTP ``status`` and a message naming the value and the limit or the fix."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param  # the offending field, where there is one (OpenAI's error shape reports it)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


MAX_JSON_DEPTH = 32  # a request nests 3 deep; far deeper is refused before parsing
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(raw: bytes) -> int:
    """How deep ``raw``'s arrays and objects nest (brackets inside strings do not count). Counted before
    parsing, so the answer does not depend on the interpreter's recursion limit (which other libraries
    raise) and a deep body never reaches the parser."""
    codes = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    if codes.size == 0:
        return 0
    steps = np.isin(codes, (ord("["), ord("{"))).astype(np.int32) - np.isin(codes, (ord("]"), ord("}")))
    return int(np.cumsum(steps).max(initial=0))


def load_json_object(raw: bytes) -> dict:
    """A JSON object from a request body, or RequestError(400)."""
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise RequestError(400, f"the body is not valid JSON: nested too deeply (more than {MAX_JSON_DEPTH} levels)")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError) as error:  # JSONDecodeError, NaN, 1e999, an int over 4300 digits
        raise RequestError(400, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError(400, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


def typed_field(body: dict, name: str, kinds: tuple, default: Any) -> Any:
    """``body[name]`` if it is one of ``kinds`` (``default`` when absent, or null with a None default)."""
    if name not in body or (body[name] is None and default is None):
        return default
    value = body[name]
    # bool is an int in python: refuse True where a number is meant, and numbers where a bool is.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise RequestError(400, f"'{name}' must be {names}, got {type(value).__name__} {value!r:.80}", param=name)
    return value


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def check_prompts(prompt: Any, limits: ServerLimits, copies: int = 1,
                  token_ids: bool = False) -> list[str | list[int]]:
    """The prompts of a 'prompt' field (a string or a non-empty list of strings), each encodable as UTF-8.
    With ``token_ids``, also OpenAI's forms of pre-tokenized prompts: a list of ids is one prompt, a list of
    lists of ids is several (the ids are checked by ``tokenize_prompts``)."""
    if token_ids and _is_token_ids(prompt) and prompt:
        prompts = [prompt]
    else:
        prompts = prompt if isinstance(prompt, list) else [prompt]
    if not prompts or not (all(isinstance(p, str) for p in prompts)
                           or (token_ids and all(_is_token_ids(p) for p in prompts))):
        kinds = ", a list of token ids or a list of such lists" if token_ids else ""
        raise RequestError(400, f"'prompt' must be a string, a non-empty list of strings{kinds}", param="prompt")
    if len(prompts) * copies > limits.max_prompts:
        count = f"{len(prompts)} prompts x n={copies}" if copies > 1 else f"{len(prompts)} prompts"
        raise RequestError(413, f"{count} in one request; the limit is {limits.max_prompts}", param="prompt")
    for index, text in enumerate(prompts):
        if isinstance(text, str):
            check_unicode(text, f"prompt {index}", "prompt")
    return prompts


def check_unicode(text: str, what: str, param: str) -> None:
    """RequestError(400) for a string that is not text: JSON "\\ud800" is a lone surrogate, no character at all."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise RequestError(400, f"{what} is not valid Unicode: {error.reason} at character {error.start}",
                           param=param) from None


def tokenize_prompt(generator, text: str, limits: ServerLimits, max_new_tokens: int) -> list[int]:
    """The ids of one prompt by ``generator.tokenizer``, or RequestError: 413 over ``max_prompt_tokens``, 400 for
    no tokens or more positions than the model has.

    A text longer than one piece is first counted piece by piece (``_PIECE_CHARS`` characters each),
    stopping as soon as the pieces hold twice the limit: a 1 MB prompt costs a few pieces, not a 1 MB
    tokenization. Cutting a text can add or remove a token at each cut, hence the factor 2; a text
    that passes is tokenized whole, for the exact count.
    """
    limit, tokenizer = limits.max_prompt_tokens, generator.tokenizer
    if len(text) > _PIECE_CHARS:
        counted = 0
        for start in range(0, len(text), _PIECE_CHARS):
            counted += len(tokenizer.tokenize(text[start:start + _PIECE_CHARS]))
            if counted > 2 * limit:
                raise RequestError(413, f"a prompt of {len(text)} characters has over {counted} tokens; the limit "
                                        f"is {limit}", param="prompt")
    return _check_length(generator, tokenizer.tokenize(text), limits, max_new_tokens)


def _check_length(generator, ids: list[int], limits: ServerLimits, max_new_tokens: int) -> list[int]:
    if len(ids) > limits.max_prompt_tokens:
        raise RequestError(413, f"a prompt has {len(ids)} tokens; the limit is {limits.max_prompt_tokens}",
                           param="prompt")
    try:
        generator.check_length(len(ids), max_new_tokens)
    except ValueError as error:
        raise RequestError(400, str(error), param="prompt") from None
    return ids


def check_token_prompt(generator, ids: list[int], limits: ServerLimits, max_new_tokens: int) -> list[int]:
    """A prompt given as token ids, or RequestError: 400 for an id outside the vocabulary, else as a text's ids."""
    _check_length(generator, ids, limits, max_new_tokens)
    for position, token in enumerate(ids):
        if not 0 <= token < generator.vocab_size:
            raise RequestError(400, f"token id {token} at position {position} of a prompt is not in the "
                                    f"vocabulary [0, {generator.vocab_size})", param="prompt")
    return list(ids)


def sampling_params(limits: ServerLimits, max_tokens_field: str = "max_new_tokens", **fields) -> SamplingParams:
    """SamplingParams from already-typed fields, max_new_tokens (called ``max_tokens_field`` in the
    request) checked against the server's limit."""
    if fields["max_new_tokens"] > limits.max_new_tokens_limit:
        raise RequestError(413, f"{max_tokens_field} {fields['max_new_tokens']} exceeds this server's limit "
                                f"{limits.max_new_tokens_limit}", param=max_tokens_field)
    params = SamplingParams(**fields)
    try:
        return params.validate()
    except ValueError as error:
        name = str(error).split(" ", 1)[0]
        raise RequestError(400, str(error), param=name) from None


def parse_generate_request(raw: bytes, limits: ServerLimits) -> tuple[list[str], SamplingParams]:
    """(prompts, sampling parameters) of a /generate body, or RequestError."""
    body = load_json_object(raw)
    unknown = sorted(set(body) - _GENERATE_FIELDS)
    if unknown:
        raise RequestError(400, f"unknown fields {unknown!r:.200}; known: {sorted(_GENERATE_FIELDS)}")
    if "prompt" not in body:
        raise RequestError(400, "'prompt' is required (a string or a list of strings)")
    prompts = check_prompts(body["prompt"], limits)
    params = sampling_params(
        limits, max_new_tokens=typed_field(body, "max_new_tokens", (int,), limits.default_max_new_tokens),
        greedy=typed_field(body, "greedy", (bool,), False),
        temperature=typed_field(body, "temperature", (int, float), 1.0),
        top_k=typed_field(body, "top_k", (int,), 0), top_p=typed_field(body, "top_p", (int, float), 1.0),
        seed=typed_field(body, "seed", (int,), None))
    return prompts, params


def tokenize_prompts(generator, prompts: Sequence[str | list[int]], limits: ServerLimits,
                     max_new_tokens: int) -> list[list[int]]:
    """The ids of each prompt: a text tokenized (``tokenize_prompt``), token ids checked (``check_token_prompt``)."""
    return [check_token_prompt(generator, p, limits, max_new_tokens) if isinstance(p, list)
            else tokenize_prompt(generator, p, limits, max_new_tokens) for p in prompts]
