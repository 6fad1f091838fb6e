"""The queue of generation requests and the one thread that runs them, apart from the event loop.

The HTTP server's event loop never runs the model: it hands a request to ``GenerationWorker`` and
awaits it, so it keeps accepting connections and answering /health while a generation runs. The
worker owns the requests waiting (at most ``max_pending``, running one included; one more is
``Busy``) and serves them oldest first on one thread, one request at a time (the model and its KV
caches are not shared). A batching scheduler takes this class's place with the same three calls:
``generate``, ``stream`` and ``close``.

Text reaches the loop through ``loop.call_soon_threadsafe``, in order. A request whose client has
gone (its task cancelled) is marked cancelled: dropped if still waiting, stopped at its next token
if running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
from typing import AsyncIterator, Optional, Sequence, Union

from megatron.inference.generation import Completion, Generator, SamplingParams

__all__ = ["Busy", "TextPiece", "Finished", "GenerationWorker"]

logger = logging.getLogger(__name__)


class Busy(Exception):
    """More requests than ``max_pending`` would be waiting."""


class _Cancelled(Exception):
    """Raised inside the worker thread to end the generation of a request nobody waits for."""


@dataclasses.dataclass(frozen=True)
class TextPiece:
    index: int     # which prompt of the request
    text: str


@dataclasses.dataclass(frozen=True)
class Finished:
    completions: list[Completion]


_Event = Union[TextPiece, Finished, BaseException]


class _Job:
    def __init__(self, prompts, params, prompt_ids, stream: bool, loop: asyncio.AbstractEventLoop):
        self.prompts, self.params, self.prompt_ids, self.stream = prompts, params, prompt_ids, stream
        self.events: asyncio.Queue[_Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self._loop = loop

    def push(self, event: _Event) -> None:
        """From the worker thread: hand ``event`` to the loop (a closed loop: nobody is listening)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.cancelled.set()

    def on_text(self, index: int, text: str) -> None:
        """From the worker thread, as text is generated: passed on when streaming; ends a cancelled job."""
        if self.cancelled.is_set():
            raise _Cancelled
        if self.stream:
            self.push(TextPiece(index, text))


class GenerationWorker:
    """Runs ``generator.generate`` for one request at a time on its own thread, oldest request first."""

    def __init__(self, generator: Generator, max_pending: int):
        self.generator = generator
        self.max_pending = max_pending
        self.pending = 0  # requests submitted and not yet answered; read and written on the loop only
        self._jobs: queue.SimpleQueue[Optional[_Job]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="generation-worker", daemon=True)
        self._thread.start()

    async def generate(self, prompts: Sequence[str], params: SamplingParams,
                       prompt_ids: Optional[Sequence[Sequence[int]]] = None) -> list[Completion]:
        """The completions of one request (Busy when too many wait; the generator's exception if it fails)."""
        async with contextlib.aclosing(self._run(prompts, params, prompt_ids, stream=False)) as events:
            async for event in events:
                return event.completions
        raise AssertionError("a request ended without its completions")  # pragma: no cover

    def stream(self, prompts: Sequence[str], params: SamplingParams,
               prompt_ids: Optional[Sequence[Sequence[int]]] = None) -> AsyncIterator[Union[TextPiece, Finished]]:
        """TextPiece events while the text is generated, then one Finished. Busy is raised by the first
        ``__anext__``; closing the iterator early (``contextlib.aclosing``), or cancelling its consumer,
        stops the generation."""
        return self._run(prompts, params, prompt_ids, stream=True)

    async def _run(self, prompts, params, prompt_ids, stream: bool):
        if self.pending >= self.max_pending:
            raise Busy(f"{self.pending} requests are waiting for generation (the limit); try again later")
        job = _Job(list(prompts), params, prompt_ids, stream, asyncio.get_running_loop())
        self.pending += 1
        self._jobs.put(job)
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            job.cancelled.set()  # a no-op once finished; otherwise the worker drops or stops the job
            self.pending -= 1

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                continue
            try:
                # on_text for every job, streamed or not: it is where a job whose client left is stopped
                completions = self.generator.generate(job.prompts, job.params, prompt_ids=job.prompt_ids,
                                                      on_text=job.on_text)
            except _Cancelled:
                continue
            except Exception as error:  # noqa: BLE001 - handed to the request, which answers 500 and logs it
                job.push(error)
            else:
                job.push(Finished(completions))

    def close(self, timeout: float = 60.0) -> None:
        """Stop the thread after the request it is running (waiting ones are dropped)."""
        self._jobs.put(None)
        self._thread.join(timeout)
