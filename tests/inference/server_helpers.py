"""A GenerationServer on an event loop of its own thread, and a blocking client, for the server tests."""

import asyncio
import http.client
import json
import threading

from megatron.inference.server import make_server


class RunningServer:
    """``make_server(...)`` started on a background event loop; ``close()`` stops it."""

    def __init__(self, generator, limits, **kwargs):
        self.server = make_server(generator, limits, "127.0.0.1", 0, **kwargs)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="server-loop", daemon=True)
        self.thread.start()
        self.call(self.server.start())
        self.port = self.server.port

    def call(self, coroutine, timeout: float = 60):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def request(port, method, path, body=None, raw=None, headers=None, timeout=60):
    """(status, decoded JSON reply) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers=headers or {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()
