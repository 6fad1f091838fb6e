"""The HTTP text-generation server, on aiohttp's low-level server (one event loop, no thread per connection).

    POST /generate        {"prompt": str | [str, ...], "max_new_tokens": int, "greedy": bool, "temperature": float,
                           "top_k": int, "top_p": float, "seed": int}
                          -> 200 {"completions": [{"prompt", "token_ids", "text", "finish_reason", ...}, ...]}
    POST /v1/completions  OpenAI's completions API (``megatron.inference.openai_api``)
    POST /v1/chat/completions  OpenAI's chat completions API (``megatron.inference.openai_chat``)
    GET  /v1/models       the served model (and GET /v1/models/{its name})
    GET  /health          -> 200 {"status": "ok", ...}

Why aiohttp: its server is a plain asyncio protocol whose hooks (``web.Server.connection_made`` /
``connection_lost``, the request handler's ``handle_error``) let each limit below be enforced in a
few lines, where uvicorn would need the same work inside its protocol classes and two more packages.
How each limit is enforced (``ServerLimits``):

- ``read_timeout``: aiohttp has no timeout for reading a request; only its idle ``keepalive_timeout``
  (which older versions started after a first response only) closes a connection whose headers are
  incomplete. So ``_Server`` arms its own deadline per connection when it opens and after each
  response, disarmed when the headers are complete (a client that trickles them is dropped too); the
  body is then read under ``asyncio.wait_for`` with the same timeout (408).
- ``max_connections``: counted in ``_Server.connection_made``; one more gets a canned 503 and is
  closed at once, before any parsing. The listen backlog is sized for bursts of connections.
- ``max_request_bytes``: a Content-Length over it is a 413 before a byte of the body is read; a chunked
  body stops being read at the limit (aiohttp then reads and drops what follows for at most
  ``read_timeout``, so the client sees the 413 instead of a reset). A prompt is counted piece by piece
  and refused at twice ``max_prompt_tokens`` without tokenizing the rest (``validation.tokenize_prompt``).
- Workers: generation (blocking torch work) runs on the one thread of ``GenerationWorker``, which
  holds at most ``max_pending_requests`` (503 past it) and decodes up to ``max_batch_size`` sequences
  together (continuous batching); the loop keeps serving /health meanwhile.

Errors are JSON {"error": message, "status": code} (OpenAI's shape under /v1/): 400 (malformed HTTP or JSON, NaN / Infinity, wrong
types, unknown fields, invalid values, lone surrogates, an empty prompt), 404, 405, 408 (body too
slow), 411 (no Content-Length and not chunked), 413 (too large: body, prompt, max_new_tokens, prompts),
503 (too many connections or requests), 500 only for a failure inside generation (logged once, with
its traceback). A client that disconnects is not an error: at most one debug line. Binds 127.0.0.1
unless told otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import socket
import time
from typing import Awaitable, Callable, Optional

import torch
from aiohttp import web

from megatron.inference import openai_api, openai_chat
from megatron.inference.chat_template import ChatTemplate
from megatron.inference.generation import Generator
from megatron.inference.scheduler import Busy, GenerationWorker
from megatron.inference.validation import RequestError, ServerLimits, parse_generate_request, tokenize_prompts
from megatron.parallel.state import group_size

__all__ = ["ServerLimits", "RequestError", "GenerationService", "GenerationServer", "make_server"]

logger = logging.getLogger(__name__)

_MAX_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn


def _error_body(status: int, message: str) -> dict:
    return {"error": message, "status": status}


def _json_response(status: int, payload: dict, close: bool = False) -> web.Response:
    response = web.json_response(payload, status=status)  # json.dumps escapes every non-ASCII character
    if close:
        response.force_close()
    return response


def _canned_503(message: str) -> bytes:
    body = json.dumps(_error_body(503, message)).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _Protocol(web.RequestHandler):
    """aiohttp's per-connection protocol, answering malformed HTTP with the server's JSON errors and one debug
    line (aiohttp's own answer is text, logged with a traceback per bad client)."""

    def handle_error(self, request, status: int = 500, exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        if status >= 500:
            logger.error("request failed", exc_info=exc)
        else:
            logger.debug("malformed request from %s: %s", request.remote, message or exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started; no error reply can follow")
        return _json_response(status, _error_body(status, message or str(exc) or "malformed request"), close=True)


class _Server(web.Server):
    """aiohttp's low-level server (the protocol factory) with a cap on open connections and a deadline for
    the headers of each request."""

    def __init__(self, handler, *, max_connections: int, read_timeout: float, **protocol_kwargs):
        super().__init__(handler, handler_cancellation=True, **protocol_kwargs)
        self._protocol_kwargs = protocol_kwargs
        self._event_loop = asyncio.get_running_loop()
        self.max_connections = max_connections
        self.read_timeout = read_timeout
        self.open_connections = 0
        self.refused_connections = 0
        self._deadlines: dict[web.RequestHandler, asyncio.TimerHandle] = {}
        self._busy = _canned_503(f"{max_connections} connections are open (the limit); try again later")

    def __call__(self) -> web.RequestHandler:
        return _Protocol(self, loop=self._event_loop, **self._protocol_kwargs)

    def connection_made(self, protocol, transport) -> None:
        super().connection_made(protocol, transport)
        self.open_connections += 1
        if self.open_connections > self.max_connections:
            self.refused_connections += 1
            transport.write(self._busy)
            transport.close()
        else:
            self._arm(protocol)

    def connection_lost(self, protocol, exc=None) -> None:
        self.open_connections -= 1
        self.request_started(protocol)
        super().connection_lost(protocol, exc)

    def request_started(self, protocol) -> None:
        """The headers of a request are in: no deadline while it is handled (the body has its own)."""
        deadline = self._deadlines.pop(protocol, None)
        if deadline is not None:
            deadline.cancel()

    def request_finished(self, protocol) -> None:
        """Its response is written (or being written): the next request's headers have read_timeout again."""
        if protocol.transport is not None:
            self._arm(protocol)

    def _arm(self, protocol) -> None:
        self.request_started(protocol)
        self._deadlines[protocol] = self._event_loop.call_later(self.read_timeout, self._expire, protocol)

    def _expire(self, protocol) -> None:
        if self._deadlines.pop(protocol, None) is not None:
            protocol.force_close()


async def _read_until(request: web.BaseRequest, limit: int) -> bytes:
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > limit:
            raise RequestError(413, f"the body has more than {limit} bytes; the limit is {limit}")
    return bytes(body)


async def read_body(request: web.BaseRequest, limits: ServerLimits) -> bytes:
    """The body of a request within ``max_request_bytes`` and ``read_timeout``, or RequestError."""
    limit = limits.max_request_bytes
    length = request.content_length
    if length is None and "chunked" not in request.headers.get("Transfer-Encoding", "").lower():
        raise RequestError(411, "a Content-Length header with the body size is required")
    if length is not None and length > limit:
        raise RequestError(413, f"the body has {length} bytes; the limit is {limit}")
    try:
        return await asyncio.wait_for(_read_until(request, limit), limits.read_timeout)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the body did not arrive within {limits.read_timeout} s") from None


class GenerationService:
    """The limits, the generator and its worker: what the endpoints share, independent of aiohttp."""

    def __init__(self, generator: Generator, limits: ServerLimits, model_name: str = "megatron", runner=None):
        self.generator = generator
        self.limits = limits.validate()
        self.model_name = model_name
        self.created = int(time.time())  # /v1/models reports it
        self.chat_template = ChatTemplate(generator.tokenizer)
        self.worker = GenerationWorker(generator, limits.max_pending_requests, limits.max_batch_size, runner)

    async def generate(self, raw: bytes) -> dict:
        prompts, params = parse_generate_request(raw, self.limits)
        prompt_ids = tokenize_prompts(self.generator, prompts, self.limits, params.max_new_tokens)
        completions = await self.worker.generate(prompts, params, prompt_ids)
        return {"completions": [c.to_json() for c in completions]}

    def health(self) -> dict:
        c = self.generator.config
        return {"status": "ok", "num_layers": c.num_layers, "hidden_size": c.hidden_size,
                "vocab_size": self.generator.vocab_size, "pending_requests": self.worker.pending,
                "tensor_model_parallel_size": group_size(self.generator.model.tp_group),
                "running_sequences": len(self.worker.decoder.rows), "torch_threads": torch.get_num_threads(),
                "limits": dataclasses.asdict(self.limits)}


@dataclasses.dataclass(frozen=True)
class _Path:
    methods: dict[str, Callable[[web.BaseRequest, bytes], Awaitable[web.StreamResponse]]]
    error: Callable[[RequestError], web.Response]  # the endpoint's error shape


class GenerationServer:
    """The HTTP server: ``await start()`` / ``await stop()`` on a running loop, or ``serve_forever()``."""

    def __init__(self, generator: Generator, limits: ServerLimits, host: str = "127.0.0.1", port: int = 8000,
                 verbose: bool = False, model_name: str = "megatron", runner=None):
        self.service = GenerationService(generator, limits, model_name, runner)
        self.limits = self.service.limits
        self.host, self.port, self.verbose = host, port, verbose
        self.connections: Optional[_Server] = None
        self._runner: Optional[web.ServerRunner] = None
        plain = self._plain_error
        self._paths = {"/generate": _Path({"POST": self._generate}, plain),
                       "/health": _Path({"GET": self._health}, plain),
                       "/v1/completions": _Path({"POST": self._completions}, openai_api.error_response),
                       "/v1/chat/completions": _Path({"POST": self._chat_completions}, openai_api.error_response),
                       "/v1/models": _Path({"GET": self._models}, openai_api.error_response),
                       f"/v1/models/{model_name}": _Path({"GET": self._model}, openai_api.error_response)}

    @staticmethod
    def _plain_error(error: RequestError) -> web.Response:
        return _json_response(error.status, _error_body(error.status, error.message),
                              close=error.status in (405, 408, 411, 413))

    async def start(self) -> None:
        self.connections = _Server(self._dispatch, max_connections=self.limits.max_connections,
                                   read_timeout=self.limits.read_timeout, keepalive_timeout=self.limits.read_timeout,
                                   lingering_time=self.limits.read_timeout,
                                   access_log=logging.getLogger("aiohttp.access") if self.verbose else None)
        self._runner = web.ServerRunner(self.connections)
        await self._runner.setup()
        backlog = min(self.limits.max_connections, _MAX_BACKLOG)
        sock = socket.create_server((self.host, self.port), backlog=backlog)
        await web.SockSite(self._runner, sock, backlog=backlog).start()
        self.host, self.port = sock.getsockname()[:2]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self.service.worker.close()

    def serve_forever(self, on_started: Callable[["GenerationServer"], None] = lambda server: None) -> None:
        """Serve until SIGINT or SIGTERM."""
        async def serve() -> None:
            stopped = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stopped.set)
            await self.start()
            on_started(self)
            try:
                await stopped.wait()
            finally:
                await self.stop()

        asyncio.run(serve())

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        self.connections.request_started(request.protocol)
        try:
            return await self._respond(request)
        finally:
            self.connections.request_finished(request.protocol)

    async def _respond(self, request: web.BaseRequest) -> web.StreamResponse:
        path = self._paths.get(request.path)
        if path is None:
            error = openai_api.error_response if request.path.startswith("/v1/") else self._plain_error
            return error(RequestError(404, f"unknown path {request.path!r:.200}; use POST /generate, POST "
                                           f"/v1/completions, POST /v1/chat/completions, GET /v1/models or GET "
                                           f"/health"))
        handler = path.methods.get(request.method)
        try:
            if handler is None:
                raise RequestError(405, f"method {request.method} is not supported for {request.path}; use "
                                        f"{' or '.join(path.methods)}")
            raw = await read_body(request, self.limits) if request.method == "POST" else b""
            return await handler(request, raw)
        except RequestError as error:
            return path.error(error)
        except Busy as error:
            return path.error(RequestError(503, str(error)))
        except ConnectionError:  # the client left while its body was read or its answer streamed
            logger.debug("client %s disconnected during %s %s", request.remote, request.method, request.path)
            return _json_response(400, _error_body(400, "the client disconnected"), close=True)  # never delivered
        except Exception as error:  # noqa: BLE001 - answer, log once, and keep serving
            logger.exception("generation failed for %s %s", request.method, request.path)
            return path.error(RequestError(500, f"internal error: {type(error).__name__}: {error}"))

    async def _generate(self, request: web.BaseRequest, raw: bytes) -> web.Response:
        return _json_response(200, await self.service.generate(raw))

    async def _health(self, request: web.BaseRequest, raw: bytes) -> web.Response:
        reply = self.service.health()
        reply["open_connections"] = self.connections.open_connections
        return _json_response(200, reply)

    async def _completions(self, request: web.BaseRequest, raw: bytes) -> web.StreamResponse:
        return await openai_api.completions(self.service, request, raw)

    async def _chat_completions(self, request: web.BaseRequest, raw: bytes) -> web.StreamResponse:
        return await openai_chat.chat_completions(self.service, request, raw)

    async def _models(self, request: web.BaseRequest, raw: bytes) -> web.Response:
        return _json_response(200, {"object": "list", "data": [openai_api.model_card(self.service)]})

    async def _model(self, request: web.BaseRequest, raw: bytes) -> web.Response:
        return _json_response(200, openai_api.model_card(self.service))


def make_server(generator: Generator, limits: ServerLimits, host: str = "127.0.0.1", port: int = 8000,
                verbose: bool = False, model_name: str = "megatron", runner=None) -> GenerationServer:
    """A GenerationServer for (host, port) (port 0: any free one, in ``.port`` once started). ``runner``: the
    model's side of the batch (default a ``BatchRunner`` of the generator's model; ``tp.BroadcastRunner``
    under tensor parallelism)."""
    return GenerationServer(generator, limits, host, port, verbose, model_name, runner)
