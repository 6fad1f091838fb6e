"""OpenAI's API on the server's generator, limits and worker: ``POST /v1/completions`` (here),
``POST /v1/chat/completions`` (``megatron.inference.openai_chat``) and ``GET /v1/models``.

Completions request: ``model`` (any string; answered with the served model's name), ``prompt`` (a
string, a list of strings, a list of token ids, or a list of lists of token ids), ``max_tokens``
(default 16, at least 1), ``temperature`` (default 1; 0 is greedy; at most 2, OpenAI's range), ``top_p``
(in (0, 1]), ``n`` (completions per prompt), ``stop`` (a string or up to 4), ``seed``, ``stream`` and
``stream_options.include_usage``, ``user`` (ignored). The parameters this server does not implement
are accepted at their neutral value only (``logprobs``/``suffix``/``logit_bias`` null, ``echo``
false, ``best_of`` 1, the penalties 0); anything else is a 400 naming the parameter by OpenAI's name,
as is every malformed body (``megatron.inference.validation``). Errors have OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with the server's status codes.

Reply: ``id``, ``object`` "text_completion", ``created``, ``model``, ``choices`` (prompt i's j-th
completion at index i * n + j, with ``text``, ``finish_reason`` "stop" (a stop string or the end of
document) or "length", ``logprobs`` null), ``usage`` (prompt_tokens counts each prompt once). With
``stream``, server-sent events: ``data: {chunk}`` for each piece of text as it is generated, one
chunk per choice with its finish_reason, the usage chunk if asked, then ``data: [DONE]``.

``GET /v1/models`` lists the one served model, ``GET /v1/models/{name}`` describes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http
import json
import logging
import time
import uuid
from typing import Callable, Optional

from aiohttp import web

from megatron.inference.generation import MIN_TEMPERATURE, SamplingParams
from megatron.inference.scheduler import Finished, TextPiece
from megatron.inference.validation import (
    RequestError,
    check_prompts,
    check_unicode,
    load_json_object,
    sampling_params,
    tokenize_prompts,
    typed_field,
)

__all__ = ["OpenAIRequest", "Shape", "answer", "check_fields", "completions", "error_response", "model_card",
           "parse_completions_request", "parse_sampling", "MAX_TEMPERATURE"]

logger = logging.getLogger(__name__)

MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
_MAX_STOP_STRINGS = 4
_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
           "stream_options", "user"}
_NEUTRAL = {"logprobs": None, "suffix": None, "logit_bias": None, "echo": False, "best_of": 1,
            "presence_penalty": 0, "frequency_penalty": 0}  # accepted, and only at these values
_FINISH_REASONS = {"eod": "stop", "stop": "stop", "length": "length"}


def error_response(error: RequestError) -> web.Response:
    kind = "server_error" if error.status >= 500 else "invalid_request_error"
    code = http.HTTPStatus(error.status).phrase.lower().replace(" ", "_")
    response = web.json_response({"error": {"message": error.message, "type": kind, "param": error.param,
                                            "code": code}}, status=error.status)
    if error.status in (405, 408, 411, 413):
        response.force_close()
    return response


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    if len(stops) > _MAX_STOP_STRINGS:
        raise RequestError(400, f"{len(stops)} stop strings; at most {_MAX_STOP_STRINGS}", param="stop")
    for text in stops:
        check_unicode(text, "a stop string", "stop")
    return tuple(stops)


def check_fields(body: dict, known: set[str], neutral: dict, required: tuple[str, ...]) -> None:
    """400 for a field outside ``known`` and ``neutral``, a ``neutral`` one at another value, a missing one."""
    for name, value in neutral.items():
        given = body.get(name)
        if given is not None and not (given == value and isinstance(given, bool) == isinstance(value, bool)):
            raise RequestError(400, f"'{name}' is not supported by this server (only {json.dumps(value)})",
                               param=name)
    unknown = sorted(set(body) - known - set(neutral))
    if unknown:
        raise RequestError(400, f"unknown fields {unknown!r:.200}", param=unknown[0][:100])
    for name in required:
        if name not in body:
            raise RequestError(400, f"'{name}' is required", param=name)
    typed_field(body, "model", (str,), None)
    typed_field(body, "user", (str,), None)


@dataclasses.dataclass(frozen=True)
class OpenAIRequest:
    """What a completions or chat request asks for, checked: each prompt once, and how to answer."""

    prompts: list  # texts, or token-id lists
    n: int
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompt_param: str = "prompt"  # the field a refused prompt is reported under


def parse_sampling(body: dict, limits, max_tokens_name: str, default_max_tokens: int) -> SamplingParams:
    """SamplingParams from OpenAI's fields, each refused under its own name (``max_tokens_name``: the
    field that holds the number of new tokens)."""
    max_tokens = typed_field(body, max_tokens_name, (int,), default_max_tokens)
    if max_tokens < 1:
        raise RequestError(400, f"'{max_tokens_name}' must be >= 1, got {max_tokens}", param=max_tokens_name)
    temperature = typed_field(body, "temperature", (int, float), 1.0)
    if temperature != 0 and not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        raise RequestError(400, f"'temperature' must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                                f"got {temperature}", param="temperature")
    top_p = typed_field(body, "top_p", (int, float), 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(400, f"'top_p' must be in (0, 1] (1 keeps every token), got {top_p}", param="top_p")
    return sampling_params(limits, max_tokens_name, max_new_tokens=max_tokens, greedy=temperature == 0,
                           temperature=temperature or 1.0, top_p=top_p, seed=typed_field(body, "seed", (int,), None),
                           stop=_stop_strings(body))


def parse_n(body: dict) -> int:
    n = typed_field(body, "n", (int,), 1)
    if n < 1:
        raise RequestError(400, f"'n' must be >= 1, got {n}", param="n")
    return n


def parse_stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    options = typed_field(body, "stream_options", (dict,), None) or {}
    if set(options) - {"include_usage"}:
        raise RequestError(400, f"unknown stream_options {sorted(options)!r:.200}", param="stream_options")
    stream = typed_field(body, "stream", (bool,), False)
    include_usage = typed_field(options, "include_usage", (bool,), False)
    if options and not stream:
        raise RequestError(400, "'stream_options' needs 'stream': true", param="stream_options")
    return stream, include_usage


def parse_completions_request(raw: bytes, limits) -> OpenAIRequest:
    """The fields of a /v1/completions body."""
    body = load_json_object(raw)
    check_fields(body, _FIELDS, _NEUTRAL, ("model", "prompt"))
    n = parse_n(body)
    prompts = check_prompts(body["prompt"], limits, copies=n, token_ids=True)
    return OpenAIRequest(prompts, n, parse_sampling(body, limits, "max_tokens", 16), *parse_stream(body))


@dataclasses.dataclass(frozen=True)
class Shape:
    """How an endpoint words its answer: the objects' names and one choice, whole or streamed."""

    object: str                                               # of a whole answer
    chunk_object: str                                         # of a streamed chunk
    id_prefix: str
    choice: Callable[[int, str, str], dict]                   # (index, text, finish_reason) of a whole answer
    piece: Callable[[int, str, Optional[str]], dict]          # (index, text, finish_reason or None) of a chunk
    opening: Optional[Callable[[int], dict]] = None           # a choice's first chunk, before any text


