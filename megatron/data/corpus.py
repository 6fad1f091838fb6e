"""A default training corpus built offline from text every machine running this project has.

A fresh machine has no internet, but it has Python: the docstrings of the installed standard library
and of the installed packages (extracted with ``ast``, never imported) plus their ``.md``/``.rst``/
``.txt`` documentation are several MB of real English and code prose. ``prepare_default_corpus``
collects them into ``corpus.jsonl``, trains a byte-level BPE tokenizer on it and preprocesses it into
a Megatron mmap dataset with end-of-document tokens:

    out_dir/corpus.jsonl                         {"text": ..., "source": "stdlib/json/decoder.py"}
    out_dir/tokenizer/vocab.json, merges.txt     GPT2BPETokenizer files (eod <|endoftext|> = 0)
    out_dir/tokenizer/tokenizer.json             the same tokenizer for PretrainedFromHF
    out_dir/corpus_text_document.bin/.idx        the data prefix for training
    out_dir/COMPLETE.json                        the completion marker, written last

Deterministic: files are visited in sorted order of their path relative to the stdlib or the
site-packages root, with no set/dict-order or hash-seed dependence, so the same installed files
give byte-identical outputs. (A machine with other package versions gets another corpus; the
marker records the sha256 of every output.) Idempotent and crash-safe: a directory with a valid
marker is reused; anything else is rebuilt from scratch. Concurrent callers serialize on a lock.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import sysconfig
import time
import warnings
from typing import Iterator

from megatron.config import TokenizerConfig
from megatron.data.preprocess import PreprocessConfig, iter_texts, preprocess
from megatron.data.tokenizers import train_bpe_tokenizer

CORPUS_FORMAT_VERSION = 1
MARKER = "COMPLETE.json"
DEFAULT_MIN_BYTES = 8_000_000
DEFAULT_VOCAB_SIZE = 8192
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "test", "tests", ".git"}
_DOC_SUFFIXES = (".md", ".rst", ".txt")
_MAX_FILE_BYTES = 2_000_000       # skip generated giants (huge stubs, data tables)
_MIN_DOC_CHARS = 64
_OUTPUTS = ("corpus.jsonl", "tokenizer", "corpus_text_document.bin", "corpus_text_document.idx")


def source_roots() -> list:
    """(label, directory) pairs to walk: the standard library, then the installed packages."""
    paths = sysconfig.get_paths()
    roots, seen = [], set()
    for label, key in (("stdlib", "stdlib"), ("site-packages", "purelib"), ("site-packages-platform", "platlib")):
        path = os.path.realpath(paths[key])
        if os.path.isdir(path) and path not in seen:
            seen.add(path)
            roots.append((label, path))
    return roots


def iter_files(root: str) -> Iterator[str]:
    """Files under ``root`` in sorted order, skipping caches, tests, metadata and nested site-packages."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith((".dist-info", ".egg-info")))
        for name in sorted(filenames):
            if name.endswith(".py") or name.endswith(_DOC_SUFFIXES):
                yield os.path.join(dirpath, name)


