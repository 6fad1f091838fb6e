"""Tokenize a jsonl corpus into Megatron mmap datasets, in parallel, order preserved.

The library behind ``tools/preprocess_data.py``. Lines of the input (``.jsonl`` or ``.jsonl.gz``)
are read in chunks of ``chunk_size`` lines; each chunk is parsed and tokenized in one worker with
ONE batch call of the tokenizer per json key, and comes back as a flat numpy array of token ids
plus one length per document, so per-document Python work stays small. The main process appends
the chunks in input order to one ``MMapIndexedDatasetBuilder`` per key, writing
``{output_prefix}_{key}_document.bin/.idx`` — byte-identical to Megatron's tool for the same
tokenizer (one sequence per document; documents that tokenize to nothing are dropped, as there).

A malformed json line, a missing key or a non-string value raises ``BadInputLine`` naming the file
and line; the builders are then aborted (their temporary files removed) and an earlier output pair
at the targets stays as it was: outputs are renamed into place only when the whole input is done.
An input without a single token is refused (nothing written). With ``skip_bad_lines`` bad lines
are skipped and counted instead. Blank lines are ignored.

Imports numpy, the standard library and megatron.data only.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time
from typing import Iterator, Optional, Sequence

import numpy as np

from megatron.config import TokenizerConfig
from megatron.data import indexed_dataset
from megatron.data.tokenizers import LONG_TEXT_CHARS, build_tokenizer

DATASET_IMPLS = ("mmap",)


class BadInputLine(ValueError):
    """A line of the input that is not a json object holding every requested key as a string."""

    def __init__(self, path: str, line_number: int, reason: str):
        self.path, self.line_number, self.reason = path, line_number, reason
        super().__init__(f"{path}:{line_number}: {reason}; fix or remove the line, or pass "
                         "--skip-bad-lines to skip such lines")


@dataclasses.dataclass(frozen=True)
class PreprocessConfig:
    """One preprocessing run; fields mirror Megatron's ``tools/preprocess_data.py`` flags."""

    input: str
    output_prefix: str
    tokenizer: TokenizerConfig  # small and picklable: each worker builds its own tokenizer
    json_keys: tuple = ("text",)
    append_eod: bool = False
    workers: int = 1                 # worker processes; 1 tokenizes in the main process
    chunk_size: int = 256            # input lines per task handed to a worker
    log_interval: int = 10000        # documents between progress lines; 0 disables them
    skip_bad_lines: bool = False
    dataset_impl: str = "mmap"

    def validate(self) -> None:
        if self.dataset_impl not in DATASET_IMPLS:
            raise ValueError(f"--dataset-impl {self.dataset_impl!r} is not supported; only 'mmap' "
                             "(Megatron's memory-mapped format) is written by this tool")
        if self.workers < 1 or self.chunk_size < 1 or self.log_interval < 0:
            raise ValueError(f"--workers {self.workers} and --chunk-size {self.chunk_size} must be >= 1 "
                             f"and --log-interval {self.log_interval} >= 0")
        if not self.json_keys or len(set(self.json_keys)) != len(self.json_keys):
            raise ValueError(f"--json-keys {list(self.json_keys)} must name at least one key, each once")
        if not os.path.isfile(self.input):
            raise ValueError(f"--input {self.input!r} is not a file; pass a .jsonl or .jsonl.gz file")

    def output_prefix_for(self, key: str) -> str:
        return f"{self.output_prefix}_{key}_document"


@dataclasses.dataclass
class PreprocessStats:
    """What a run did. ``num_tokens`` counts every key's tokens, end-of-document tokens included."""

    num_docs: int = 0                # input lines turned into documents
    num_tokens: int = 0
    input_bytes: int = 0             # bytes of the input lines read (uncompressed)
    num_bad_lines: int = 0           # skipped (only with skip_bad_lines)
    num_empty_docs: int = 0          # (line, key) pairs that tokenized to nothing and were dropped
    seconds: float = 0.0
    outputs: dict = dataclasses.field(default_factory=dict)  # key -> output prefix

    def rates(self) -> dict:
        seconds = max(self.seconds, 1e-9)
        return {"docs_per_s": self.num_docs / seconds, "tokens_per_s": self.num_tokens / seconds,
                "mb_per_s": self.input_bytes / 1e6 / seconds}


@dataclasses.dataclass
class ChunkResult:
    """One chunk, tokenized: per key a flat token array and one length per kept document."""

    tokens: dict
    lengths: dict
    num_docs: int
    input_bytes: int
    num_empty_docs: int
    bad_lines: list                  # (line number, reason), in input order


