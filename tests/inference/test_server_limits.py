"""The server's limits on 127.0.0.1 (issue 11): stalled clients, the connection and request caps, bodies
too large or too slow, a megabyte prompt, clients that leave, and generation kept off the event loop."""

import dataclasses
import json
import logging
import resource
import selectors
import socket
import threading
import time

import pytest

from megatron.inference import scheduler
from megatron.inference.batching import BatchRunner
from megatron.inference.generation import Generator
from megatron.inference.server import ServerLimits
from megatron.inference.validation import _PIECE_CHARS
from tests.helpers.checkpoint import write_random_checkpoint
from tests.helpers.server import RunningServer, hold_prefill, request

LIMITS = ServerLimits(max_prompt_tokens=20, max_new_tokens_limit=16, max_request_bytes=2048, max_prompts=4,
                      default_max_new_tokens=8, read_timeout=2.0)
GOOD = {"prompt": "The river", "max_new_tokens": 4, "greedy": True}


@pytest.fixture(scope="module")
def generator(tmp_path_factory, tiny_corpus):
    path = tmp_path_factory.mktemp("limits_ckpt")
    write_random_checkpoint(path, tiny_corpus)
    return Generator.from_checkpoint(str(path))


@pytest.fixture
def serve(generator):
    """serve(**limit overrides) -> a RunningServer, closed after the test."""
    started = []

    def start(**overrides):
        started.append(RunningServer(generator, dataclasses.replace(LIMITS, **overrides)))
        return started[-1]

    yield start
    for running in started:
        running.close()


def _threads() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def _timed(port, *args, **kwargs):
    start = time.perf_counter()
    status, reply = request(port, *args, **kwargs)
    return status, reply, time.perf_counter() - start


def _raw_exchange(port, data: bytes, timeout: float = 30) -> tuple[bytes, float, float]:
    """Send ``data`` on a fresh connection, read until the server closes it: (everything read, seconds to
    the first byte read, seconds to the close)."""
    start = time.perf_counter()
    first = None
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                first = first or time.perf_counter() - start
                received += chunk
        except ConnectionResetError:
            pass
    return received, first, time.perf_counter() - start


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def _json_of(reply: bytes) -> dict:
    return json.loads(reply.split(b"\r\n\r\n", 1)[1])


@pytest.mark.timeout(60)
def test_a_thousand_stalled_clients_do_not_delay_others_and_are_dropped_after_the_read_timeout(serve):
    num_stalled = 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * num_stalled + 200  # both ends of every connection live in this process
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"the load test needs {needed} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    # A read timeout well above the time to open them all (0.3 s here, seconds on a loaded machine): every
    # stalled connection is still held when /health counts them.
    read_timeout = 5.0
    running = serve(max_connections=num_stalled + 16, read_timeout=read_timeout)
    threads_before = _threads()
    stalled, start = [], time.perf_counter()
    try:
        for _ in range(num_stalled):
            sock = socket.create_connection(("127.0.0.1", running.port), timeout=10)
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Le")  # half the headers, then nothing
            stalled.append(sock)
        connected = time.perf_counter() - start
        health = [_timed(running.port, "GET", "/health") for _ in range(3)]
        generated = [_timed(running.port, "POST", "/generate", GOOD) for _ in range(3)]
        threads_during = _threads()
        served = time.perf_counter() - start
        assert all(status == 200 for status, _, _ in health + generated), (health, generated)
        assert health[0][1]["open_connections"] == num_stalled + 1  # every stalled one held, and this one
        slowest = max(seconds for _, _, seconds in health + generated)
        assert slowest < 1.0, (slowest, health, generated)
        assert threads_during < 50 and threads_during - threads_before <= 2, (threads_before, threads_during)

        # After the read timeout, the server closes every stalled connection (EOF on our side).
        selector = selectors.DefaultSelector()
        for sock in stalled:
            selector.register(sock, selectors.EVENT_READ)
        closed, deadline = 0, start + read_timeout + 20
        while closed < num_stalled and time.perf_counter() < deadline:
            for key, _ in selector.select(timeout=1):
                try:
                    assert key.fileobj.recv(1024) == b""  # nothing sent: no request was ever complete
                except ConnectionResetError:
                    pass
                selector.unregister(key.fileobj)
                closed += 1
        dropped = time.perf_counter() - start
        assert closed == num_stalled, f"{closed} of {num_stalled} stalled connections closed in {dropped:.1f} s"
        assert dropped >= read_timeout  # not before their time
        assert request(running.port, "GET", "/health")[1]["open_connections"] == 1
    finally:
        for sock in stalled:
            sock.close()
    print(f"\n1000 stalled: connected in {connected:.2f} s, 3 /health + 3 /generate served by {served:.2f} s "
          f"(slowest {slowest * 1000:.0f} ms), threads {threads_before} -> {threads_during}, all dropped "
          f"{dropped:.2f} s after the first connect (read timeout {read_timeout} s)")


