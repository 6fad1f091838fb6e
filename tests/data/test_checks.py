"""The data checks a launch and the dry run make before any process group: a pair that does not open (a
truncated .bin) and token ids beyond the tokenizer's vocabulary, found by a bounded scan."""

import os

import numpy as np

from megatron.data.checks import index_problems, max_token_id, token_id_problems
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder


def _dataset(prefix, documents, dtype=np.uint16) -> str:
    with MMapIndexedDatasetBuilder(str(prefix), dtype=dtype) as builder:
        for tokens in documents:
            builder.add_item(np.asarray(tokens))
            builder.end_document()
        builder.finalize()
    return str(prefix)


def test_a_truncated_bin_is_named_with_its_sizes(tmp_path):
    whole = _dataset(tmp_path / "whole", [range(10)] * 4)
    cut = _dataset(tmp_path / "cut", [range(10)] * 4)
    os.truncate(cut + ".bin", 62)  # 80 bytes written: 4 x 10 uint16 tokens
    problems = index_problems([whole, cut, cut])
    assert len(problems) == 1, problems  # the whole pair opens; the cut one is named once
    assert f"data file for {cut}.idx is 62 bytes but the index describes 80 bytes" in problems[0]
    assert problems[0].endswith(f"rebuild {cut} with tools/preprocess_data.py")


def test_the_largest_id_is_read_whole_within_the_budget_and_in_windows_beyond_it(tmp_path):
    tokens = np.zeros(100_000, np.int64)
    tokens[50_000] = 7  # one stray id mid-file: a full scan finds it, 64 windows of 100 tokens do not
    tokens[-1] = 5      # the last token is always in the last window
    prefix = _dataset(tmp_path / "d", [tokens])
    assert max_token_id(prefix, budget_tokens=200_000) == (7, 100_000)
    assert max_token_id(prefix, budget_tokens=6_400) == (5, 6_400)
    assert max_token_id(_dataset(tmp_path / "empty", []), budget_tokens=10) == (-1, 0)


def test_ids_beyond_the_vocabulary_are_refused_naming_the_dataset_the_id_and_the_vocabulary(tmp_path):
    small = _dataset(tmp_path / "small", [range(300)])
    other = _dataset(tmp_path / "other_tokenizer", [np.arange(1000) % 450])
    assert token_id_problems([small, other], vocab_size=400) == [
        f"{other}.bin holds token id 449 (among 1000 tokens read), beyond the tokenizer's vocabulary of 400: the data "
        "was tokenized with another tokenizer; pass that tokenizer, or tokenize the data again with this one "
        "(tools/preprocess_data.py)"]
    assert token_id_problems([small, other], vocab_size=450) == []
