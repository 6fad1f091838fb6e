"""GPT pretraining samples over a Megatron indexed dataset, with Megatron's index semantics.

A ``GPTDataset`` views the documents ``documents`` (ids into the indexed dataset, one sequence
per document, as Megatron's GPT tools write them) as one token stream per epoch and cuts it into
samples of ``seq_length + 1`` tokens (inputs and shifted labels); consecutive samples share one
token. Three index arrays define it, all derived deterministically from the seed:

    doc_idx      int64 [num_epochs * num_docs]  document order, shuffled with RandomState(seed)
    sample_idx   int64 [num_samples + 1, 2]     (position in doc_idx, offset) where each sample
                                                starts (built in C++, ``_helpers.build_sample_idx``)
    shuffle_idx  [num_samples]                  order in which samples are served

Megatron's epoch rule: take as many epochs as needed to cover ``num_samples``; if the last epoch
would contribute fewer than 80 % of an epoch's samples, it is shuffled separately (documents and
samples), so its partial use does not skew the earlier epochs' mix.

The arrays are cached as ``.npy`` files (beside the data, or in ``cache_dir``) whose names carry a
hash of everything that changes them; each file is written to a temporary name and renamed.

One rank builds, the others wait (``build`` / ``barrier`` arguments): the caller decides which
rank builds (default: global rank 0 when torch.distributed is initialized, else this process),
and all ranks call ``barrier()`` exactly once, the builder after writing, the others before
loading. The default barrier is the global ``torch.distributed.barrier()``, so it needs EVERY
rank to construct the dataset; where only some ranks do (Megatron builds data on tensor-parallel
rank 0 only), pass ``build`` and a ``barrier`` over exactly those ranks, e.g.
``lambda: dist.barrier(group=g)``. On a cluster without a shared filesystem, pass
``build=(local_rank == 0)`` and a node-local barrier.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Callable

import numpy as np

from megatron.data import _helpers
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import (
    SPLIT_NAMES,
    document_range,
    normalize_weights,
    parse_data_path,
    parse_group,
    parse_split,
    parse_weighted_split_paths,
    per_dataset_num_samples,
)
from megatron.data.indexed_dataset import MMapIndexedDataset

# Bump when the index arrays' meaning or layout changes: old caches are then ignored.
INDEX_FORMAT_VERSION = 1
# Megatron: a last epoch using fewer than this fraction of its samples is shuffled separately.
LAST_EPOCH_SEPARATE_FRACTION = 0.80


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens cover ``num_samples`` samples of ``seq_length`` (+1 shared token)."""
    if tokens_per_epoch <= 1:
        raise ValueError(f"the documents hold {tokens_per_epoch} tokens; a sample needs at least 2")
    # Smallest e with (e * tokens_per_epoch - 1) // seq_length >= num_samples.
    epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    while (epochs * tokens_per_epoch - 1) // seq_length < num_samples:  # guards the algebra
        epochs += 1
    return epochs


def separate_last_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int, num_epochs: int) -> bool:
    """Megatron's rule: shuffle the last epoch on its own when under 80 % of it is used."""
    if num_epochs == 1:
        return False
    samples_before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_in_last = num_samples - samples_before_last
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    assert 0 <= samples_in_last <= samples_per_epoch + 1, (samples_in_last, samples_per_epoch)
    return samples_in_last < int(LAST_EPOCH_SEPARATE_FRACTION * samples_per_epoch)


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last: bool) -> np.ndarray:
    """Document order for all epochs: the first epochs shuffled together, the last apart if asked."""
    if not separate_last or num_epochs == 1:
        doc_idx = np.tile(np.asarray(documents, dtype=np.int64), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, rng, False)
    last = build_doc_idx(documents, 1, rng, False)
    return np.concatenate([first, last])


