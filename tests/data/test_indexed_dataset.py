"""Megatron mmap indexed dataset: golden reference files, byte-identical writer, atomic finalize,
and every corrupt pair rejected with IndexedDatasetError."""

import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.data import indexed_dataset as idx_mod
from megatron.data.indexed_dataset import (
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_dtype,
    merge_datasets,
)

REFERENCE = "gpt2/meg-gpt2-openwebtext_text_document"


def parse_plainly(prefix):
    """Independent parse of a Megatron pair with struct + np.frombuffer (no project code)."""
    raw = open(f"{prefix}.idx", "rb").read()
    magic, version, code, n, m = struct.unpack("<9sQBQQ", raw[:34])
    sizes = np.frombuffer(raw, np.int32, n, 34)
    pointers = np.frombuffer(raw, np.int64, n, 34 + 4 * n)
    doc_idx = np.frombuffer(raw, np.int64, m, 34 + 12 * n)
    return magic, version, code, sizes, pointers, doc_idx


def write_dataset(prefix, documents, dtype=np.uint16):
    builder = MMapIndexedDatasetBuilder(prefix, dtype)
    for doc in documents:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize()
    return str(prefix)


@pytest.fixture
def small_pair(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 5000, size=int(n)) for n in rng.integers(1, 40, size=12)]
    return write_dataset(tmp_path / "small", docs), docs


def test_reads_reference_files(shared_data):
    prefix = str(shared_data / REFERENCE)
    magic, version, code, sizes, pointers, doc_idx = parse_plainly(prefix)
    assert (magic, version, code, len(sizes), len(doc_idx)) == (b"MMIDIDX\x00\x00", 1, 8, 1000, 1001)
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 1000 and ds.dtype == np.uint16
    np.testing.assert_array_equal(ds.sizes, sizes)
    np.testing.assert_array_equal(ds.doc_idx, doc_idx)
    assert ds.sizes.dtype == np.int32 and ds.doc_idx.dtype == np.int64
    assert int(ds.sizes.sum()) == 1_361_845
    data = open(f"{prefix}.bin", "rb").read()
    starts = np.concatenate([[0], np.cumsum(sizes.astype(np.int64) * 2)])  # from sizes, not pointers
    for i in (0, 500, 999):
        expected = np.frombuffer(data, np.uint16, int(sizes[i]), int(starts[i]))
        np.testing.assert_array_equal(ds[i], expected)
        assert ds[i][-1] == 4999  # end-of-document token
    assert ds.get(500, offset=3, length=7).tolist() == ds[500][3:10].tolist()


def test_writer_is_byte_identical_to_reference(shared_data, tmp_path):
    ref = MMapIndexedDataset(shared_data / REFERENCE)
    out = tmp_path / "copy"
    with MMapIndexedDatasetBuilder(str(out) + ".bin", best_dtype(5000)) as builder:
        for i in range(len(ref)):
            tokens = ref[i].astype(np.int64)
            builder.add_item(torch.from_numpy(tokens) if i % 2 else tokens)  # tensors and arrays
            builder.end_document()
        builder.finalize()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"copy{suffix}").read_bytes() == (shared_data / (REFERENCE + suffix)).read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["copy.bin", "copy.idx"]  # no temporaries left


def test_get_is_a_view_and_checks_bounds(small_pair):
    prefix, docs = small_pair
    ds = MMapIndexedDataset(prefix)
    view = ds.get(3, offset=1, length=2)
    assert not view.flags.owndata and not view.flags.writeable
    assert view.tolist() == docs[3][1:3].tolist()
    assert ds[-1].tolist() == docs[-1].tolist()
    assert [a.tolist() for a in ds[2:5]] == [d.tolist() for d in docs[2:5]]
    with pytest.raises(IndexError):
        ds.get(3, offset=len(docs[3]), length=1)
    with pytest.raises(IndexError):
        ds[len(docs)]


