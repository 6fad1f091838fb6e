"""What a launch checks of its data before any process group: each ``.bin``/``.idx`` pair opens (the index
is whole and describes exactly the ``.bin``'s bytes: a truncated ``.bin`` is found here), and the token ids
fit the tokenizer's vocabulary.

    index_problems(prefixes)                     one message per pair that does not open
    max_token_id(prefix, budget)                 (largest id seen, tokens read): a bounded scan
    token_id_problems(prefixes, vocab_size)      one message per dataset holding an id >= vocab_size

The index stores no largest id, so the ids are scanned, within a budget shared by every dataset
(``SCAN_BUDGET_TOKENS``): a dataset that fits is read whole, a larger one in evenly spaced windows
(its first and last tokens included); a dataset whose dtype cannot hold an id that large is not read.
A sample finds data tokenized with another tokenizer (its ids
are everywhere) but can miss a few stray ids; those the model's embedding would still refuse.
Imports only numpy and the standard library.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset, data_file_path

SCAN_BUDGET_TOKENS = 16 * 2**20   # tokens read across all datasets (32 MiB at uint16)
MIN_TOKENS_PER_DATASET = 2**16    # however many datasets share the budget
WINDOWS = 64                      # evenly spaced windows of a dataset larger than its share


def index_problems(prefixes: Sequence[str]) -> list[str]:
    """For each pair of ``prefixes`` that does not open (missing, truncated, corrupt, from different runs): its
    message."""
    problems = []
    for prefix in dict.fromkeys(prefixes):
        try:
            MMapIndexedDataset(prefix)
        except IndexedDatasetError as error:
            problems.append(f"{error}; rebuild {prefix} with tools/preprocess_data.py")
    return problems


def max_token_id(prefix: str, budget_tokens: int = SCAN_BUDGET_TOKENS) -> tuple[int, int]:
    """(largest token id, tokens read) of ``prefix``'s ``.bin``: all of it when it holds at most
    ``budget_tokens`` tokens, else ``WINDOWS`` evenly spaced windows of ``budget_tokens`` in all. -1 when empty."""
    return _max_token_id(prefix, MMapIndexedDataset(prefix).dtype, budget_tokens)


def _max_token_id(prefix: str, dtype: np.dtype, budget_tokens: int) -> tuple[int, int]:
    path = data_file_path(prefix)
    if os.path.getsize(path) == 0:
        return -1, 0
    tokens = np.memmap(path, dtype=dtype, mode="r")
    total = len(tokens)
    if total <= budget_tokens:
        return int(tokens.max()), total
    window = max(1, budget_tokens // WINDOWS)
    starts = np.linspace(0, total - window, WINDOWS).astype(np.int64)
    return max(int(tokens[start:start + window].max()) for start in starts), window * WINDOWS


def token_id_problems(prefixes: Sequence[str], vocab_size: int,
                      budget_tokens: int = SCAN_BUDGET_TOKENS) -> list[str]:
    """For each dataset of ``prefixes`` whose scanned ids reach ``vocab_size`` or beyond: its message (pairs
    that are missing or do not open are left to ``index_problems``). A dataset whose token dtype cannot hold
    an id that large (uint16 data, a 250k vocabulary) is not read."""
    dtypes = {}
    for prefix in dict.fromkeys(prefixes):
        try:
            dtypes[prefix] = MMapIndexedDataset(prefix).dtype
        except IndexedDatasetError:
            continue
    to_scan = [prefix for prefix, dtype in dtypes.items() if np.iinfo(dtype).max >= vocab_size]
    share = max(MIN_TOKENS_PER_DATASET, budget_tokens // max(1, len(to_scan)))
    problems = []
    for prefix in to_scan:
        largest, read = _max_token_id(prefix, dtypes[prefix], share)
        if largest >= vocab_size:
            problems.append(f"{prefix}.bin holds token id {largest} (among {read} tokens read), beyond the "
                            f"tokenizer's vocabulary of {vocab_size}: the data was tokenized with another tokenizer; "
                            f"pass that tokenizer, or tokenize the data again with this one (tools/preprocess_data.py)")
    return problems
