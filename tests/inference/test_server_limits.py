"""The server's limits on 127.0.0.1 (issue 11): stalled clients, the connection and request caps, bodies
too large or too slow, a megabyte prompt, clients that leave, and generation kept off the event loop.

No bound in seconds from above: how fast a machine answers is not what these limits are about. What must
come at once or at the read timeout is shown by the order of events (answered while every stalled client is
still held, while generation is held, closed before a connection opened later that the same timeout closes);
"not delayed" by a ratio to the same requests timed on the same server before the load; a timeout by a lower
bound (not before its time). Waits for an event have no deadline of their own: pytest's timeout ends a hang.
"""

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


def _until(condition) -> None:
    """Wait for ``condition()``: polled, with no deadline of its own (pytest's timeout ends a hang)."""
    while not condition():
        time.sleep(0.01)


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def _json_of(reply: bytes) -> dict:
    return json.loads(reply.split(b"\r\n\r\n", 1)[1])


# "Do not delay": the load test's requests, each timed right after the same request to a twin server that has
# no stalled clients (so that both see the same load of the machine), take at most this ratio of the twin's time
# in all. A blocking server would add the read timeout (5 s, over 20 x the twin's time even on a loaded
# machine); measured: 0.5 to 1.3 x on a 2-core machine under a full test run (load 6 to 18).
NOT_DELAYED_RATIO = 10
_SIX_REQUESTS = [("GET", "/health")] * 3 + [("POST", "/generate", GOOD)] * 3


def _six_requests(port, twin_port) -> list[tuple[tuple, tuple]]:
    """3 /health and 3 /generate, each first to ``twin_port`` and then to ``port``: ((status, reply, seconds)
    of the twin's, of the server's) for each."""
    return [(_timed(twin_port, *args), _timed(port, *args)) for args in _SIX_REQUESTS]


def _hold_stalled(serve, num_stalled: int, read_timeout: float):
    """Open ``num_stalled`` stalled connections to a server with ``read_timeout``, then serve the six requests
    to it and to a twin server. Returns what was seen and the stalled sockets; ``held`` is False where it all
    took longer than the read timeout, so that the server may already have dropped stalled ones."""
    running, twin = (serve(max_connections=num_stalled + 16, read_timeout=read_timeout) for _ in range(2))
    _six_requests(running.port, twin.port)  # both warm
    seen = dict(running=running, threads_before=_threads(), stalled=[], start=time.perf_counter())
    try:
        for _ in range(num_stalled):
            sock = socket.create_connection(("127.0.0.1", running.port), timeout=10)
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Le")  # half the headers, then nothing
            seen["stalled"].append(sock)
        seen["connected"] = time.perf_counter() - seen["start"]
        # Accepted in order: this request's connection comes after every stalled one, which it finds held.
        seen["open_before"] = request(running.port, "GET", "/health")[1]["open_connections"]
        seen["timed"] = _six_requests(running.port, twin.port)
        seen["threads_during"] = _threads()
        seen["served"] = time.perf_counter() - seen["start"]
        # Served while every stalled connection is still held (none has been closed: none is readable).
        seen["selector"] = selectors.DefaultSelector()
        for sock in seen["stalled"]:
            seen["selector"].register(sock, selectors.EVENT_READ)
        seen["dropped_early"] = len(seen["selector"].select(timeout=0))
        seen["open_after"] = request(running.port, "GET", "/health")[1]["open_connections"]
        seen["held"] = time.perf_counter() - seen["start"] < read_timeout  # none can have timed out yet
    except BaseException:
        for sock in seen["stalled"]:
            sock.close()
        raise
    return seen