def open_text_lines(path: str):
    """The input as a binary line iterator; ``.gz`` files are decompressed on the fly."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb", buffering=1 << 20)


def iter_chunks(path: str, chunk_size: int) -> Iterator[tuple]:
    """(1-based number of the chunk's first line, list of raw lines) over the whole file."""
    with open_text_lines(path) as lines:
        first = 1
        while True:
            chunk = list(itertools.islice(lines, chunk_size))
            if not chunk:
                return
            yield first, chunk
            first += len(chunk)


def parse_lines(first_line: int, lines: Sequence[bytes], keys: Sequence[str]) -> tuple:
    """Per key the texts of the good lines, and the bad lines as (line number, reason)."""
    texts = {key: [] for key in keys}
    bad = []
    for number, raw in enumerate(lines, start=first_line):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError
            bad.append((number, f"not valid JSON ({e})"))
            continue
        if not isinstance(record, dict):
            bad.append((number, f"expected a JSON object, got {type(record).__name__}"))
            continue
        missing = [key for key in keys if not isinstance(record.get(key), str)]
        if missing:
            found = {key: type(record[key]).__name__ for key in missing if key in record}
            bad.append((number, f"key(s) {missing} missing or not strings (found types {found}; "
                                f"keys present: {sorted(record)[:10]})"))
            continue
        for key in keys:
            texts[key].append(record[key])
    return texts, bad


def iter_texts(path: str, keys: Sequence[str] = ("text",), skip_bad_lines: bool = False) -> Iterator[str]:
    """Every requested key's text of a jsonl(.gz) file, in file order (keys in the given order per
    chunk of lines); a bad line raises ``BadInputLine`` unless ``skip_bad_lines``."""
    for first_line, lines in iter_chunks(path, 1024):
        texts, bad = parse_lines(first_line, lines, keys)
        if bad and not skip_bad_lines:
            raise BadInputLine(path, *bad[0])
        for key in keys:
            yield from texts[key]


def flatten_documents(ids: Sequence[Sequence[int]], dtype, eod: Optional[int]) -> tuple:
    """Token lists -> (flat array, lengths) without empty documents; ``eod`` appended to each if given."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    if any(isinstance(doc, np.ndarray) for doc in ids):  # long documents come as arrays already
        flat = np.concatenate([np.asarray(doc, dtype=dtype) for doc in ids])
    else:
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    lengths = lengths[lengths > 0]
    if eod is None or len(lengths) == 0:
        return flat, lengths
    lengths = lengths + 1
    ends = np.cumsum(lengths) - 1                      # position of each document's eod
    out = np.empty(int(lengths.sum()), dtype=dtype)
    is_text = np.ones(len(out), dtype=bool)
    is_text[ends] = False
    out[is_text] = flat
    out[ends] = eod
    return out, lengths


class ChunkEncoder:
    """Parses and tokenizes chunks; one per process (the tokenizer is built where it is used)."""

    def __init__(self, spec: TokenizerConfig, keys: Sequence[str], append_eod: bool):
        self.tokenizer = build_tokenizer(spec)
        self.keys = tuple(keys)
        self.dtype = indexed_dataset.best_dtype(self.tokenizer.vocab_size)
        self.eod = self.tokenizer.eod if append_eod else None

    def _tokenize(self, texts: list) -> list:
        """Token ids per text (lists, or arrays for long texts, tokenized in pieces to bound memory)."""
        long = [i for i, text in enumerate(texts) if len(text) > LONG_TEXT_CHARS]
        if not texts or not long:
            return self.tokenizer.tokenize_batch(texts) if texts else []
        ids = self.tokenizer.tokenize_batch([text if len(text) <= LONG_TEXT_CHARS else "" for text in texts])
        for i in long:
            parts = [np.asarray(part, dtype=self.dtype) for part in self.tokenizer.tokenize_long(texts[i])]
            ids[i] = np.concatenate(parts)
        return ids

    def __call__(self, task: tuple) -> ChunkResult:
        first_line, lines = task
        texts, bad = parse_lines(first_line, lines, self.keys)
        tokens, lengths, num_empty = {}, {}, 0
        for key in self.keys:
            ids = self._tokenize(texts[key])
            tokens[key], lengths[key] = flatten_documents(ids, self.dtype, self.eod)
            num_empty += len(ids) - len(lengths[key])
        return ChunkResult(tokens, lengths, len(texts[self.keys[0]]), sum(map(len, lines)), num_empty, bad)


_WORKER_ENCODER: Optional[ChunkEncoder] = None


def _init_worker(spec: TokenizerConfig, keys: Sequence[str], append_eod: bool) -> None:
    global _WORKER_ENCODER
    # One core per worker: the pool is the parallelism; the tokenizer's own threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_ENCODER = ChunkEncoder(spec, keys, append_eod)


def _encode_in_worker(task: tuple) -> ChunkResult:
    return _WORKER_ENCODER(task)


def _ordered_results(config: PreprocessConfig, tasks: Iterator[tuple]) -> Iterator[ChunkResult]:
    """Chunk results in input order. With several workers at most ``2 * workers`` chunks are in
    flight (``Pool.imap`` would read the whole input ahead into memory)."""
    if config.workers == 1:
        encoder = ChunkEncoder(config.tokenizer, config.json_keys, config.append_eod)
        yield from map(encoder, tasks)
        return
    with multiprocessing.Pool(config.workers, initializer=_init_worker,
                              initargs=(config.tokenizer, config.json_keys, config.append_eod)) as pool:
        pending = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(_encode_in_worker, (task,)))
            if len(pending) >= 2 * config.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _log_progress(stats: PreprocessStats, started: float, out) -> None:
    stats.seconds = time.perf_counter() - started
    rates = stats.rates()
    print(f"processed {stats.num_docs} documents ({rates['docs_per_s']:.0f} docs/s, "
          f"{rates['tokens_per_s']:.0f} tokens/s, {rates['mb_per_s']:.2f} MB/s)", file=out, flush=True)


def _append_chunk(builders: dict, result: ChunkResult) -> int:
    num_tokens = 0
    for key, builder in builders.items():
        tokens, lengths = result.tokens[key], result.lengths[key]
        ends = np.cumsum(lengths)
        for start, end in zip((ends - lengths).tolist(), ends.tolist()):
            builder.add_item(tokens[start:end])
            builder.end_document()
        num_tokens += len(tokens)
    return num_tokens


def preprocess(config: PreprocessConfig, log=sys.stderr) -> PreprocessStats:
    """Run one preprocessing job; returns its figures. Raises ``BadInputLine`` (see module doc)."""
    config.validate()
    tokenizer = build_tokenizer(config.tokenizer)  # fail on bad tokenizer flags before any worker starts
    dtype = indexed_dataset.best_dtype(tokenizer.vocab_size)
    prefixes = {key: config.output_prefix_for(key) for key in config.json_keys}
    builders = {key: indexed_dataset.MMapIndexedDatasetBuilder(prefix, dtype) for key, prefix in prefixes.items()}
    stats = PreprocessStats(outputs=dict(prefixes))
    started = time.perf_counter()
    next_log = config.log_interval
    try:
        for result in _ordered_results(config, iter_chunks(config.input, config.chunk_size)):
            if result.bad_lines and not config.skip_bad_lines:
                number, reason = result.bad_lines[0]
                raise BadInputLine(config.input, number, reason)
            stats.num_bad_lines += len(result.bad_lines)
            for number, reason in result.bad_lines:
                print(f"skipping {config.input}:{number}: {reason}", file=log)
            stats.num_tokens += _append_chunk(builders, result)
            stats.num_docs += result.num_docs
            stats.input_bytes += result.input_bytes
            stats.num_empty_docs += result.num_empty_docs
            if config.log_interval and stats.num_docs >= next_log:
                _log_progress(stats, started, log)
                next_log = (stats.num_docs // config.log_interval + 1) * config.log_interval
        if stats.num_tokens == 0:
            raise ValueError(f"{config.input} holds no documents (no non-empty {', '.join(config.json_keys)}); "
                             f"nothing written")
        for builder in builders.values():
            builder.finalize()
    except BaseException:
        # Only this run's temporary files go: an earlier good pair at the output prefix stays as it was.
        for builder in builders.values():
            builder.abort()
        raise
    stats.seconds = time.perf_counter() - started
    return stats


def summary(stats: PreprocessStats) -> str:
    """One line for the end of a run."""
    rates = stats.rates()
    return (f"done: {stats.num_docs} documents, {stats.num_tokens} tokens, {stats.input_bytes / 1e6:.1f} MB "
            f"in {stats.seconds:.2f} s ({rates['docs_per_s']:.0f} docs/s, {rates['tokens_per_s']:.0f} "
            f"tokens/s, {rates['mb_per_s']:.2f} MB/s); skipped {stats.num_bad_lines} bad lines, dropped "
            f"{stats.num_empty_docs} empty documents; wrote {', '.join(stats.outputs.values())}")
