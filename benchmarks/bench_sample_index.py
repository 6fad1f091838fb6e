"""Benchmark: building the GPT sample index for a synthetic 1e9-token dataset at seq_length 2048.

Times the C++ ``build_sample_idx`` and the whole index construction (document shuffle, sample
index, sample shuffle: what ``GPTDataset`` does on a cache miss), with peak memory, and compares
the C++ builder side by side with a pure-Python port of the loop and a vectorized numpy
(searchsorted) equivalent on a smaller dataset. Prints ONE JSON line; ``--output`` also writes it
(indented) to a file, e.g. benchmarks/results/sample_index_<date>.json.

    .venv/bin/python -m benchmarks.bench_sample_index [--num-tokens 1e9] [--output FILE]
"""

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import time
import tracemalloc

import numpy as np

from megatron.data import _helpers
from megatron.data.gpt_dataset import build_index_arrays


def synthetic_sizes(num_tokens: int, mean_doc_tokens: int, seed: int) -> np.ndarray:
    """Document lengths, lognormal (web-text-like long tail), rescaled to sum to ~num_tokens."""
    rng = np.random.default_rng(seed)
    num_docs = max(1, num_tokens // mean_doc_tokens)
    sizes = rng.lognormal(mean=0.0, sigma=1.0, size=num_docs)
    sizes = np.maximum(1, np.round(sizes / sizes.sum() * num_tokens)).astype(np.int32)
    return sizes


def python_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Pure-Python port of the C++ loop (the reference the C++ replaces)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = [(0, 0)]
    position, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while True:
            left = int(sizes[doc_idx[position]]) - offset
            if remaining <= left:
                offset += remaining - 1
                break
            remaining -= left
            position, offset = position + 1, 0
        out.append((position, offset))
    return np.array(out, dtype=np.int64)


def numpy_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Vectorized equivalent: sample k starts at stream position k * seq_length."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    starts = np.concatenate([[0], np.cumsum(sizes[doc_idx], dtype=np.int64)])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(starts, positions, side="right") - 1
    return np.stack([doc_pos, positions - starts[doc_pos]], axis=1)


def measure(fn, *args, repeats=3):
    """Best wall time over repeats, tracemalloc peak (numpy buffers are traced) and ru_maxrss growth."""
    times, result = [], None
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args)
        times.append(time.perf_counter() - start)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_growth_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    return result, {"seconds_best": round(min(times), 6), "seconds_all": [round(t, 6) for t in times],
                    "tracemalloc_peak_mb": round(peak / 2**20, 1), "maxrss_growth_mb": round(rss_growth_kb / 1024, 1)}


def machine():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = "unknown"
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__, "git_commit": commit}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=float, default=1e9)
    parser.add_argument("--mean-doc-tokens", type=int, default=1000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--num-epochs", type=int, default=1)
    parser.add_argument("--compare-tokens", type=float, default=2e7, help="dataset size for the C++/Python/numpy comparison")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output", help="also write the JSON (indented) to this file")
    args = parser.parse_args()

    sizes = synthetic_sizes(int(args.num_tokens), args.mean_doc_tokens, args.seed)
    tokens_per_epoch = int(sizes.sum(dtype=np.int64))
    num_samples = (args.num_epochs * tokens_per_epoch - 1) // args.seq_length
    documents = np.arange(len(sizes), dtype=np.int64)
    doc_idx = np.tile(documents, args.num_epochs)
    np.random.RandomState(args.seed).shuffle(doc_idx)

    sample_idx, cpp = measure(_helpers.build_sample_idx, sizes, doc_idx, args.seq_length, args.num_epochs, tokens_per_epoch)
    _, full = measure(build_index_arrays, sizes, documents, num_samples, args.seq_length, args.seed)
    numpy_full_idx, numpy_full = measure(numpy_sample_idx, sizes, doc_idx, args.seq_length, args.num_epochs, tokens_per_epoch)
    assert np.array_equal(sample_idx, numpy_full_idx), "C++ and numpy sample indices differ"

    small = synthetic_sizes(int(args.compare_tokens), args.mean_doc_tokens, args.seed + 1)
    small_tokens = int(small.sum(dtype=np.int64))
    small_doc_idx = np.random.RandomState(args.seed).permutation(len(small)).astype(np.int64)
    small_args = (small, small_doc_idx, args.seq_length, 1, small_tokens)
    cpp_small_idx, cpp_small = measure(_helpers.build_sample_idx, *small_args)
    py_small_idx, py_small = measure(python_sample_idx, *small_args, repeats=1)
    np_small_idx, np_small = measure(numpy_sample_idx, *small_args)
    assert np.array_equal(cpp_small_idx, py_small_idx) and np.array_equal(cpp_small_idx, np_small_idx)

    report = {
        "benchmark": "sample_index",
        "date": datetime.date.today().isoformat(),
        "config": {"num_tokens": tokens_per_epoch, "num_documents": len(sizes), "doc_length": "lognormal(0,1) rescaled",
                   "mean_doc_tokens": args.mean_doc_tokens, "seq_length": args.seq_length, "num_epochs": args.num_epochs,
                   "num_samples": int(num_samples), "seed": args.seed},
        "goal_seconds": 10.0,
        "cpp_build_sample_idx": cpp,
        "full_index_build_doc_shuffle_sample_idx_shuffle": full,
        "numpy_searchsorted_sample_idx": numpy_full,
        "sample_idx_mb": round(sample_idx.nbytes / 2**20, 1),
        "comparison_small": {"num_tokens": small_tokens, "num_documents": len(small),
                             "num_samples": int(cpp_small_idx.shape[0] - 1), "cpp": cpp_small,
                             "python_loop": py_small, "numpy_searchsorted": np_small,
                             "python_over_cpp": round(py_small["seconds_best"] / max(cpp_small["seconds_best"], 1e-9), 1),
                             "all_three_equal": True},
        "machine": machine(),
    }
    print(json.dumps(report))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