@pytest.mark.timeout(240)
def test_a_thousand_stalled_clients_do_not_delay_others_and_are_dropped_after_the_read_timeout(serve):
    num_stalled = 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * num_stalled + 200  # both ends of every connection live in this process
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"the load test needs {needed} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    # The read timeout must be longer than opening them all and serving the requests takes (0.3 s here): until
    # then every stalled connection is held. Where the machine is slower than that (over 5 s, seen under a full
    # test run on 2 cores), the whole load runs again with a 4 x longer timeout: the assertions below hold the
    # server to what it must do while every stalled connection is held, not to how fast the machine is.
    for read_timeout in (5.0, 20.0, 80.0):
        seen = _hold_stalled(serve, num_stalled, read_timeout)
        if seen["held"]:
            break
        for sock in seen["stalled"]:
            sock.close()
    else:
        pytest.fail(f"opening {num_stalled} connections and serving 6 requests took over {read_timeout} s")
    running, stalled, start, timed = seen["running"], seen["stalled"], seen["start"], seen["timed"]
    selector = seen["selector"]
    try:
        assert seen["open_before"] == seen["open_after"] == num_stalled + 1, (seen["open_before"], seen["open_after"])
        assert all(status == 200 for pair in timed for status, _, _ in pair), timed
        # No request waited for a stalled connection to be dropped ...
        assert seen["dropped_early"] == 0, "stalled connections were dropped before the requests were served"
        # ... nor took much longer than without them.
        before, during = (sum(pair[i][2] for pair in timed) for i in (0, 1))  # the twin's, the server's
        assert during <= NOT_DELAYED_RATIO * before, (during, before, timed)
        threads_before, threads_during = seen["threads_before"], seen["threads_during"]
        assert threads_during < 50 and threads_during - threads_before <= 2, (threads_before, threads_during)

        # By the read timeout, the server closes every stalled connection (EOF on our side): each one before a
        # connection opened after them all, whose incomplete headers the same timeout closes (its deadline is
        # the latest), and none before its time.
        late = socket.create_connection(("127.0.0.1", running.port), timeout=10)
        late.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        selector.register(late, selectors.EVENT_READ)
        closed, first_dropped, late_closed = 0, None, False

        def take(ready) -> bool:  # whether the late one is among them
            nonlocal closed, first_dropped
            for key, _ in ready:
                try:
                    assert key.fileobj.recv(1024) == b""  # nothing sent: no request was ever complete
                except ConnectionResetError:
                    pass
                selector.unregister(key.fileobj)
                if key.fileobj is not late:
                    closed += 1
                    first_dropped = first_dropped or time.perf_counter() - start
            return any(key.fileobj is late for key, _ in ready)

        while not late_closed:
            late_closed = take(selector.select())
        take(selector.select(timeout=0))  # what was closed before the late one is readable with it
        dropped = time.perf_counter() - start
        late.close()
        assert closed == num_stalled, f"{closed} of {num_stalled} stalled connections closed before a later one"
        assert first_dropped >= read_timeout  # not before their time
        assert request(running.port, "GET", "/health")[1]["open_connections"] == 1
    finally:
        for sock in stalled:
            sock.close()
    print(f"\n1000 stalled: connected in {seen['connected']:.2f} s, 3 /health + 3 /generate served by "
          f"{seen['served']:.2f} s "
          f"in {during * 1000:.0f} ms ({during / before:.2f} x the twin's {before * 1000:.0f} ms), "
          f"threads {threads_before} -> {threads_during}, dropped {first_dropped:.2f} to {dropped:.2f} s after the "
          f"first connect (read timeout {read_timeout} s)")


