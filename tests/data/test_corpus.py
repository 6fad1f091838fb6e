"""The offline default corpus: deterministic bytes, usable outputs, completion-marker semantics."""

import json
import os

import numpy as np
import pytest

from megatron.data import corpus
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.tokenizers import GPT2BPETokenizer

SMALL = dict(min_bytes=150_000, vocab_size=400)
OUTPUTS = ["corpus.jsonl", "tokenizer/vocab.json", "tokenizer/merges.txt", "tokenizer/tokenizer.json",
           "corpus_text_document.bin", "corpus_text_document.idx"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("corpus") / "a"
    return out_dir, corpus.prepare_default_corpus(out_dir, workers=1, **SMALL)


def _contents(out_dir):
    return {name: (out_dir / name).read_bytes() for name in OUTPUTS}


def test_two_builds_are_byte_identical_whatever_the_workers(built, tmp_path):
    out_dir, result = built
    other = corpus.prepare_default_corpus(tmp_path / "b", workers=2, **SMALL)
    assert not result["reused"] and not other["reused"]
    assert _contents(out_dir) == _contents(tmp_path / "b")
    assert result["files"] == other["files"]


def test_outputs_are_a_usable_dataset(built):
    out_dir, result = built
    assert result["text_bytes"] >= SMALL["min_bytes"]
    with open(result["jsonl"], encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    assert len(docs) == result["num_docs"]
    assert docs[0]["source"].startswith("stdlib/")  # sorted walk: the standard library comes first
    tokenizer = GPT2BPETokenizer(result["vocab_file"], result["merge_file"])
    dataset = MMapIndexedDataset(result["data_prefix"])
    assert len(dataset) == len(docs) and int(dataset.sizes.sum()) == result["num_tokens"]
    for i in (0, len(docs) - 1):
        tokens = dataset.get(i)
        assert int(tokens[-1]) == tokenizer.eod == 0
        assert tokenizer.detokenize(tokens[:-1].tolist()) == docs[i]["text"]


def test_complete_corpus_is_reused_and_incomplete_one_rebuilt(built, tmp_path):
    out_dir, result = built
    again = corpus.prepare_default_corpus(out_dir, **SMALL)
    assert again["reused"] and again["files"] == result["files"]

    os.remove(out_dir / corpus.MARKER)  # a crash before the marker: must be rebuilt, not used
    (out_dir / "corpus_text_document.bin").write_bytes(b"half")
    rebuilt = corpus.prepare_default_corpus(out_dir, **SMALL)
    assert not rebuilt["reused"] and rebuilt["files"] == result["files"]

    with open(out_dir / "corpus_text_document.bin", "r+b") as f:  # marker present, data truncated
        f.truncate(10)
    repaired = corpus.prepare_default_corpus(out_dir, **SMALL)
    assert not repaired["reused"] and repaired["files"] == result["files"]
    np.testing.assert_array_equal(MMapIndexedDataset(result["data_prefix"]).sizes,
                                  MMapIndexedDataset(rebuilt["data_prefix"]).sizes)


def test_other_parameters_rebuild(built, tmp_path):
    _, result = built
    first = corpus.prepare_default_corpus(tmp_path, **SMALL)
    other = corpus.prepare_default_corpus(tmp_path, min_bytes=SMALL["min_bytes"], vocab_size=300)
    assert first["files"] == result["files"]
    assert not other["reused"] and other["params"]["vocab_size"] == 300
    assert other["files"]["corpus.jsonl"] == result["files"]["corpus.jsonl"]
    with pytest.raises(ValueError, match="vocab_size=100"):
        corpus.prepare_default_corpus(tmp_path, vocab_size=100)