def _docstrings(tree: ast.Module, module: str) -> Iterator[str]:
    """Docstrings in source order, each under a header naming what it documents."""
    stack = [(tree, module, "module")]
    while stack:
        node, name, kind = stack.pop()
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield f"{kind} {name}\n\n{doc}"
        children = [child for child in getattr(node, "body", [])
                    if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        for child in reversed(children):  # stack: reversed, so they pop in source order
            child_kind = "class" if isinstance(child, ast.ClassDef) else "def"
            stack.append((child, f"{name}.{child.name}", child_kind))


def extract_text(path: str, relative: str) -> str:
    """The prose of one file: docstrings of a .py file, the whole of a documentation file; or ''."""
    try:
        if os.path.getsize(path) > _MAX_FILE_BYTES:
            return ""
        with open(path, "rb") as f:
            source = f.read()
        if not path.endswith(".py"):
            text = source.decode("utf-8")
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes and the like in old code
                tree = ast.parse(source, filename=relative)
            module = relative[:-3].replace(os.sep, ".").removesuffix(".__init__")
            text = "\n\n".join(_docstrings(tree, module))
        text = text.replace("\r\n", "\n").strip()
        text.encode("utf-8")  # lone surrogates from escapes in string literals: skip the file
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return ""
    return text if len(text) >= _MIN_DOC_CHARS else ""


def _extract_item(item: tuple) -> tuple:
    label, root, path = item
    relative = os.path.relpath(path, root)
    return f"{label}/{relative.replace(os.sep, '/')}", extract_text(path, relative)


def collect_documents(min_bytes: int, workers: int = 1) -> Iterator[dict]:
    """Documents (``{"text", "source"}``) in a fixed order until ``min_bytes`` of text are collected.

    Parsing dominates (about 5 MB of source per second per core), so ``workers`` processes parse
    files in parallel; results are consumed in path order, so the output does not depend on them.
    """
    items = [(label, root, path) for label, root in source_roots() for path in iter_files(root)]
    total = 0
    with multiprocessing.Pool(workers) if workers > 1 else contextlib.nullcontext() as pool:
        results = pool.imap(_extract_item, items, chunksize=8) if pool else map(_extract_item, items)
        for source, text in results:
            if not text:
                continue
            yield {"text": text, "source": source}
            total += len(text.encode("utf-8"))
            if total >= min_bytes:
                return
    raise ValueError(f"only {total} bytes of text found under {[root for _, root in source_roots()]}; "
                     f"pass a min_bytes below {min_bytes}")


def write_corpus_jsonl(path: str, min_bytes: int, workers: int = 1) -> dict:
    """Write the documents as jsonl (to a temporary name, renamed when complete)."""
    num_docs = text_bytes = 0
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in collect_documents(min_bytes, workers):
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
            num_docs += 1
            text_bytes += len(doc["text"].encode("utf-8"))
    os.replace(tmp, path)
    return {"num_docs": num_docs, "text_bytes": text_bytes}


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_records(out_dir: str, paths: list) -> dict:
    return {os.path.relpath(p, out_dir): {"bytes": os.path.getsize(p), "sha256": _sha256(p)} for p in paths}


def _read_valid_marker(out_dir: str, params: dict):
    """The marker's content if it matches ``params`` and every file it lists is there, whole; else None."""
    try:
        with open(os.path.join(out_dir, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
        if marker.get("params") != params:
            return None
        for relative, record in marker["files"].items():
            if os.path.getsize(os.path.join(out_dir, relative)) != record["bytes"]:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return marker


def _clear(out_dir: str) -> None:
    leftovers = tuple(name for name in sorted(os.listdir(out_dir)) if ".tmp" in name)  # a crashed build's
    for name in (MARKER,) + _OUTPUTS + leftovers:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def _absolute(out_dir: str, marker: dict, reused: bool) -> dict:
    result = dict(marker)
    for key in ("jsonl", "data_prefix", "vocab_file", "merge_file", "tokenizer_json"):
        result[key] = os.path.join(out_dir, marker[key])
    result["reused"] = reused
    return result


def _build(out_dir: str, params: dict, workers: int) -> dict:
    timings, started = {}, time.perf_counter()
    jsonl = os.path.join(out_dir, "corpus.jsonl")
    counts = write_corpus_jsonl(jsonl, params["min_bytes"], workers)
    timings["collect_s"] = time.perf_counter() - started

    t = time.perf_counter()
    tokenizer_dir = os.path.join(out_dir, "tokenizer")
    files = train_bpe_tokenizer(iter_texts(jsonl), params["vocab_size"], tokenizer_dir)
    timings["train_tokenizer_s"] = time.perf_counter() - t

    t = time.perf_counter()
    spec = TokenizerConfig("GPT2BPETokenizer", vocab_file=files["vocab_file"], merge_file=files["merge_file"])
    config = PreprocessConfig(input=jsonl, output_prefix=os.path.join(out_dir, "corpus"), tokenizer=spec,
                              append_eod=True, workers=workers, log_interval=0)
    stats = preprocess(config)
    timings["preprocess_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - started

    prefix = stats.outputs["text"]
    paths = [jsonl, files["vocab_file"], files["merge_file"], files["tokenizer_json"], prefix + ".bin", prefix + ".idx"]
    return {"format_version": CORPUS_FORMAT_VERSION, "params": params,
            "jsonl": "corpus.jsonl", "data_prefix": os.path.relpath(prefix, out_dir),
            "vocab_file": os.path.relpath(files["vocab_file"], out_dir),
            "merge_file": os.path.relpath(files["merge_file"], out_dir),
            "tokenizer_json": os.path.relpath(files["tokenizer_json"], out_dir),
            "num_docs": counts["num_docs"], "text_bytes": counts["text_bytes"], "num_tokens": stats.num_tokens,
            "python": sys.version.split()[0], "timings": timings, "files": _file_records(out_dir, paths)}


def prepare_default_corpus(out_dir, min_bytes: int = DEFAULT_MIN_BYTES, vocab_size: int = DEFAULT_VOCAB_SIZE,
                           workers: int = 2) -> dict:
    """Build (or reuse) the default corpus in ``out_dir``; returns the marker's figures plus absolute
    paths: ``data_prefix``, ``vocab_file``, ``merge_file``, ``tokenizer_json``, ``jsonl``, and
    ``reused`` (True when a complete earlier build was found). ``workers`` processes parse and
    tokenize; the outputs do not depend on their number."""
    if min_bytes <= 0 or vocab_size < 257 or workers < 1:
        raise ValueError(f"min_bytes={min_bytes} must be > 0, vocab_size={vocab_size} >= 257 and "
                         f"workers={workers} >= 1")
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    params = {"min_bytes": int(min_bytes), "vocab_size": int(vocab_size), "format_version": CORPUS_FORMAT_VERSION}
    with open(os.path.join(out_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same corpus: wait, then reuse
        marker = _read_valid_marker(out_dir, params)
        if marker is not None:
            return _absolute(out_dir, marker, reused=True)
        _clear(out_dir)
        marker = _build(out_dir, params, workers)
        tmp = os.path.join(out_dir, MARKER + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(out_dir, MARKER))
        return _absolute(out_dir, marker, reused=False)
