"""GPTDataset: Megatron sample semantics, the C++ index against a plain reference, the index cache,
build-on-one-rank and train/valid/test (and weighted split group) construction."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.config import DatasetGroup, DatasetSplit
from megatron.data import _helpers
from megatron.data.gpt_dataset import (
    GPTDataset,
    build_doc_idx,
    build_group_dataset,
    build_train_valid_test_datasets,
    build_weighted_split_datasets,
    num_epochs_needed,
    separate_last_epoch,
)
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder


def make_dataset(prefix, num_docs=40, max_len=30, seed=0):
    rng = np.random.default_rng(seed)
    builder = MMapIndexedDatasetBuilder(prefix, np.uint16)
    for n in rng.integers(1, max_len, size=num_docs):
        builder.add_item(rng.integers(0, 1000, size=int(n)))
        builder.end_document()
    builder.finalize()
    return str(prefix), MMapIndexedDataset(prefix)


@pytest.fixture
def synthetic(tmp_path):
    return make_dataset(tmp_path / "syn")


def reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Plain reference: sample k starts at stream position k * seq_length; locate it by searchsorted."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    starts = np.concatenate([[0], np.cumsum(sizes[doc_idx].astype(np.int64))])
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(starts, positions, side="right") - 1  # skips empty documents
    offsets = positions - starts[doc_pos]
    result = np.stack([doc_pos, offsets], axis=1)
    result[0] = (0, 0)  # Megatron starts at the first doc_idx entry even when it is empty
    return result


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), min_size=1, max_size=30), seq_length=st.integers(1, 40),
       num_epochs=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_cpp_sample_idx_matches_reference(sizes, seq_length, num_epochs, seed):
    sizes = np.array(sizes, np.int32)
    tokens_per_epoch = int(sizes.sum())
    if tokens_per_epoch < 2:
        return
    doc_idx = np.tile(np.arange(len(sizes)), num_epochs)
    np.random.RandomState(seed).shuffle(doc_idx)
    got = _helpers.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, reference_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch))


def test_cpp_sample_idx_rejects_bad_input():
    sizes = np.array([5, 5], np.int32)
    with pytest.raises(IndexError, match="ran out of documents"):  # pybind11 maps out_of_range
        _helpers.build_sample_idx(sizes, np.array([0], np.int64), 2, 1, 10)
    with pytest.raises(IndexError, match="not a document id"):
        _helpers.build_sample_idx(sizes, np.array([0, 7], np.int64), 2, 1, 10)
    with pytest.raises(ValueError, match="positive"):
        _helpers.build_sample_idx(sizes, np.array([0, 1], np.int64), 0, 1, 10)
    assert _helpers.sum_int32(np.arange(4, dtype=np.int32)) == 6


def unshuffled_samples(dataset):
    order = np.argsort(np.asarray(dataset.shuffle_idx))  # position in the served order of sample k
    return [dataset[int(i)]["text"] for i in order]


@pytest.mark.parametrize("num_samples", [5, 30, 70])  # within one epoch, several epochs
def test_samples_reproduce_token_stream(synthetic, num_samples):
    prefix, indexed = synthetic
    documents = np.arange(5, 35)
    seq_length = 16
    ds = GPTDataset("train", prefix, documents, indexed, num_samples, seq_length, seed=3)
    assert len(ds) >= num_samples
    samples = unshuffled_samples(ds)
    assert all(s.shape == (seq_length + 1,) and s.dtype == np.int64 for s in samples)
    stream = np.concatenate([indexed[int(d)] for d in ds.doc_idx]).astype(np.int64)
    rebuilt = np.concatenate([samples[0]] + [s[1:] for s in samples[1:]])  # drop the shared token
    np.testing.assert_array_equal(rebuilt, stream[: len(rebuilt)])
    assert len(stream) - len(rebuilt) < seq_length  # the leftover is less than one sample
    assert set(np.asarray(ds.doc_idx).tolist()) == set(documents.tolist())
    epochs = len(ds.doc_idx) // len(documents)
    assert epochs == num_epochs_needed(int(indexed.sizes[documents].sum()), seq_length, num_samples)


def test_epoch_rules_match_megatron_loop():
    def megatron_num_epochs(tokens_per_epoch, seq_length, num_samples):
        epochs, total = 0, 0
        while True:
            epochs, total = epochs + 1, total + tokens_per_epoch
            if (total - 1) // seq_length >= num_samples:
                return epochs

    for tokens, seq, n in [(100, 10, 1), (100, 10, 9), (100, 10, 10), (100, 10, 55), (7, 3, 40), (2, 1, 1)]:
        assert num_epochs_needed(tokens, seq, n) == megatron_num_epochs(tokens, seq, n)
    # 2 epochs of 9 samples (1000 tokens, seq 111); the second epoch's share decides.
    assert separate_last_epoch(1000, 111, 10, 2) is True     # 1 of 8 samples used: < 80 %
    assert separate_last_epoch(1000, 111, 17, 2) is False    # 8 of 8 used
    assert separate_last_epoch(1000, 111, 5, 1) is False
    rng = np.random.RandomState(0)
    doc_idx = build_doc_idx(np.arange(10, 14), 3, rng, separate_last=True)
    assert sorted(doc_idx[8:].tolist()) == [10, 11, 12, 13]  # the last epoch is shuffled on its own


def test_reference_data_samples(shared_data, tmp_path):
    prefix = str(shared_data / "gpt2/meg-gpt2-openwebtext_text_document")
    indexed = MMapIndexedDataset(prefix)
    ds = GPTDataset("train", prefix, np.arange(1000), indexed, 200, 128, seed=1234, cache_dir=str(tmp_path))
    for i in (0, 1, 199):
        text = ds[i]["text"]
        assert text.shape == (129,) and text.min() >= 0 and text.max() <= 4999
    assert len(os.listdir(tmp_path)) == 4  # three .npy files and the description


def cache_state(ds_paths):
    return {k: (os.stat(p).st_ino, os.stat(p).st_mtime_ns) for k, p in ds_paths.items()}


def test_index_cache_reused_and_rebuilt(synthetic, tmp_path):
    prefix, indexed = synthetic
    documents = np.arange(40)
    args = dict(name="train", data_prefix=prefix, documents=documents, indexed_dataset=indexed,
                num_samples=20, seq_length=8, seed=1, cache_dir=str(tmp_path / "cache"))
    first = GPTDataset(**args)
    assert first.built_index
    paths = first.cache_paths(documents, args["cache_dir"])
    before = cache_state(paths)
    again = GPTDataset(**args)
    assert not again.built_index and cache_state(paths) == before
    assert isinstance(again.sample_idx, np.memmap)
    np.testing.assert_array_equal(again[7]["text"], first[7]["text"])
    for change in ({"seed": 2}, {"seq_length": 9}, {"num_samples": 21}, {"documents": np.arange(39)}):
        changed = GPTDataset(**{**args, **change})
        assert changed.built_index, change
        assert changed.cache_paths(change.get("documents", documents), args["cache_dir"]) != paths
        assert GPTDataset(**{**args, **change}).built_index is False, change  # and reused next time
    assert cache_state(paths) == before
    assert not any(".tmp-" in name for name in os.listdir(tmp_path / "cache"))
    # The same prefix regenerated with other documents (same count) must not reuse the old index.
    _, regenerated = make_dataset(prefix, num_docs=40, seed=99)
    assert GPTDataset(**{**args, "indexed_dataset": regenerated}).built_index


def test_one_rank_builds_others_wait(synthetic, tmp_path):
    prefix, indexed = synthetic
    calls = []
    args = ("valid", prefix, np.arange(40), indexed, 10, 8, 5)
    with pytest.raises(FileNotFoundError, match="missing after the barrier"):
        GPTDataset(*args, cache_dir=str(tmp_path), build=False, barrier=lambda: calls.append("waiter"))
    builder = GPTDataset(*args, cache_dir=str(tmp_path), build=True, barrier=lambda: calls.append("builder"))
    waiter = GPTDataset(*args, cache_dir=str(tmp_path), build=False, barrier=lambda: calls.append("waiter"))
    assert calls == ["waiter", "builder", "waiter"]  # every rank calls the barrier exactly once
    assert builder.built_index and not waiter.built_index
    np.testing.assert_array_equal(waiter.shuffle_idx, builder.shuffle_idx)


def test_build_train_valid_test_from_reference(shared_data, tmp_path):
    prefix = str(shared_data / "gpt2/meg-gpt2-openwebtext_text_document")
    train, valid, test = build_train_valid_test_datasets(prefix, "969,30,1", [100, 10, 0], 64, 7,
                                                         cache_dir=str(tmp_path))
    assert test is None
    assert set(np.asarray(train.doc_idx).tolist()) == set(range(969))
    assert set(np.asarray(valid.doc_idx).tolist()) == set(range(969, 999))
    assert len(train) >= 100 and valid[0]["text"].shape == (65,)


def test_blended_and_weighted_split_groups(synthetic, tmp_path):
    prefix_a, _ = synthetic
    prefix_b, _ = make_dataset(tmp_path / "other", num_docs=60, seed=1)
    cache = str(tmp_path / "cache")
    train, valid, test = build_train_valid_test_datasets(["0.3", prefix_a, "0.7", prefix_b], "8,2,0",
                                                         [50, 10, 0], 8, 1, cache_dir=cache)
    assert len(train) == 50 and len(valid) == 10 and test is None
    assert [len(d) >= n for d, n in zip(train.datasets, (16, 36))] == [True, True]  # ceil(w*50*1.005)
    assert np.array_equal(train.weights, [0.3, 0.7])  # exact: normalize_weights' w / 1.0
    # DataConfig.data_path's (weight, prefix) pairs build the same blend.
    same = build_train_valid_test_datasets(((3.0, prefix_a), (7.0, prefix_b)), "8,2,0", [50, 10, 0], 8, 1,
                                           cache_dir=cache)[0]
    assert np.array_equal(same.weights, [0.3, 0.7]) and [same[i]["text"].tolist() for i in range(5)] == \
        [train[i]["text"].tolist() for i in range(5)]
    with pytest.raises(ValueError, match="--data-path is empty"):
        build_train_valid_test_datasets([], "1", [1, 0, 0], 8, 1)

    # DataConfig's DatasetGroup objects and group strings are accepted alike.
    valid_a = DatasetGroup("VALID_A", (DatasetSplit(1.0, 0.8, 1.0, prefix_a),))
    train, valid, test = build_weighted_split_datasets(
        [f"TRAIN: 0.6 0:0.8 {prefix_a}, 0.4 0:0.8 {prefix_b}"],
        [valid_a, f"VALID_AB: 0.5 0.8:1 {prefix_a}, 0.5 0.8:1 {prefix_b}"],
        [], [40, 6, 0], 8, 1, cache_dir=cache)
    assert len(train) == 40 and test == {}
    assert np.array_equal(train.weights, [0.6, 0.4])  # exact: w / 1.0
    assert set(np.asarray(train.datasets[0].doc_idx).tolist()) == set(range(32))   # 0:0.8 of 40 documents
    assert sorted(valid) == ["VALID_A", "VALID_AB"] and len(valid["VALID_AB"]) == 6
    assert set(np.asarray(valid["VALID_A"].doc_idx).tolist()) == set(range(32, 40))
    with pytest.raises(ValueError, match="--train-weighted-split-paths takes one group"):
        build_weighted_split_datasets([f"A: 1 0:1 {prefix_a}", f"B: 1 0:1 {prefix_a}"], [], [], [1, 0, 0], 8, 1)
    with pytest.raises(ValueError, match=r"--valid-weighted-split-paths: group names must be unique"):
        build_weighted_split_datasets([], [valid_a, valid_a], [], [0, 1, 0], 8, 1)
    with pytest.raises(ValueError, match=r"--test-weighted-split-paths: '1 0:1' in group 'T'"):
        build_group_dataset("T: 1 0:1", "test", 1, 8, 1)
    with pytest.raises(ValueError, match=r"group 'TINY': range 0.0:0.01 of .* holds no documents \(it has 40\)"):
        build_group_dataset(DatasetGroup("TINY", (DatasetSplit(1.0, 0.0, 0.01, prefix_a),)), "valid", 1, 8, 1,
                            cache_dir=cache)


def _build_on_rank_zero(rank, world_size, prefix, cache_dir):
    import time

    if rank == 0:
        time.sleep(0.5)  # rank 1 reaches the cache first: it must wait for rank 0, not fail or build
    indexed = MMapIndexedDataset(prefix)
    ds = GPTDataset("train", prefix, np.arange(40), indexed, 25, 8, 11, cache_dir=cache_dir)
    return ds.built_index, np.asarray(ds.shuffle_idx).tolist()


@pytest.mark.multiprocess
def test_torch_distributed_default_rank_zero_builds(synthetic, tmp_path):
    from megatron.testing.processes import run_distributed

    prefix, _ = synthetic
    results = run_distributed(_build_on_rank_zero, world_size=2, args=(prefix, str(tmp_path)), timeout=120)
    assert [built for built, _ in results] == [True, False]
    assert results[0][1] == results[1][1]