def build_shuffle_idx(num_shuffled_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, total): [0, num_shuffled_first) shuffled, then the rest shuffled apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_shuffled_first, dtype=dtype)
    rng.shuffle(first)
    if num_shuffled_first == total:
        return first
    last = np.arange(num_shuffled_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_index_arrays(sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int):
    """(doc_idx, sample_idx, shuffle_idx) with Megatron's semantics; no caching."""
    documents = np.asarray(documents, dtype=np.int64)
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate = separate_last_epoch(tokens_per_epoch, seq_length, num_samples, num_epochs)
    rng = np.random.RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, num_epochs, rng, separate)
    sample_idx = _helpers.build_sample_idx(
        np.asarray(sizes, dtype=np.int32), doc_idx, seq_length, num_epochs, tokens_per_epoch
    )
    total_samples = sample_idx.shape[0] - 1
    if separate:
        num_shuffled_first = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    else:
        num_shuffled_first = total_samples
    shuffle_idx = build_shuffle_idx(num_shuffled_first, total_samples, rng)
    return doc_idx, sample_idx, shuffle_idx


def _default_build_and_barrier(build: bool | None, barrier: Callable[[], None] | None):
    """Global rank 0 builds when torch.distributed is initialized; otherwise this process builds."""
    if build is not None:
        return build, barrier
    # Without torch imported no process group can exist; do not pay torch's import for nothing.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0, barrier if barrier is not None else dist.barrier
    return True, barrier


