"""Benchmark: the start-up data checks (``megatron.data.checks``) on a synthetic BLOOM-sized index.

Writes a ``.idx`` for ``--num-tokens`` tokens (int32 as BLOOM's 250k vocabulary needs, lognormal document
lengths around 1,000 tokens)
beside a sparse ``.bin`` of the right size (no disk blocks: its bytes read as zeros, so the scan times
the page mapping, not the disk), then times what every rank of a launch runs before any process group:
opening and validating the pair (``index_problems``) and the bounded token-id scan (``token_id_problems``),
cold (first open) and warm. Prints ONE JSON line; ``--output`` also writes it to a file.

    .venv/bin/python -m benchmarks.bench_data_checks [--num-tokens 1e9] [--output FILE]
"""

import argparse
import os
import struct
import tempfile
import time

import numpy as np

from benchmarks._common import emit, machine
from megatron.data.checks import SCAN_BUDGET_TOKENS, index_problems, token_id_problems
from megatron.data.indexed_dataset import MAGIC, VERSION, dtype_code


def write_synthetic_pair(prefix: str, num_tokens: int, mean_doc_tokens: int, seed: int = 0) -> int:
    """A valid int32 ``prefix.idx`` for about ``num_tokens`` tokens and a sparse ``prefix.bin``; the sequences."""
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(0.0, 1.0, max(1, num_tokens // mean_doc_tokens))
    sizes = np.maximum(1, np.round(sizes / sizes.sum() * num_tokens)).astype(np.int32)
    pointers = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * 4, out=pointers[1:])
    doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", MAGIC, VERSION, dtype_code(np.int32), len(sizes), len(doc_idx)))
        for array in (sizes, pointers, doc_idx):
            f.write(array.tobytes(order="C"))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(sizes.astype(np.int64).sum()) * 4)
    return len(sizes)


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-tokens", type=float, default=1e9)
    parser.add_argument("--mean-doc-tokens", type=int, default=1000)
    parser.add_argument("--vocab-size", type=int, default=250680)  # BLOOM's tokenizer
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    machine_at_start = machine()
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "synthetic_text_document")
        num_sequences = write_synthetic_pair(prefix, int(args.num_tokens), args.mean_doc_tokens)
        index_cold, problems = timed(lambda: index_problems([prefix]))
        assert problems == [], problems
        scan_cold, problems = timed(lambda: token_id_problems([prefix], args.vocab_size))
        assert problems == [], problems
        index_warm, _ = timed(lambda: index_problems([prefix]))
        scan_warm, _ = timed(lambda: token_id_problems([prefix], args.vocab_size))
        idx_bytes, bin_bytes = os.path.getsize(prefix + ".idx"), os.path.getsize(prefix + ".bin")
    emit({"benchmark": "data_checks",
          "config": {"num_tokens": int(args.num_tokens), "mean_doc_tokens": args.mean_doc_tokens,
                     "num_sequences": num_sequences, "dtype": "int32", "idx_bytes": idx_bytes, "bin_bytes": bin_bytes,
                     "scan_budget_tokens": SCAN_BUDGET_TOKENS, "vocab_size": args.vocab_size, "bin": "sparse file"},
          "seconds": {"open_and_validate_cold": round(index_cold, 3), "token_id_scan_cold": round(scan_cold, 3),
                      "open_and_validate_warm": round(index_warm, 3), "token_id_scan_warm": round(scan_warm, 3),
                      "total_cold": round(index_cold + scan_cold, 3)},
          "under_5_s": index_cold + scan_cold < 5.0, "machine_at_start": machine_at_start}, args.output)


if __name__ == "__main__":
    main()
