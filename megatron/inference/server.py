"""A small HTTP text-generation server on the standard library (no extra dependencies).

    POST /generate  {"prompt": str | [str, ...], "max_new_tokens": int, "greedy": bool, "temperature": float,
                     "top_k": int, "top_p": float, "seed": int}
                    -> 200 {"completions": [{"prompt", "token_ids", "text", "finish_reason", ...}, ...]}
    GET  /health    -> 200 {"status": "ok", ...}

Errors are JSON {"error": message, "status": code} with 400 (malformed JSON, wrong types, invalid
values, an empty prompt), 411 (no Content-Length), 413 (a body over ``max_request_bytes``, a prompt
over ``max_prompt_tokens``, more new tokens than ``max_new_tokens_limit``, too many prompts), 404
(unknown path), 405 (wrong method), or 500 (a failure inside generation; logged). Generation
runs under one lock (the model and its caches are not shared between requests); the server keeps
serving after any bad request. It binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from megatron.inference.generation import Generator, SamplingParams

__all__ = ["ServerLimits", "RequestError", "parse_generate_request", "GenerationService", "make_server"]

_DRAIN_LIMIT = 16 << 20  # bytes of an oversized body read and dropped before the 413
_FIELDS = {"prompt", "max_new_tokens", "greedy", "temperature", "top_k", "top_p", "seed"}


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_prompt_tokens: int = 1024       # tokens of one prompt
    max_new_tokens_limit: int = 256     # the largest max_new_tokens a request may ask for
    max_request_bytes: int = 1 << 20    # size of a request body
    max_prompts: int = 16               # prompts in one request
    default_max_new_tokens: int = 32

    def validate(self) -> "ServerLimits":
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{field.name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(f"default max_new_tokens {self.default_max_new_tokens} exceeds --max-new-tokens-limit "
                             f"{self.max_new_tokens_limit}")
        return self


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _typed(body: dict, name: str, kinds: tuple, default: Any) -> Any:
    if name not in body or (body[name] is None and default is None):
        return default
    value = body[name]
    # bool is an int in python: refuse True where a number is meant, and numbers where a bool is.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise RequestError(400, f"'{name}' must be {names}, got {type(value).__name__} {value!r}")
    return value


def parse_generate_request(raw: bytes, limits: ServerLimits) -> tuple[list[str], SamplingParams]:
    """(prompts, sampling parameters) of a /generate body, or RequestError."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise RequestError(400, f"unknown fields {unknown}; known: {sorted(_FIELDS)}")
    if "prompt" not in body:
        raise RequestError(400, "'prompt' is required (a string or a list of strings)")
    prompt = body["prompt"]
    prompts = prompt if isinstance(prompt, list) else [prompt]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError(400, "'prompt' must be a string or a non-empty list of strings")
    if len(prompts) > limits.max_prompts:
        raise RequestError(413, f"{len(prompts)} prompts in one request; the limit is {limits.max_prompts}")
    max_new = _typed(body, "max_new_tokens", (int,), limits.default_max_new_tokens)
    if max_new > limits.max_new_tokens_limit:
        raise RequestError(413, f"max_new_tokens {max_new} exceeds this server's limit {limits.max_new_tokens_limit}")
    params = SamplingParams(max_new_tokens=max_new, greedy=_typed(body, "greedy", (bool,), False),
                            temperature=_typed(body, "temperature", (int, float), 1.0),
                            top_k=_typed(body, "top_k", (int,), 0), top_p=_typed(body, "top_p", (int, float), 1.0),
                            seed=_typed(body, "seed", (int,), None))
    try:
        params.validate()
    except ValueError as error:
        raise RequestError(400, str(error)) from None
    return prompts, params


class GenerationService:
    """Validation, tokenization limits and the generation lock, independent of HTTP."""

    def __init__(self, generator: Generator, limits: ServerLimits):
        self.generator = generator
        self.limits = limits.validate()
        self.lock = threading.Lock()

    def generate(self, raw: bytes) -> dict:
        prompts, params = parse_generate_request(raw, self.limits)
        for prompt in prompts:
            n = len(self.generator.tokenizer.tokenize(prompt))
            if n > self.limits.max_prompt_tokens:
                raise RequestError(413, f"a prompt has {n} tokens; the limit is {self.limits.max_prompt_tokens}")
            try:
                self.generator.check_length(n, params.max_new_tokens)
            except ValueError as error:
                raise RequestError(400, str(error)) from None
        with self.lock:
            completions = self.generator.generate(prompts, params)
        return {"completions": [c.to_json() for c in completions]}

    def health(self) -> dict:
        c = self.generator.config
        return {"status": "ok", "num_layers": c.num_layers, "hidden_size": c.hidden_size,
                "vocab_size": self.generator.vocab_size, "limits": dataclasses.asdict(self.limits)}


class _Handler(BaseHTTPRequestHandler):
    service: GenerationService  # set on the subclass make_server creates
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)

    def log_error(self, format: str, *args) -> None:  # noqa: A002
        super().log_message(format, *args)  # errors are always logged (stderr)

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, close: bool = False) -> None:
        if close:
            self.close_connection = True
        self._reply(status, {"error": message, "status": status})

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            self._reply(200, self.service.health())
        elif self.path == "/generate":
            self._error(405, "use POST for /generate")
        else:
            self._error(404, f"unknown path {self.path!r}; use POST /generate or GET /health")

    def do_POST(self) -> None:  # noqa: N802
        raw = self._read_body()  # read first: answering before the body arrives can reset the connection
        if raw is None:
            return
        if self.path == "/health":
            return self._error(405, "use GET for /health")
        if self.path != "/generate":
            return self._error(404, f"unknown path {self.path!r}; use POST /generate or GET /health")
        try:
            self._reply(200, self.service.generate(raw))
        except RequestError as error:
            self._error(error.status, error.message)
        except Exception as error:  # noqa: BLE001 - answer, log, and keep serving
            self.log_error("generation failed: %r", error)
            self._error(500, f"internal error: {type(error).__name__}: {error}")

    def _read_body(self) -> Optional[bytes]:
        length = self.headers.get("Content-Length")
        try:
            length = int(length)
        except (TypeError, ValueError):
            self._error(411, "a Content-Length header with the body size is required", close=True)
            return None
        limit = self.service.limits.max_request_bytes
        if length < 0:
            self._error(400, f"Content-Length {length} is negative", close=True)
            return None
        if length > limit:
            # Read (and drop) a moderately oversized body before answering: closing a socket with
            # unread data makes the kernel reset the connection, and the client would never see the
            # 413. Beyond _DRAIN_LIMIT, answer and close without reading it.
            if 0 < length <= _DRAIN_LIMIT:
                while length > 0:
                    chunk = self.rfile.read(min(length, 1 << 16))
                    if not chunk:  # the client stopped sending
                        break
                    length -= len(chunk)
            self._error(413, f"the body has {self.headers.get('Content-Length')} bytes; the limit is {limit}",
                        close=True)
            return None
        return self.rfile.read(length)

    def _unsupported(self) -> None:
        self._error(405, f"method {self.command} is not supported; use POST /generate or GET /health", close=True)

    do_PUT = do_DELETE = do_PATCH = _unsupported


def make_server(generator: Generator, limits: ServerLimits, host: str = "127.0.0.1", port: int = 8000,
                verbose: bool = False) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer bound to (host, port) (port 0: any free one); call ``serve_forever()``."""
    handler = type("GenerationHandler", (_Handler,), {"service": GenerationService(generator, limits)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    server.verbose = verbose
    return server
