"""OpenAI's completions API, ``POST /v1/completions``, on the server's generator, limits and worker.

Request: ``model`` (any string; answered with the served model's name), ``prompt`` (a string or a list
of strings), ``max_tokens`` (default 16), ``temperature`` (default 1; 0 is greedy), ``top_p``,
``n`` (completions per prompt), ``stop`` (a string or up to 4), ``seed``, ``stream`` and
``stream_options.include_usage``, ``user`` (ignored). The parameters this server does not implement
are accepted at their neutral value only (``logprobs``/``suffix``/``logit_bias`` null, ``echo``
false, ``best_of`` 1, the penalties 0); anything else is a 400 naming the parameter, as is every
malformed body (``megatron.inference.validation``). Errors have OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with the server's status codes.

Reply: ``id``, ``object`` "text_completion", ``created``, ``model``, ``choices`` (prompt i's j-th
completion at index i * n + j, with ``text``, ``finish_reason`` "stop" (a stop string or the end of
document) or "length", ``logprobs`` null), ``usage`` (prompt_tokens counts each prompt once). With
``stream``, server-sent events: ``data: {chunk}`` for each piece of text as it is generated, one
chunk per choice with its finish_reason, the usage chunk if asked, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

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

__all__ = ["completions", "error_response", "parse_completions_request"]

logger = logging.getLogger(__name__)

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


def _check_fields(body: dict) -> None:
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not (value == neutral and isinstance(value, bool) == isinstance(neutral, bool)):
            raise RequestError(400, f"'{name}' is not supported by this server (only {json.dumps(neutral)})",
                               param=name)
    unknown = sorted(set(body) - _FIELDS - set(_NEUTRAL))
    if unknown:
        raise RequestError(400, f"unknown fields {unknown!r:.200}", param=unknown[0][:100])
    for name in ("model", "prompt"):
        if name not in body:
            raise RequestError(400, f"'{name}' is required", param=name)
    typed_field(body, "model", (str,), None)
    typed_field(body, "user", (str,), None)


def parse_completions_request(raw: bytes, limits) -> dict[str, Any]:
    """The fields of a /v1/completions body: prompts, n, SamplingParams, stream, include_usage."""
    body = load_json_object(raw)
    _check_fields(body)
    n = typed_field(body, "n", (int,), 1)
    if n < 1:
        raise RequestError(400, f"'n' must be >= 1, got {n}", param="n")
    prompts = check_prompts(body["prompt"], limits, copies=n)
    temperature = typed_field(body, "temperature", (int, float), 1.0)
    if temperature < 0:
        raise RequestError(400, f"'temperature' must be >= 0 (0 is greedy), got {temperature}", param="temperature")
    params = sampling_params(limits, "max_tokens", max_new_tokens=typed_field(body, "max_tokens", (int,), 16),
                             greedy=temperature == 0, temperature=temperature or 1.0,
                             top_p=typed_field(body, "top_p", (int, float), 1.0),
                             seed=typed_field(body, "seed", (int,), None), stop=_stop_strings(body))
    options = typed_field(body, "stream_options", (dict,), None) or {}
    if set(options) - {"include_usage"}:
        raise RequestError(400, f"unknown stream_options {sorted(options)!r:.200}", param="stream_options")
    stream = typed_field(body, "stream", (bool,), False)
    include_usage = typed_field(options, "include_usage", (bool,), False)
    if options and not stream:
        raise RequestError(400, "'stream_options' needs 'stream': true", param="stream_options")
    return {"prompts": prompts, "n": n, "params": params, "stream": stream, "include_usage": include_usage}


def _usage(prompt_ids, completions, n: int) -> dict:
    prompt_tokens = sum(len(ids) for ids in prompt_ids[::n])
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice(index: int, text: str, finish_reason) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}


async def completions(service, request: web.BaseRequest, raw: bytes) -> web.StreamResponse:
    """Answer one /v1/completions request (RequestError / Busy propagate, before any byte is sent)."""
    fields = parse_completions_request(raw, service.limits)
    params, n = fields["params"], fields["n"]
    prompts = [p for p in fields["prompts"] for _ in range(n)]
    prompt_ids = tokenize_prompts(service.generator, fields["prompts"], service.limits, params.max_new_tokens)
    prompt_ids = [ids for ids in prompt_ids for _ in range(n)]
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": service.model_name}
    if not fields["stream"]:
        done = await service.worker.generate(prompts, params, prompt_ids)
        return web.json_response({**head, "choices": [_choice(i, c.text, _FINISH_REASONS[c.finish_reason])
                                                      for i, c in enumerate(done)],
                                  "usage": _usage(prompt_ids, done, n)})
    return await _stream(service, request, head, prompts, params, prompt_ids, fields["include_usage"], n)


async def _stream(service, request, head, prompts, params, prompt_ids, include_usage: bool,
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
            while not isinstance(event, Finished):
                assert isinstance(event, TextPiece), event
                await send({**head, "choices": [_choice(event.index, event.text, None)]})
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
            await send({**head, "choices": [_choice(index, "", _FINISH_REASONS[completion.finish_reason])]})
        if include_usage:
            await send({**head, "choices": [], "usage": _usage(prompt_ids, event.completions, n)})
        await send("[DONE]")
        await response.write_eof()
        return response
