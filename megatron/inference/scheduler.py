"""The queue of generation requests and the one thread that decodes them in one running batch.

The HTTP server's event loop never runs the model: it hands a request to ``GenerationWorker`` and
awaits it, so it keeps accepting connections and answering /health while generation runs. The
worker owns the requests waiting or running (at most ``max_pending``; one more is ``Busy``). Its
thread runs continuous batching (``megatron.inference.batching``): each prompt of a request is one
sequence; sequences join the batch, oldest first, whenever a slot of the ``max_batch_size`` is
free (those joining at one step run their prompts together), and leave it when they finish, while
the others keep decoding. A request is answered once all its sequences have finished. ``max_batch_size=1`` is
generation one sequence at a time.

Text reaches the loop through ``loop.call_soon_threadsafe``, in order. A request whose client has
gone (its task cancelled) is marked cancelled: its sequences are dropped before the next step,
whether waiting or in the batch (their slots go to the next waiting ones).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import queue
import threading
from typing import AsyncIterator, Optional, Sequence, Union

from megatron.inference.batching import BatchDecoder, BatchRunner, GeneratingSequence
from megatron.inference.generation import Completion, Generator, SamplingParams, sequence_generator

__all__ = ["Busy", "TextPiece", "Finished", "GenerationWorker"]

logger = logging.getLogger(__name__)

IDLE_SECONDS = 60.0  # how often an idle worker tells its runner (under TP: the other ranks, whose collectives time out)


class Busy(Exception):
    """More requests than ``max_pending`` would be waiting."""


@dataclasses.dataclass(frozen=True)
class TextPiece:
    index: int     # which prompt of the request
    text: str


@dataclasses.dataclass(frozen=True)
class Finished:
    completions: list[Completion]


_Event = Union[TextPiece, Finished, BaseException]


class _Job:
    """One request: its sequences (one per prompt), and the queue of events its awaiting task reads."""

    def __init__(self, prompts, params, prompt_ids, stream: bool, loop: asyncio.AbstractEventLoop):
        self.prompts, self.params, self.prompt_ids, self.stream = prompts, params, prompt_ids, stream
        self.events: asyncio.Queue[_Event] = asyncio.Queue()
        self.cancelled = threading.Event()  # set on the loop when nobody waits any more
        self.sequences: list[GeneratingSequence] = []
        self.unfinished = 0
        self._loop = loop

    def push(self, event: _Event) -> None:
        """From the worker thread: hand ``event`` to the loop (a closed loop: nobody is listening)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.cancelled.set()

    def make_sequences(self, generator: Generator) -> list[GeneratingSequence]:
        """On the worker thread: one sequence per prompt (tokenized here if the server did not)."""
        params = self.params.validate()
        encoded = self.prompt_ids
        if encoded is None:
            encoded = [generator.tokenizer.tokenize(prompt) for prompt in self.prompts]
        for ids in encoded:
            generator.check_length(len(ids), params.max_new_tokens)
        eod = getattr(generator.tokenizer, "eod", None)
        self.sequences = [
            GeneratingSequence(ids, params, generator=sequence_generator(params, index), tokenizer=generator.tokenizer,
                               eod=eod, on_text=self._streamer(index) if self.stream else None, tag=self)
            for index, ids in enumerate(encoded)]
        self.unfinished = len(self.sequences)
        return self.sequences

    def _streamer(self, index: int):
        return lambda text: self.push(TextPiece(index, text))

    def sequence_finished(self) -> None:
        self.unfinished -= 1
        if self.unfinished == 0:
            self.push(Finished([sequence.completion(prompt) for sequence, prompt in zip(self.sequences, self.prompts)]))


class GenerationWorker:
    """Decodes the sequences of every request in one running batch of at most ``max_batch_size`` rows, on
    its own thread; sequences join oldest first as slots free up."""

    def __init__(self, generator: Generator, max_pending: int, max_batch_size: int = 16,
                 runner: Optional[BatchRunner] = None):
        self.generator = generator
        self.max_pending = max_pending
        self.pending = 0  # requests submitted and not yet answered; read and written on the loop only
        # runner: the model's side of the batch (under tensor parallelism, one that sends each call to the
        # other ranks as well)
        runner = runner if runner is not None else BatchRunner(generator.model, generator.vocab_size)
        self.decoder = BatchDecoder(runner, max_batch_size)
        self._jobs: queue.SimpleQueue[Optional[_Job]] = queue.SimpleQueue()
        self._waiting: collections.deque[GeneratingSequence] = collections.deque()
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
            job.cancelled.set()  # a no-op once finished; otherwise the worker drops the job's sequences
            self.pending -= 1

    def _serve(self) -> None:
        while self._take_jobs(block=not (self.decoder.rows or self._waiting)):
            self._drop(lambda job: job.cancelled.is_set())
            self._admit([self._waiting.popleft() for _ in range(min(len(self._waiting), self.decoder.free_slots))])
            self._step()

    def _take_jobs(self, block: bool) -> bool:
        """Move the submitted jobs' sequences to the waiting line; False once closed."""
        while True:
            try:
                job = self._jobs.get(block=block, timeout=IDLE_SECONDS if block else None)
            except queue.Empty:
                if not block:
                    return True
                self.decoder.runner.idle()
                continue
            if job is None:
                return False
            block = False
            if job.cancelled.is_set():
                continue
            try:
                self._waiting.extend(job.make_sequences(self.generator))
            except Exception as error:  # noqa: BLE001 - handed to the request, which answers 500 and logs it
                self._fail([job], error)

    def _admit(self, sequences: list[GeneratingSequence]) -> None:
        """Their prompts run together (``BatchDecoder.add``) and they join the batch."""
        if not sequences:
            return
        try:
            finished = self.decoder.add(sequences)
        except Exception as error:  # noqa: BLE001 - as above
            self._fail({sequence.tag for sequence in sequences}, error)
            return
        for sequence in finished:
            sequence.tag.sequence_finished()

    def _step(self) -> None:
        jobs = {sequence.tag for sequence in self.decoder.rows}
        try:
            finished = self.decoder.step()
        except Exception as error:  # noqa: BLE001 - as above; the caches may be half written: start afresh
            self.decoder.reset()
            self._fail(jobs, error)
            return
        for sequence in finished:
            sequence.tag.sequence_finished()

    def _fail(self, jobs, error: Exception) -> None:
        for job in jobs:
            job.push(error)
        self._drop(lambda job: job in jobs)

    def _drop(self, condition) -> None:
        """Remove the sequences of the jobs meeting ``condition`` from the waiting line and the batch."""
        self._waiting = collections.deque(s for s in self._waiting if not condition(s.tag))
        self.decoder.remove([s for s in self.decoder.rows if condition(s.tag)])

    def close(self, timeout: float = 60.0) -> None:
        """Stop the thread after the step it is running (waiting and running requests are dropped)."""
        self._jobs.put(None)
        self._thread.join(timeout)
