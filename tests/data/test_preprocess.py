"""tools/preprocess_data.py and tools/merge_datasets.py: byte-identical to Megatron's golden output,
bad-line handling, gzip input, several keys, merging."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.config import TokenizerConfig
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import BadInputLine, PreprocessConfig, preprocess
from tests.helpers.paths import REPO_ROOT
from tools import merge_datasets, preprocess_data

GOLDEN = "meg-gpt2-openwebtext_text_document"


@pytest.fixture(scope="module")
def gpt2(shared_data):
    return shared_data / "gpt2"


def _tokenizer_flags(gpt2):
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(gpt2 / "gpt2-tiny-vocab.json"),
            "--merge-file", str(gpt2 / "gpt2-tiny-merges.txt")]


def _spec(gpt2):
    return TokenizerConfig("GPT2BPETokenizer", str(gpt2 / "gpt2-tiny-vocab.json"), str(gpt2 / "gpt2-tiny-merges.txt"))


def _assert_same_pair(prefix, reference):
    for suffix in (".bin", ".idx"):
        with open(f"{prefix}{suffix}", "rb") as a, open(f"{reference}{suffix}", "rb") as b:
            assert a.read() == b.read(), f"{prefix}{suffix} differs from {reference}{suffix}"


def _write_jsonl(path, records):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(record if isinstance(record, str) else json.dumps(record))
            f.write("\n")
    return str(path)


def _docs(gpt2, n):
    with open(gpt2 / "openwebtext-1000.jsonl", encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_golden_bytes_as_a_user_runs_it_with_two_workers(gpt2, tmp_path):
    prefix = tmp_path / "meg-gpt2-openwebtext"
    cmd = [sys.executable, "tools/preprocess_data.py", "--input", str(gpt2 / "openwebtext-1000.jsonl"),
           "--output-prefix", str(prefix), *_tokenizer_flags(gpt2), "--append-eod", "--workers", "2",
           "--chunk-size", "64"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    _assert_same_pair(f"{prefix}_text_document", gpt2 / GOLDEN)


def test_golden_bytes_with_one_worker_in_process(gpt2, tmp_path):
    prefix = tmp_path / "one"
    argv = ["--input", str(gpt2 / "openwebtext-1000.jsonl"), "--output-prefix", str(prefix),
            *_tokenizer_flags(gpt2), "--append-eod", "--workers", "1", "--log-interval", "0"]
    assert preprocess_data.main(argv) == 0
    _assert_same_pair(f"{prefix}_text_document", gpt2 / GOLDEN)


def _bad_input(tmp_path, docs):
    return _write_jsonl(tmp_path / "bad.jsonl", [docs[0], docs[1], '{"text": "unterminated', docs[2],
                                                 {"title": "no text key"}, {"text": 7}, docs[3]])


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_line_stops_the_run_naming_file_and_line(gpt2, tmp_path, workers):
    docs = _docs(gpt2, 4)
    path = _bad_input(tmp_path, docs)
    out = tmp_path / "out"
    # An earlier complete pair at the target survives a failed run untouched (the run writes temporary
    # files and renames them only at the end).
    preprocess(PreprocessConfig(input=_write_jsonl(tmp_path / "ok.jsonl", docs), output_prefix=str(out),
                                tokenizer=_spec(gpt2), log_interval=0))
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if name.startswith("out")}
    config = PreprocessConfig(input=path, output_prefix=str(out), tokenizer=_spec(gpt2), workers=workers,
                              chunk_size=2, log_interval=0)
    with pytest.raises(BadInputLine) as info:
        preprocess(config)
    assert (info.value.path, info.value.line_number) == (path, 3)
    assert f"{path}:3:" in str(info.value)
    after = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if name.startswith("out")}
    assert sorted(before) == ["out_text_document.bin", "out_text_document.idx"] and after == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "ok.jsonl", *sorted(before)]  # no temporary file left


def test_an_input_without_documents_is_refused_and_writes_nothing(gpt2, tmp_path):
    path = _write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(ValueError, match=r"empty.jsonl holds no documents .*nothing written"):
        preprocess(PreprocessConfig(input=path, output_prefix=str(tmp_path / "out"), tokenizer=_spec(gpt2),
                                    log_interval=0))
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl"]
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "preprocess_data.py"), "--input", path,
                             "--output-prefix", str(tmp_path / "out"), *_tokenizer_flags(gpt2)],
                            capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.startswith("error: ") and "no documents" in result.stderr


def test_missing_key_names_line_and_key(gpt2, tmp_path):
    path = _write_jsonl(tmp_path / "in.jsonl", _docs(gpt2, 2) + [{"title": "x"}])
    config = PreprocessConfig(input=path, output_prefix=str(tmp_path / "o"), tokenizer=_spec(gpt2), log_interval=0)
    with pytest.raises(BadInputLine, match=r"in.jsonl:3: key\(s\) \['text'\]") as info:
        preprocess(config)
    assert info.value.line_number == 3
    assert preprocess_data.main(["--input", path, "--output-prefix", str(tmp_path / "o"),
                                 *_tokenizer_flags(gpt2)]) == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_bad_lines_skips_and_counts(gpt2, tmp_path, workers):
    docs = _docs(gpt2, 4)
    config = PreprocessConfig(input=_bad_input(tmp_path, docs), output_prefix=str(tmp_path / "skip"),
                              tokenizer=_spec(gpt2), append_eod=True, workers=workers, chunk_size=2,
                              skip_bad_lines=True, log_interval=0)
    stats = preprocess(config)
    assert (stats.num_bad_lines, stats.num_docs) == (3, 4)
    clean = preprocess(PreprocessConfig(input=_write_jsonl(tmp_path / "clean.jsonl", docs),
                                        output_prefix=str(tmp_path / "clean"), tokenizer=_spec(gpt2),
                                        append_eod=True, log_interval=0))
    assert clean.num_tokens == stats.num_tokens
    _assert_same_pair(tmp_path / "skip_text_document", tmp_path / "clean_text_document")


def test_gzip_input_gives_the_same_bytes(gpt2, tmp_path):
    docs = _docs(gpt2, 20)
    outputs = []
    for name in ("plain.jsonl", "packed.jsonl.gz"):
        prefix = tmp_path / name.split(".")[0]
        assert preprocess_data.main(["--input", _write_jsonl(tmp_path / name, docs), "--output-prefix",
                                     str(prefix), *_tokenizer_flags(gpt2), "--append-eod"]) == 0
        outputs.append(f"{prefix}_text_document")
    _assert_same_pair(*outputs)
    assert len(MMapIndexedDataset(outputs[0])) == 20


def test_several_keys_blank_and_empty_documents(gpt2, tmp_path):
    records = [{"text": "first text", "title": "One"}, "", {"text": "", "title": "Two"},
               {"text": "third", "title": "Three"}]
    config = PreprocessConfig(input=_write_jsonl(tmp_path / "in.jsonl", records), output_prefix=str(tmp_path / "k"),
                              tokenizer=_spec(gpt2), json_keys=("text", "title"), append_eod=True, log_interval=0)
    stats = preprocess(config)
    assert (stats.num_docs, stats.num_empty_docs) == (3, 1)  # the blank line is no document
    text = MMapIndexedDataset(tmp_path / "k_text_document")
    title = MMapIndexedDataset(tmp_path / "k_title_document")
    assert (len(text), len(title)) == (2, 3)  # as Megatron, an empty document is dropped
    assert text.doc_idx.tolist() == [0, 1, 2]
    assert all(int(title.get(i)[-1]) == 4999 for i in range(3))


def test_only_mmap_is_written(gpt2, tmp_path):
    config = PreprocessConfig(input=_write_jsonl(tmp_path / "in.jsonl", _docs(gpt2, 1)),
                              output_prefix=str(tmp_path / "o"), tokenizer=_spec(gpt2), dataset_impl="lazy")
    with pytest.raises(ValueError, match="--dataset-impl 'lazy'"):
        preprocess(config)


def test_merge_tool_equals_preprocessing_the_concatenation(gpt2, tmp_path):
    docs = _docs(gpt2, 30)
    parts = [docs[:7], docs[7:8], docs[8:]]
    prefixes = []
    for i, part in enumerate(parts + [docs]):
        prefix = tmp_path / f"part{i}"
        preprocess(PreprocessConfig(input=_write_jsonl(tmp_path / f"part{i}.jsonl", part), output_prefix=str(prefix),
                                    tokenizer=_spec(gpt2), append_eod=True, log_interval=0))
        prefixes.append(f"{prefix}_text_document")
    whole = prefixes.pop()
    merged = str(tmp_path / "merged")
    assert merge_datasets.main(["--input", *prefixes, "--output-prefix", merged]) == 0
    _assert_same_pair(merged, whole)
    dataset, pieces = MMapIndexedDataset(merged), [MMapIndexedDataset(p) for p in prefixes]
    assert dataset.doc_idx.tolist() == list(range(31))
    np.testing.assert_array_equal(np.concatenate([p.get(i) for p in pieces for i in range(len(p))]),
                                  np.concatenate([dataset.get(i) for i in range(len(dataset))]))


def test_a_document_longer_than_a_piece_gives_the_ids_of_the_whole(gpt2, tmp_path):
    """Long documents are tokenized in pieces (bounded memory: benchmarks/bench_long_document.py);
    the dataset holds exactly the ids of the whole text, beside short documents in the same chunk."""
    from megatron.data.tokenizers import LONG_TEXT_CHARS, GPT2BPETokenizer

    texts = [d["text"] for d in _docs(gpt2, 200)]
    long_text = "  ".join(texts)  # double spaces too: cut points must respect whitespace runs
    assert len(long_text) > 2 * LONG_TEXT_CHARS
    records = [{"text": "a short one"}, {"text": long_text}, {"text": "and another"}]
    config = PreprocessConfig(input=_write_jsonl(tmp_path / "in.jsonl", records), output_prefix=str(tmp_path / "long"),
                              tokenizer=_spec(gpt2), append_eod=True, log_interval=0)
    preprocess(config)
    tokenizer = GPT2BPETokenizer(gpt2 / "gpt2-tiny-vocab.json", gpt2 / "gpt2-tiny-merges.txt")
    written = MMapIndexedDataset(tmp_path / "long_text_document")
    for i, record in enumerate(records):
        np.testing.assert_array_equal(written.get(i), np.array(tokenizer.tokenize(record["text"]) + [4999]))