@pytest.mark.timeout(60)
def test_a_stalled_body_is_answered_408_after_the_read_timeout(serve):
    """Three stalled clients: a body that stops (408 at the read timeout, then closed after the lingering
    close, at most another), headers that stop (closed at the read timeout, no answer) and headers trickled
    a line every 0.2 s (a slowloris: the deadline is not moved by each byte). Each not before its time, and
    each before a connection opened half a read timeout later whose incomplete headers the same timeout
    closes; the lingering close before one opened half a read timeout after the 408."""
    running = serve()
    timeout = LIMITS.read_timeout
    selector = selectors.DefaultSelector()
    conns, order = {}, []  # name -> its socket, times and what it read; the events in the order seen

    def connect(name, data):
        sock = socket.create_connection(("127.0.0.1", running.port), timeout=10)
        conns[name] = dict(sock=sock, opened=time.perf_counter(), received=b"", answered=None, closed=None)
        sock.sendall(data)
        selector.register(sock, selectors.EVENT_READ, name)

    def closed(name):
        conn = conns[name]
        conn["closed"] = time.perf_counter() - conn["opened"]
        order.append(f"{name} closed")
        selector.unregister(conn["sock"])
        conn["sock"].close()

    connect("body", b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" b'{"prompt": ')
    connect("headers", b"GET /health HTTP/1.1\r\nHost: x\r\n")
    connect("slowloris", b"GET /health HTTP/1.1\r\n")
    last_line, lines = time.perf_counter(), 0
    try:
        while len(conns) < 5 or any(conn["closed"] is None for conn in conns.values()):
            now = time.perf_counter()
            if "late" not in conns and now >= conns["body"]["opened"] + timeout / 2:
                connect("late", b"GET /health HTTP/1.1\r\nHost: x\r\n")
            answered = conns["body"]["answered"]
            if answered is None and conns.get("late", {}).get("closed") is not None:
                break  # the late one closed and no 408 yet: the assertions below say so
            if "after 408" not in conns and answered is not None and \
                    now >= conns["body"]["opened"] + answered + timeout / 2:
                connect("after 408", b"GET /health HTTP/1.1\r\nHost: x\r\n")
            if conns["slowloris"]["closed"] is None and now - last_line >= 0.2:  # one more header line
                try:
                    conns["slowloris"]["sock"].sendall(b"X-Slow: y\r\n")
                    last_line, lines = now, lines + 1
                except (ConnectionResetError, BrokenPipeError):  # closed while a line was on its way
                    closed("slowloris")
            for key, _ in selector.select(timeout=0.05):
                conn = conns[key.data]
                try:
                    chunk = key.fileobj.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    if conn["answered"] is None:
                        conn["answered"] = time.perf_counter() - conn["opened"]
                        order.append(f"{key.data} answered")
                    conn["received"] += chunk
                elif conn["closed"] is None:
                    closed(key.data)
    finally:
        for conn in conns.values():
            conn["sock"].close()
    body = conns["body"]
    assert _status(body["received"]) == 408 and "did not arrive within 2.0 s" in _json_of(body["received"])["error"]
    assert body["answered"] >= timeout, body  # not before its time
    assert order.index("body answered") < order.index("late closed"), order
    assert order.index("body closed") < order.index("after 408 closed"), order  # the lingering close at most
    for name in ("headers", "slowloris"):  # no answer at all: closed by the read timeout
        assert conns[name]["received"] == b"" and conns[name]["closed"] >= timeout, (name, conns[name])
        assert order.index(f"{name} closed") < order.index("late closed"), (name, order)
    for name in ("late", "after 408"):  # the references: closed by the read timeout too
        assert conns[name]["received"] == b"" and conns[name]["closed"] >= timeout, (name, conns[name])
    assert lines >= 2, lines  # the slowloris did trickle
    print("\n" + ", ".join(f"{name}: answered {c['answered'] or 0:.2f} s, closed {c['closed']:.2f} s"
                           for name, c in conns.items()) + f"; {lines} lines trickled; {order}")


def test_connections_over_the_cap_are_answered_503_and_closed_at_once(serve):
    # "At once": closed before the read timeout closes anything, which would close the held ones first (they
    # were opened first). A read timeout longer than _raw_exchange's wait, so that a refused connection left
    # to it fails there, and the held ones stay while the test runs however slow the machine.
    read_timeout = 40.0
    running = serve(max_connections=8, read_timeout=read_timeout)
    held = [socket.create_connection(("127.0.0.1", running.port), timeout=10) for _ in range(8)]
    try:
        assert request(running.port, "GET", "/health")[0] == 503
        reply, _, closed = _raw_exchange(running.port, b"", timeout=read_timeout / 2)
        assert _status(reply) == 503 and "8 connections are open" in _json_of(reply)["error"], reply
        selector = selectors.DefaultSelector()
        for sock in held:
            selector.register(sock, selectors.EVENT_READ)
        assert selector.select(timeout=0) == [], "a held connection was closed before the refused one"
        assert running.server.connections.refused_connections == 2
    finally:
        for sock in held:
            sock.close()
    status, reply = request(running.port, "POST", "/generate", GOOD)  # the slots are free again
    assert status == 200 and len(reply["completions"][0]["token_ids"]) == 4


def test_oversized_bodies_get_413_before_they_are_read(serve):
    running = serve()
    # A Content-Length of 1 GB and no body at all: the answer cannot have waited for it (waiting, it would have
    # been a 408 at the read timeout).
    with socket.create_connection(("127.0.0.1", running.port), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        reply = sock.recv(65536)
    assert _status(reply) == 413 and "the limit is 2048" in _json_of(reply)["error"]
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
    assert sum(tokenized) <= 3 * _PIECE_CHARS, tokenized  # a few pieces, not the megabyte (counted, not timed)
    start = time.perf_counter()
    num_tokens = len(tokenize(prompt))
    whole = time.perf_counter() - start
    assert num_tokens > 200
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
        # Generation is held inside the worker (until release): the loop still answers, and counts both requests.
        _until(lambda: request(running.port, "GET", "/health")[1]["pending_requests"] >= 2)
        status, health = request(running.port, "GET", "/health")
        assert status == 200 and not release.is_set()
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
    _until(lambda: not request(port, "GET", "/health")[1]["pending_requests"])  # the abandoned requests end too
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
            assert gone.wait(60)
            _until(lambda: not running.server.connections.open_connections)
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
    # the request is gone, and its sequence has left the batch
    _until(lambda: not (request(running.port, "GET", "/health")[1]["pending_requests"]
                        or running.server.service.worker.decoder.rows))
    # 16 tokens would take the prompt's pass and 15 steps; the sequence left the batch a step or two later
    assert len(steps) < 10 and not any(isinstance(event, scheduler.Finished) for event in pushed), (steps, pushed)
