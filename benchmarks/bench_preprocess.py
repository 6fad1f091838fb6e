"""Preprocessing throughput: ``megatron.data.preprocess`` with 1 and 2 workers vs the bare tokenizer.

The input is >= 50 MB of jsonl generated deterministically from the default corpus (documents
repeated in a seeded permutation until the size is reached); the tokenizer is the default corpus's
8k byte-level BPE. Measured in the same run, on the same text:

- ``bare_encode_batch``: ``tokenizers.Tokenizer.encode_batch`` over the texts (already parsed, in
  memory) in batches of ``chunk_size``, reading each encoding's ids, single-threaded (TOKENIZERS_PARALLELISM=false, set before
  ``tokenizers`` is imported) — the tokenizer's own speed with nothing around it. It is measured
  before AND after our runs; the mean is the reference and both values are reported (the cores are
  shared, so drift shows there). ``bare_encode_batch_fast`` (no offsets; what our workers call) is
  reported too.
- ``ours_workers_N``: the whole tool: read + json parse + tokenize + write .bin/.idx, with N worker
  processes (N=1 runs in the main process).

``ratio_per_worker`` = (our docs/s / N) / bare docs/s (docs, not tokens: our count includes the
eods); the goal is >= 0.8. ``ratio_per_worker_vs_encode_batch_fast`` is the stricter comparison.
Prints ONE JSON line; ``--output`` also writes it to a file (dated results in ``benchmarks/results/``).

    python -m benchmarks.bench_preprocess --output benchmarks/results/preprocess_2026-11-29.json
"""

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one thread, for fairness

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import tokenizers  # noqa: E402

from megatron.config import TokenizerConfig  # noqa: E402
from megatron.data.corpus import prepare_default_corpus  # noqa: E402
from megatron.data.preprocess import PreprocessConfig, iter_texts, preprocess  # noqa: E402
from megatron.data.tokenizers import GPT2BPETokenizer  # noqa: E402


def generate_input(corpus_jsonl: str, path: str, min_bytes: int, seed: int = 1234) -> dict:
    """Repeat the corpus documents in seeded random orders until ``min_bytes`` of jsonl are written."""
    with open(corpus_jsonl, "rb") as f:
        lines = [line for line in f if line.strip()]
    rng = np.random.RandomState(seed)
    written = num_docs = 0
    with open(path, "wb") as f:
        while written < min_bytes:
            for i in rng.permutation(len(lines)):
                f.write(lines[i])
                written += len(lines[i])
                num_docs += 1
                if written >= min_bytes:
                    break
    return {"bytes": written, "num_docs": num_docs}


def bench_bare(backend, texts: list, batch_size: int, fast: bool) -> dict:
    encode = backend.encode_batch_fast if fast else backend.encode_batch
    num_tokens = 0
    started = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        num_tokens += sum(len(e.ids) for e in encode(texts[i:i + batch_size], add_special_tokens=False))
    seconds = time.perf_counter() - started
    text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    return {"seconds": seconds, "num_docs": len(texts), "num_tokens": num_tokens,
            "docs_per_s": len(texts) / seconds, "tokens_per_s": num_tokens / seconds, "text_mb_per_s": text_mb / seconds}


def bench_ours(input_path: str, out_dir: str, spec: TokenizerConfig, workers: int, chunk_size: int) -> dict:
    config = PreprocessConfig(input=input_path, output_prefix=os.path.join(out_dir, f"w{workers}"), tokenizer=spec,
                              append_eod=True, workers=workers, chunk_size=chunk_size, log_interval=0)
    stats = preprocess(config)
    for suffix in (".bin", ".idx"):
        os.remove(stats.outputs["text"] + suffix)
    return {"seconds": stats.seconds, "num_docs": stats.num_docs, "num_tokens": stats.num_tokens,
            "input_mb": stats.input_bytes / 1e6, **stats.rates()}


def machine() -> dict:
    model = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {"cpu_count": os.cpu_count(), "cpu_model": model, "platform": platform.platform()}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus-dir", default="data_cache/default_corpus")
    parser.add_argument("--min-mb", type=float, default=50.0, help="size of the generated jsonl input")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--output", help="also write the JSON line to this file")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()
    corpus = prepare_default_corpus(args.corpus_dir)
    spec = TokenizerConfig("GPT2BPETokenizer", vocab_file=corpus["vocab_file"], merge_file=corpus["merge_file"])
    backend = GPT2BPETokenizer(spec.vocab_file, spec.merge_file).backend
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as work:
        input_path = os.path.join(work, "input.jsonl")
        generated = generate_input(corpus["jsonl"], input_path, int(args.min_mb * 1e6))
        texts = list(iter_texts(input_path))
        results = {"bare_encode_batch_before": bench_bare(backend, texts, args.chunk_size, fast=False),
                   "bare_encode_batch_fast": bench_bare(backend, texts, args.chunk_size, fast=True)}
        for workers in args.workers:
            results[f"ours_workers_{workers}"] = bench_ours(input_path, work, spec, workers, args.chunk_size)
        results["bare_encode_batch_after"] = bench_bare(backend, texts, args.chunk_size, fast=False)
    # Ratios on docs/s: both sides handle the same documents (our token count also holds the eods).
    bare = float(np.mean([results[f"bare_encode_batch_{when}"]["docs_per_s"] for when in ("before", "after")]))
    fast = results["bare_encode_batch_fast"]["docs_per_s"]
    ratios = {f"workers_{w}": results[f"ours_workers_{w}"]["docs_per_s"] / w / bare for w in args.workers}
    ratios_fast = {f"workers_{w}": results[f"ours_workers_{w}"]["docs_per_s"] / w / fast for w in args.workers}
    record = {
        "benchmark": "preprocess", "date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": git_commit(),
        "config": {"input_mb": generated["bytes"] / 1e6, "num_docs": generated["num_docs"],
                   "chunk_size": args.chunk_size, "workers": args.workers, "append_eod": True,
                   "tokenizer": "default-corpus byte-level BPE", "vocab_size": corpus["params"]["vocab_size"],
                   "corpus_jsonl_sha256": corpus["files"]["corpus.jsonl"]["sha256"],
                   "bare_threads": "TOKENIZERS_PARALLELISM=false (1 thread)"},
        "versions": {"python": platform.python_version(), "tokenizers": tokenizers.__version__,
                     "numpy": np.__version__},
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "bare_docs_per_s": bare, "ratio_per_worker": ratios, "ratio_per_worker_vs_encode_batch_fast": ratios_fast,
        "goal_ratio_per_worker": 0.8, "results": results,
    }
    line = json.dumps(record, sort_keys=True)
    print(line)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