def test_a_stalled_body_is_answered_408_after_the_read_timeout(serve):
    running = serve()
    timeout = LIMITS.read_timeout
    reply, answered, closed = _raw_exchange(running.port, b"POST /generate HTTP/1.1\r\nHost: x\r\n"
                                                          b"Content-Length: 100\r\n\r\n" b'{"prompt": ')
    assert _status(reply) == 408 and "did not arrive within 2.0 s" in _json_of(reply)["error"]
    assert timeout <= answered < timeout + 1, answered
    assert closed < 2 * timeout + 1, closed  # after aiohttp's lingering close (read_timeout) at most
    # Headers that never finish get no answer at all: the connection is closed after the read timeout.
    reply, _, closed = _raw_exchange(running.port, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    assert reply == b"" and timeout <= closed < timeout + 1, (reply, closed)
    # Nor do headers trickled a line every 0.2 s (a slowloris): the deadline is not moved by each byte.
    with socket.create_connection(("127.0.0.1", running.port), timeout=10) as sock:
        start = time.perf_counter()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        selector = selectors.DefaultSelector()
        selector.register(sock, selectors.EVENT_READ)
        try:
            while not selector.select(timeout=0.2):  # nothing from the server yet: one more header line
                sock.sendall(b"X-Slow: y\r\n")
                assert time.perf_counter() - start < 3 * timeout
            assert sock.recv(100) == b""
        except (ConnectionResetError, BrokenPipeError):  # closed while a line was on its way: closed all the same
            pass
        closed = time.perf_counter() - start
    assert timeout <= closed < timeout + 1, closed


def test_connections_over_the_cap_are_answered_503_and_closed_at_once(serve):
    running = serve(max_connections=8)
    held = [socket.create_connection(("127.0.0.1", running.port), timeout=10) for _ in range(8)]
    try:
        assert request(running.port, "GET", "/health")[0] == 503
        reply, _, closed = _raw_exchange(running.port, b"")
        assert _status(reply) == 503 and "8 connections are open" in _json_of(reply)["error"], reply
        assert closed < 1.0
        assert running.server.connections.refused_connections == 2
    finally:
        for sock in held:
            sock.close()
    status, reply = request(running.port, "POST", "/generate", GOOD)  # the slots are free again
    assert status == 200 and len(reply["completions"][0]["token_ids"]) == 4


def test_oversized_bodies_get_413_before_they_are_read(serve):
    running = serve()
    # A Content-Length of 1 GB and no body at all: the answer cannot have waited for it.
    with socket.create_connection(("127.0.0.1", running.port), timeout=10) as sock:
        start = time.perf_counter()
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        reply = sock.recv(65536)
        seconds = time.perf_counter() - start
    assert _status(reply) == 413 and "the limit is 2048" in _json_of(reply)["error"] and seconds < 1.0
    # A chunked body is read up to the limit only: the 413 comes while the client still holds its last chunk.
    chunk = b"x" * 1000
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", running.port), timeout=10) as sock:
        sock.sendall(head + b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)))
        reply = sock.recv(65536)
    assert _status(reply) == 413 and "more than 2048 bytes" in _json_of(reply)["error"]
    # A chunked body within the limit is served.
    body = json.dumps(GOOD).encode()
    head = head.replace(b"Host: x", b"Host: x\r\nConnection: close")
    reply, _, _ = _raw_exchange(running.port, head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    assert _status(reply) == 200 and len(_json_of(reply)["completions"][0]["token_ids"]) == 4


def test_a_megabyte_prompt_is_refused_without_tokenizing_it_all(serve, generator, monkeypatch):
    running = serve(max_request_bytes=2 << 20, max_prompt_tokens=200)
    tokenized = []
    tokenize = generator.tokenizer.tokenize
    monkeypatch.setattr(generator.tokenizer, "tokenize", lambda text: tokenized.append(len(text)) or tokenize(text))
    prompt = "The river runs past the model data. " * 28_000  # 1,008,000 characters
    status, reply, seconds = _timed(running.port, "POST", "/generate", {"prompt": prompt})
    assert status == 413 and "the limit is 200" in reply["error"], reply
    assert sum(tokenized) <= 3 * _PIECE_CHARS, tokenized  # a few pieces, not the megabyte
    start = time.perf_counter()
    num_tokens = len(tokenize(prompt))
    whole = time.perf_counter() - start
    assert num_tokens > 200 and seconds < 1.0
    print(f"\n1 MB prompt: 413 in {seconds * 1000:.0f} ms ({sum(tokenized)} characters tokenized); "
          f"tokenizing it whole takes {whole * 1000:.0f} ms ({num_tokens} tokens)")


def test_generation_runs_off_the_event_loop_and_the_queue_is_bounded(serve, generator, monkeypatch):
    running = serve(max_pending_requests=2)
    release, entered = hold_prefill(monkeypatch)
    results = []
    clients = [threading.Thread(target=lambda: results.append(request(running.port, "POST", "/generate", GOOD)))
               for _ in range(2)]
    try:
        clients[0].start()
        assert entered.wait(30)
        clients[1].start()
        # Generation is held inside the worker: the loop still answers, and counts both requests.
        deadline = time.perf_counter() + 10
        while request(running.port, "GET", "/health")[1]["pending_requests"] < 2:
            assert time.perf_counter() < deadline
        status, health, seconds = _timed(running.port, "GET", "/health")
        assert status == 200 and seconds < 1.0
        status, reply = request(running.port, "POST", "/generate", GOOD)
        assert status == 503 and "2 requests are waiting" in reply["error"]
    finally:
        release.set()
        for client in clients:
            client.join(60)
    assert [status for status, _ in results] == [200, 200]
    assert results[0][1] == results[1][1]


def test_clients_that_leave_early_leave_no_traceback(serve, generator, caplog):
    caplog.set_level(logging.DEBUG)
    running = serve()
    port = running.port
    body = json.dumps(GOOD).encode()
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    stream = json.dumps({"model": "m", "prompt": "The river", "max_tokens": 16, "stream": True}).encode()
    for data in (head + body[:5],                                   # half the body, then gone
                 head + body,                                       # the whole request, gone before the answer
                 b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",  # malformed HTTP
                 b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" * 8,          # TLS sent to a plain HTTP port
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(stream), stream)):                         # gone mid-stream
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(data)
            if data.startswith(b"POST /v1"):
                assert sock.recv(100).startswith(b"HTTP/1.1 200")
    reply, _, _ = _raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
    assert _status(reply) == 400 and _json_of(reply)["status"] == 400  # malformed HTTP: the same JSON errors
    status, reply = request(port, "POST", "/generate", GOOD)
    assert status == 200
    deadline = time.perf_counter() + 10
    while request(port, "GET", "/health")[1]["pending_requests"]:  # the abandoned requests end too
        assert time.perf_counter() < deadline
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert noisy == [], [(r.name, r.getMessage()) for r in noisy]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
def test_a_request_whose_client_leaves_stops_its_generation(serve, generator, monkeypatch, stream):
    running = serve()
    generating, gone, steps, pushed = threading.Event(), threading.Event(), [], []
    decode, push = BatchRunner.decode, scheduler._Job.push

    def watched_decode(runner, tokens):
        steps.append(len(tokens))
        # Two steps done and (streamed) text out: let the client go, and wait until the server knows.
        if not generating.is_set() and len(steps) > 2 and (not stream or pushed):
            generating.set()
            assert gone.wait(30)
            deadline = time.perf_counter() + 10
            while running.server.connections.open_connections:
                assert time.perf_counter() < deadline
        return decode(runner, tokens)

    def watched_push(job, event):
        pushed.append(event)
        push(job, event)

    monkeypatch.setattr(BatchRunner, "decode", watched_decode)
    monkeypatch.setattr(scheduler._Job, "push", watched_push)
    body = json.dumps({"model": "m", "prompt": "The river", "max_tokens": 16, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", running.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert generating.wait(30)
        if stream:
            assert sock.recv(100).startswith(b"HTTP/1.1 200")
    gone.set()
    deadline = time.perf_counter() + 10
    while request(running.port, "GET", "/health")[1]["pending_requests"] or running.server.service.worker.decoder.rows:
        assert time.perf_counter() < deadline  # the request is gone, and its sequence has left the batch
    # 16 tokens would take the prompt's pass and 15 steps; the sequence left the batch a step or two later
    assert len(steps) < 10 and not any(isinstance(event, scheduler.Finished) for event in pushed), (steps, pushed)