def test_best_dtype_and_out_of_range_tokens(tmp_path):
    assert best_dtype(50257) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(250880) == np.int32
    builder = MMapIndexedDatasetBuilder(tmp_path / "x", np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        builder.add_item(np.array([1, 70000]))
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_add_document_merge_and_empty(tmp_path, small_pair):
    prefix, docs = small_pair
    builder = MMapIndexedDatasetBuilder(tmp_path / "multi", np.uint16)
    builder.add_document(np.arange(10), lengths=[3, 7])
    builder.add_document(np.arange(4), lengths=[4])
    builder.finalize()
    multi = MMapIndexedDataset(tmp_path / "multi")
    assert multi.sizes.tolist() == [3, 7, 4] and multi.doc_idx.tolist() == [0, 2, 3]
    merge_datasets([prefix, tmp_path / "multi", prefix], tmp_path / "merged")
    merged = MMapIndexedDataset(tmp_path / "merged")
    n = len(docs)
    assert len(merged) == 2 * n + 3
    assert merged.doc_idx.tolist() == list(range(n + 1)) + [n + 2, n + 3] + list(range(n + 4, 2 * n + 4))
    assert merged[n + 1].tolist() == list(range(3, 10)) and merged[2 * n + 2].tolist() == docs[-1].tolist()
    empty = MMapIndexedDatasetBuilder(tmp_path / "empty", np.int32)
    empty.finalize()
    assert len(MMapIndexedDataset(tmp_path / "empty")) == 0
    other = write_dataset(tmp_path / "wide", [[1, 2]], dtype=np.int32)
    with pytest.raises(ValueError, match="dtype"):
        MMapIndexedDatasetBuilder(tmp_path / "bad", np.uint16).merge_file_(other)


def test_interrupted_finalize_never_mixes_old_and_new(tmp_path, monkeypatch):
    prefix = write_dataset(tmp_path / "d", [[1, 2, 3]])
    old_idx = (tmp_path / "d.idx").read_bytes()
    # A run that dies before finalize leaves the old pair untouched and only temporaries.
    unfinished = MMapIndexedDatasetBuilder(prefix, np.uint16)
    unfinished.add_item([9] * 50)
    unfinished.end_document()
    assert (tmp_path / "d.idx").read_bytes() == old_idx and MMapIndexedDataset(prefix)[0].tolist() == [1, 2, 3]
    unfinished.abort()
    # A run that dies between moving the .bin and the .idx leaves no .idx: the pair is not complete.
    builder = MMapIndexedDatasetBuilder(prefix, np.uint16)
    builder.add_item([7] * 5)
    builder.end_document()
    real_replace = os.replace

    def fail_on_idx(src, dst):
        if str(dst).endswith(".idx"):
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(idx_mod.os, "replace", fail_on_idx)
    with pytest.raises(KeyboardInterrupt):
        builder.finalize()
    monkeypatch.undo()
    assert not MMapIndexedDataset.exists(prefix)
    with pytest.raises(IndexedDatasetError, match="d.idx"):
        MMapIndexedDataset(prefix)
    assert sorted(os.listdir(tmp_path)) == ["d.bin"]


# ---- corrupt input: one test each --------------------------------------------------------------

def test_truncated_bin(small_pair):
    prefix, _ = small_pair
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 2)
    with pytest.raises(IndexedDatasetError, match=r"small\.idx.*truncated"):
        MMapIndexedDataset(prefix)


def test_truncated_idx(small_pair):
    prefix, _ = small_pair
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".idx") - 8)
    with pytest.raises(IndexedDatasetError, match=r"small\.idx.*truncated or corrupt"):
        MMapIndexedDataset(prefix)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(20)
    with pytest.raises(IndexedDatasetError, match="header"):
        MMapIndexedDataset(prefix)


def test_wrong_magic(small_pair):
    prefix, _ = small_pair
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"TNTIDX\x00\x00\x00")  # the old non-mmap format's magic
    with pytest.raises(IndexedDatasetError, match="magic"):
        MMapIndexedDataset(prefix)


def test_size_pointing_past_end_of_bin(small_pair):
    prefix, docs = small_pair
    n = len(docs)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(34 + 4 * (n - 1))  # last entry of sizes
        f.write(struct.pack("<i", len(docs[-1]) + 1))
    with pytest.raises(IndexedDatasetError, match="truncated, or the .bin and .idx come from different runs"):
        MMapIndexedDataset(prefix)


def test_inconsistent_pointer_and_bad_header_fields(small_pair):
    prefix, docs = small_pair
    raw = bytearray(open(prefix + ".idx", "rb").read())
    for offset, value, message in [(34 + 4 * len(docs) + 8 * 3, b"\x00" * 8, "pointer of sequence 3"),
                                   (9, b"\x02", "version 2"), (17, b"\x06", "dtype code 6")]:
        corrupt = bytearray(raw)
        corrupt[offset:offset + len(value)] = value
        open(prefix + ".idx", "wb").write(corrupt)
        with pytest.raises(IndexedDatasetError, match=message):
            MMapIndexedDataset(prefix)


def _open_checked(prefix):
    """Open a pair; if it opens, every read must stay inside the .bin. Only IndexedDatasetError may escape."""
    try:
        ds = MMapIndexedDataset(prefix)
    except IndexedDatasetError:
        return
    total = sum(len(ds[i]) for i in range(len(ds)))
    assert total * ds.dtype.itemsize == os.path.getsize(prefix + ".bin")
    assert ds.doc_idx[0] == 0 and np.all(np.diff(ds.doc_idx) >= 0)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(blob=st.binary(max_size=200))
def test_fuzz_random_idx_bytes(tmp_path, blob):
    prefix = str(tmp_path / "fuzz")
    open(prefix + ".bin", "wb").write(b"\x01\x00" * 16)
    for head in (b"", idx_mod.MAGIC + struct.pack("<Q", 1)):  # random, and random after a valid start
        open(prefix + ".idx", "wb").write(head + blob)
        _open_checked(prefix)


@FUZZ
@given(data=st.data())
def test_fuzz_mutated_valid_idx(tmp_path, data):
    prefix = write_dataset(tmp_path / "m", [[1, 2, 3], [4], [5, 6]])
    raw = bytearray(open(prefix + ".idx", "rb").read())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
        if kind == "flip" and raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        elif kind == "truncate":
            raw = raw[: data.draw(st.integers(0, len(raw)))]
        else:
            raw += data.draw(st.binary(min_size=1, max_size=16))
    open(prefix + ".idx", "wb").write(raw)
    _open_checked(prefix)