def _choice(index: int, text: str, finish_reason: Optional[str]) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}


COMPLETION = Shape("text_completion", "text_completion", "cmpl", _choice, _choice)


def _usage(prompt_ids, completions, n: int) -> dict:
    prompt_tokens = sum(len(ids) for ids in prompt_ids[::n])
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def completions(service, request: web.BaseRequest, raw: bytes) -> web.StreamResponse:
    """Answer one /v1/completions request (RequestError / Busy propagate, before any byte is sent)."""
    return await answer(service, request, parse_completions_request(raw, service.limits), COMPLETION)


async def answer(service, request: web.BaseRequest, asked: OpenAIRequest, shape: Shape) -> web.StreamResponse:
    """Generate ``n`` completions of each prompt and answer in ``shape``, whole or streamed."""
    params, n, tokenizer = asked.params, asked.n, service.generator.tokenizer
    try:
        prompt_ids = tokenize_prompts(service.generator, asked.prompts, service.limits, params.max_new_tokens)
    except RequestError as error:
        raise RequestError(error.status, error.message, param=asked.prompt_param) from None
    texts = [p if isinstance(p, str) else tokenizer.detokenize(p) for p in asked.prompts]
    prompts = [text for text in texts for _ in range(n)]
    prompt_ids = [ids for ids in prompt_ids for _ in range(n)]
    head = {"id": f"{shape.id_prefix}-{uuid.uuid4().hex}", "object": shape.object, "created": int(time.time()),
            "model": service.model_name}
    if not asked.stream:
        done = await service.worker.generate(prompts, params, prompt_ids)
        return web.json_response({**head, "choices": [shape.choice(i, c.text, _FINISH_REASONS[c.finish_reason])
                                                      for i, c in enumerate(done)],
                                  "usage": _usage(prompt_ids, done, n)})
    head["object"] = shape.chunk_object
    return await _stream(service, request, head, shape, prompts, params, prompt_ids, asked.include_usage, n)


async def _stream(service, request, head, shape: Shape, prompts, params, prompt_ids, include_usage: bool,
                  n: int) -> web.StreamResponse:
    timeout = service.limits.read_timeout
    async with contextlib.aclosing(service.worker.stream(prompts, params, prompt_ids)) as events:
        event = await events.__anext__()  # Busy, or a failure before the first token: still a plain answer
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(payload) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            try:  # a client that stops reading is a client gone: its generation stops
                await asyncio.wait_for(response.write(f"data: {data}\n\n".encode()), timeout)
            except asyncio.TimeoutError:
                raise ConnectionResetError(f"the client read nothing for {timeout} s") from None

        try:
            if shape.opening is not None:
                await send({**head, "choices": [shape.opening(index) for index in range(len(prompts))]})
            while not isinstance(event, Finished):
                assert isinstance(event, TextPiece), event
                await send({**head, "choices": [shape.piece(event.index, event.text, None)]})
                event = await events.__anext__()
        except Exception as error:  # noqa: BLE001 - the status is sent: report in the stream and end it
            if isinstance(error, ConnectionError):
                raise
            logger.error("generation failed during a stream", exc_info=error)
            await send({"error": {"message": f"internal error: {type(error).__name__}: {error}",
                                  "type": "server_error", "param": None, "code": "internal_server_error"}})
            await response.write_eof()
            return response
        for index, completion in enumerate(event.completions):
            await send({**head, "choices": [shape.piece(index, "", _FINISH_REASONS[completion.finish_reason])]})
        if include_usage:
            await send({**head, "choices": [], "usage": _usage(prompt_ids, event.completions, n)})
        await send("[DONE]")
        await response.write_eof()
        return response


def model_card(service) -> dict:
    return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "megatron-ds3d"}