def _save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens: ``dataset[i] == {"text": int64 array [seq_length + 1]}``.

    Args:
        name: split name ("train", "valid", a group name); part of the cache key.
        data_prefix: path prefix of the indexed dataset (for the cache location and key).
        documents: ids of the documents (sequences) this dataset draws from.
        indexed_dataset: the opened ``MMapIndexedDataset``.
        num_samples: samples requested; the dataset may hold more (whole epochs are indexed).
        seq_length: tokens per sample input; each sample returns seq_length + 1 tokens.
        seed: seed of the document and sample shuffles.
        cache_dir: folder for the index files (default: the data's folder).
        build: whether this process builds missing index files (see module docstring).
        barrier: called once by every process between building and loading.
    """

    def __init__(self, name: str, data_prefix: str, documents, indexed_dataset: MMapIndexedDataset,
                 num_samples: int, seq_length: int, seed: int, cache_dir: str | None = None,
                 build: bool | None = None, barrier: Callable[[], None] | None = None):
        documents = np.asarray(documents, dtype=np.int64)
        if documents.size == 0:
            raise ValueError(f"GPTDataset {name!r} of {data_prefix}: no documents")
        num_docs = len(indexed_dataset.sizes)
        if documents.min() < 0 or documents.max() >= num_docs:
            raise ValueError(
                f"GPTDataset {name!r}: document ids [{documents.min()}, {documents.max()}] are outside "
                f"the {num_docs} documents of {data_prefix}"
            )
        if num_samples <= 0 or seq_length <= 0:
            raise ValueError(f"GPTDataset {name!r}: num_samples ({num_samples}) and seq_length ({seq_length}) must be > 0")
        self.name, self.data_prefix, self.indexed_dataset = name, data_prefix, indexed_dataset
        self.num_samples, self.seq_length, self.seed = num_samples, seq_length, seed
        self.built_index = False  # True when this instance built (rather than loaded) its index files
        build, barrier = _default_build_and_barrier(build, barrier)
        self.doc_idx, self.sample_idx, self.shuffle_idx = self._load_or_build(
            documents, cache_dir, build, barrier
        )

    def cache_description(self, documents: np.ndarray) -> dict:
        """Everything that determines the index arrays; its hash names the cache files."""
        return {
            "format_version": INDEX_FORMAT_VERSION,
            "name": self.name,
            "data_prefix": os.path.abspath(self.data_prefix),
            "num_sequences": int(len(self.indexed_dataset.sizes)),
            # A regenerated dataset under the same prefix must not reuse a stale index.
            "sizes_sha256": hashlib.sha256(memoryview(np.ascontiguousarray(self.indexed_dataset.sizes))).hexdigest(),
            "documents_sha256": hashlib.sha256(np.ascontiguousarray(documents).tobytes()).hexdigest(),
            "documents_range": [int(documents[0]), int(documents[-1]) + 1, int(len(documents))],
            "num_samples": int(self.num_samples),
            "seq_length": int(self.seq_length),
            "seed": int(self.seed),
        }

    def cache_paths(self, documents: np.ndarray, cache_dir: str | None) -> dict[str, str]:
        description = self.cache_description(documents)
        key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
        folder = cache_dir if cache_dir is not None else os.path.dirname(os.path.abspath(self.data_prefix))
        stem = os.path.join(
            folder,
            f"{os.path.basename(self.data_prefix)}_{self.name}_indexmap_{self.num_samples}ns_"
            f"{self.seq_length}sl_{self.seed}s_{key}",
        )
        paths = {part: f"{stem}_{part}.npy" for part in ("doc_idx", "sample_idx", "shuffle_idx")}
        paths["description"] = f"{stem}_description.json"
        return paths

    def _load_or_build(self, documents, cache_dir, build, barrier):
        paths = self.cache_paths(documents, cache_dir)
        arrays = ("doc_idx", "sample_idx", "shuffle_idx")
        if build and not all(os.path.isfile(paths[a]) for a in arrays):
            os.makedirs(os.path.dirname(paths["doc_idx"]), exist_ok=True)
            start = time.perf_counter()
            built = build_index_arrays(self.indexed_dataset.sizes, documents, self.num_samples, self.seq_length, self.seed)
            for part, array in zip(arrays, built):
                _save_atomic(paths[part], array)
            description = dict(self.cache_description(documents), build_seconds=time.perf_counter() - start)
            with open(paths["description"], "w") as f:
                json.dump(description, f, indent=1)
            self.built_index = True
        if barrier is not None:
            barrier()
        missing = [paths[a] for a in arrays if not os.path.isfile(paths[a])]
        if missing:
            raise FileNotFoundError(
                f"GPTDataset {self.name!r}: index files {missing} are missing after the barrier; the "
                f"building rank must write them to a folder every rank can read (cache_dir)"
            )
        return tuple(np.load(paths[a], mmap_mode="r", allow_pickle=False) for a in arrays)

    def __len__(self) -> int:
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for GPTDataset {self.name!r} of {len(self)} samples")
        idx = int(self.shuffle_idx[idx])
        (first_pos, first_offset), (last_pos, last_offset) = self.sample_idx[idx], self.sample_idx[idx + 1]
        get = self.indexed_dataset.get
        if first_pos == last_pos:
            pieces = [get(self.doc_idx[first_pos], offset=int(first_offset), length=int(last_offset - first_offset + 1))]
        else:
            pieces = [get(self.doc_idx[first_pos], offset=int(first_offset))]
            pieces += [get(self.doc_idx[pos]) for pos in range(first_pos + 1, last_pos)]
            pieces.append(get(self.doc_idx[last_pos], length=int(last_offset + 1)))
        return {"text": np.concatenate(pieces).astype(np.int64)}


# ----------------------------------------------------------------------------------------------
# Train / valid / test datasets from --data-path + --split, or from weighted split path groups.

def _blend_or_single(datasets, weights, num_samples):
    if len(datasets) == 1:
        return datasets[0]
    return BlendableDataset(datasets, weights, num_samples)


def _data_path_pairs(data_prefix) -> tuple[tuple[float, str], ...]:
    """One prefix, ``--data-path`` values ("W1 P1 W2 P2 ..."), or ``DataConfig.data_path`` pairs (parsed already)."""
    values = [data_prefix] if isinstance(data_prefix, (str, os.PathLike)) else list(data_prefix)
    pairs = tuple(values) if values and all(isinstance(v, tuple) for v in values) else parse_data_path(values)
    if not pairs:
        raise ValueError("--data-path is empty; give a prefix or 'WEIGHT PREFIX' pairs")
    return pairs


def build_train_valid_test_datasets(data_prefix, splits_string: str, train_valid_test_num_samples,
                                    seq_length: int, seed: int, cache_dir: str | None = None,
                                    build: bool | None = None, barrier: Callable[[], None] | None = None):
    """(train, valid, test) datasets, each None when its split is empty or asks for 0 samples.

    ``data_prefix``: one prefix, ``--data-path`` values ("W1 P1 W2 P2 ..."), or the (weight, prefix)
    pairs of ``DataConfig.data_path``. Each dataset is split by ``splits_string`` over its documents;
    with several datasets each split is a ``BlendableDataset`` of normalized weights, dataset i
    building ceil(w_i * n * 1.005) samples.
    """
    pairs = _data_path_pairs(data_prefix)
    prefixes, weights = [p for _, p in pairs], normalize_weights([w for w, _ in pairs])
    num_samples = [int(n) for n in train_valid_test_num_samples]
    if len(num_samples) != 3:
        raise ValueError(f"train_valid_test_num_samples must have 3 entries, got {num_samples}")
    if len(prefixes) == 1:
        counts = [num_samples]
    else:
        counts = per_dataset_num_samples(weights, num_samples)
    per_split: list[list[GPTDataset]] = [[], [], []]
    for prefix, dataset_counts in zip(prefixes, counts):
        indexed = MMapIndexedDataset(prefix)
        bounds = parse_split(splits_string, len(indexed.sizes))
        for split, name in enumerate(("train", "valid", "test")):
            if bounds[split + 1] > bounds[split] and num_samples[split] > 0:
                documents = np.arange(bounds[split], bounds[split + 1], dtype=np.int64)
                per_split[split].append(GPTDataset(name, prefix, documents, indexed, dataset_counts[split],
                                                   seq_length, seed, cache_dir, build, barrier))
    result = []
    for split in range(3):
        datasets = per_split[split]
        if not datasets:
            result.append(None)
        elif len(datasets) != len(prefixes):
            raise ValueError(
                f"split {splits_string!r} leaves the {('train', 'valid', 'test')[split]} split empty for "
                f"some of {prefixes} but not others; give every dataset enough documents"
            )
        else:
            result.append(_blend_or_single(datasets, weights, num_samples[split]))
    return tuple(result)


def build_group_dataset(group, split: str, num_samples: int, seq_length: int, seed: int,
                        cache_dir: str | None = None, build: bool | None = None,
                        barrier: Callable[[], None] | None = None, _opened: dict | None = None):
    """The dataset of one weighted split group (a ``DatasetGroup``, or its "NAME: W START:END PREFIX, ..."
    string): its datasets' document ranges blended by weight."""
    if isinstance(group, str):
        group = parse_group(group, f"--{split}-weighted-split-paths")
    opened = _opened if _opened is not None else {}
    weights = normalize_weights([d.weight for d in group.datasets])
    counts = [num_samples] if len(group.datasets) == 1 else [c[0] for c in per_dataset_num_samples(weights, [num_samples])]
    datasets = []
    for i, (entry, count) in enumerate(zip(group.datasets, counts)):
        if entry.prefix not in opened:
            opened[entry.prefix] = MMapIndexedDataset(entry.prefix)
        indexed = opened[entry.prefix]
        start, end = document_range(entry, len(indexed.sizes))
        if end <= start:
            raise ValueError(f"group {group.name!r}: range {entry.start}:{entry.end} of {entry.prefix} holds no "
                             f"documents (it has {len(indexed.sizes)})")
        datasets.append(GPTDataset(f"{split}-{group.name}-{i}", entry.prefix, np.arange(start, end, dtype=np.int64),
                                   indexed, count, seq_length, seed, cache_dir, build, barrier))
    return _blend_or_single(datasets, weights, num_samples)


def build_weighted_split_datasets(train_groups, valid_groups, test_groups, train_valid_test_num_samples,
                                  seq_length: int, seed: int, cache_dir: str | None = None,
                                  build: bool | None = None, barrier: Callable[[], None] | None = None):
    """Megatron-DeepSpeed's ``--{train,valid,test}-weighted-split-paths``: each argument a sequence of
    ``DatasetGroup`` (as ``DataConfig`` holds them) or group strings.

    Returns ``(train, {name: valid_dataset}, {name: test_dataset})``: one train dataset (at most
    one group), and validation / test datasets keyed by group name so each is evaluated and logged
    under its own name. Every valid (test) group gets the full valid (test) sample count.
    """
    opened: dict = {}
    num_samples = [int(n) for n in train_valid_test_num_samples]
    parsed = [parse_weighted_split_paths(groups, split)
              for groups, split in zip((train_groups, valid_groups, test_groups), SPLIT_NAMES)]
    common = dict(seq_length=seq_length, seed=seed, cache_dir=cache_dir, build=build, barrier=barrier, _opened=opened)
    train = build_group_dataset(parsed[0][0], "train", num_samples[0], **common) if parsed[0] and num_samples[0] > 0 else None
    valid = {g.name: build_group_dataset(g, "valid", num_samples[1], **common) for g in parsed[1]} if num_samples[1] > 0 else {}
    test = {g.name: build_group_dataset(g, "test", num_samples[2], **common) for g in parsed[2]} if num_samples[2] > 0 else {}
    return train, valid, test
