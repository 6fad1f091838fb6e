"""A GenerationServer on an event loop of its own thread, and a blocking client, for the server tests."""

import asyncio
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading

from megatron.inference.batching import BatchRunner
from megatron.inference.server import make_server
from tests.helpers.paths import REPO_ROOT


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


@contextlib.contextmanager
def serve_tool(checkpoint, *args, launcher=(), env=None):
    """tools/serve.py --load checkpoint --port 0 *args as a process (``launcher``: e.g. torchrun's module and
    flags before the script, whose processes then get the SIGTERM): yields (port, process); SIGTERM at the
    end, which must stop it cleanly (exit status 0, nothing on stderr)."""
    # PYTHONPATH: this checkout's megatron, whichever checkout the environment was installed from
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO_ROOT), **(env or {}))
    proc = subprocess.Popen([sys.executable, *launcher, str(REPO_ROOT / "tools" / "serve.py"), "--load",
                             str(checkpoint), "--port", "0", *args], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        yield int(line.split(":")[2].split(" ")[0]), proc
    finally:
        if launcher:  # torchrun itself fails on SIGTERM; the servers it started stop cleanly
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                for child in f.read().split():
                    os.kill(int(child), signal.SIGTERM)
        else:
            proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and stderr == "", (proc.returncode, stderr[-2000:])


def hold_prefill(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make the server's batch runner wait before each prefill: ``entered`` is set when one is held, and
    ``release`` lets every held and later prefill run (each waits at most 30 s)."""
    release, entered = threading.Event(), threading.Event()
    prefill = BatchRunner.prefill

    def held_prefill(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(BatchRunner, "prefill", held_prefill)
    return release, entered
