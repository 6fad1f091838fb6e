"""Megatron's memory-mapped indexed dataset: a ``.bin`` of token ids and an ``.idx`` that indexes it.

The on-disk format is byte-identical to Megatron-LM / Megatron-DeepSpeed's ``mmap`` dataset
(see ``../shared/data/README.md``). ``.idx``, little-endian::

    9 bytes  magic  b"MMIDIDX\\x00\\x00"
    u64      version (1)
    u8       dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)
    u64      N, number of sequences
    u64      M, number of doc_idx entries
    int32    sizes[N]      tokens per sequence
    int64    pointers[N]   byte offset of each sequence in the .bin
    int64    doc_idx[M]    sequence index where each document starts; doc_idx[0] == 0

The ``.bin`` is the sequences' tokens back to back. Opening a pair validates it against both
files' lengths with vectorized numpy checks, so a truncated or corrupt pair raises
``IndexedDatasetError`` (naming the file and the defect) instead of reading garbage.

Writes go to temporary files beside the targets. ``finalize`` first removes any old ``.idx``
(so an old pair no longer looks complete), then renames the new ``.bin`` into place, and
renames the new ``.idx`` LAST: the ``.idx`` is the commit marker. An interrupted run therefore
leaves either no ``.idx`` or the old, consistent pair, never a new ``.bin`` beside an old ``.idx``.

Imports only numpy and the standard library.
"""

from __future__ import annotations

import os
import shutil
import struct
import uuid
from array import array
from typing import Iterable, Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# magic, u64 version, u8 dtype code, u64 N, u64 M
_HEADER = struct.Struct("<9sQBQQ")
HEADER_SIZE = _HEADER.size  # 34 bytes

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}

# Validation runs over the arrays in chunks so that opening a huge index never allocates more
# than a few hundred MB of temporaries.
_CHECK_CHUNK = 1 << 24


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair is missing, truncated, corrupt or inconsistent."""


def sequence_count(prefix: str | os.PathLike) -> int:
    """N, the number of sequences (documents) ``PREFIX.idx``'s header declares, read without opening
    the arrays (the argument checks call it on every rank, for every dataset of a blend)."""
    path = index_file_path(prefix)
    with open(path, "rb") as f:
        header = f.read(HEADER_SIZE)
    if len(header) < HEADER_SIZE or header[:len(MAGIC)] != MAGIC:
        raise IndexedDatasetError(f"index file {path} is not a Megatron mmap index (truncated, or another format); "
                                  f"rebuild it with tools/preprocess_data.py")
    return _HEADER.unpack(header)[3]


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype Megatron uses for ``vocab_size``: uint16 below 65,500, else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _prefix_of(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def data_file_path(prefix: str | os.PathLike) -> str:
    return _prefix_of(prefix) + ".bin"


def index_file_path(prefix: str | os.PathLike) -> str:
    return _prefix_of(prefix) + ".idx"


def dtype_code(dtype) -> int:
    """Megatron's code for a token dtype; ValueError for anything else."""
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF_DTYPE:
        allowed = ", ".join(str(d) for d in _CODE_OF_DTYPE)
        raise ValueError(f"token dtype {dtype} has no Megatron code; use one of {allowed}")
    return _CODE_OF_DTYPE[dtype]


class _Index:
    """The parsed, validated ``.idx``: ``dtype``, ``sizes``, ``pointers``, ``doc_idx`` (memory-mapped)."""

    def __init__(self, idx_path: str, bin_size: int | None = None):
        self.path = idx_path
        try:
            idx_size = os.path.getsize(idx_path)
        except OSError as e:
            raise IndexedDatasetError(f"cannot read index file {idx_path}: {e}") from None
        if idx_size < HEADER_SIZE:
            raise IndexedDatasetError(
                f"index file {idx_path} is truncated: {idx_size} bytes, shorter than the "
                f"{HEADER_SIZE}-byte header; rebuild it with tools/preprocess_data.py"
            )
        with open(idx_path, "rb") as f:
            magic, version, code, num_sequences, num_docs = _HEADER.unpack(f.read(HEADER_SIZE))
        if magic != MAGIC:
            raise IndexedDatasetError(
                f"index file {idx_path} does not start with Megatron's mmap magic {MAGIC!r} "
                f"(found {magic!r}); it is not an mmap indexed dataset (old 'lazy'/'cached' "
                f"formats are not supported: convert them with Megatron's tools)"
            )
        if version != VERSION:
            raise IndexedDatasetError(f"index file {idx_path} has version {version}; only {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(
                f"index file {idx_path} has dtype code {code}; token codes are {sorted(DTYPE_CODES)}"
            )
        self.dtype = DTYPE_CODES[code]
        expected = HEADER_SIZE + 12 * num_sequences + 8 * num_docs
        if expected != idx_size:
            raise IndexedDatasetError(
                f"index file {idx_path} is {idx_size} bytes but its header (N={num_sequences} "
                f"sequences, M={num_docs} doc_idx entries) implies {expected}: truncated or corrupt"
            )
        self._mmap = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(self._mmap, np.int32, num_sequences, HEADER_SIZE)
        self.pointers = np.frombuffer(self._mmap, np.int64, num_sequences, HEADER_SIZE + 4 * num_sequences)
        self.doc_idx = np.frombuffer(self._mmap, np.int64, num_docs, HEADER_SIZE + 12 * num_sequences)
        self.bin_bytes = self._check_arrays()
        if bin_size is not None and bin_size != self.bin_bytes:
            raise IndexedDatasetError(
                f"data file for {idx_path} is {bin_size} bytes but the index describes "
                f"{self.bin_bytes} bytes ({len(self.sizes)} sequences of {self.dtype}): the .bin "
                f"is truncated, or the .bin and .idx come from different runs"
            )

    def _check_arrays(self) -> int:
        """Validate sizes/pointers/doc_idx; return the .bin length in bytes they describe."""
        path, n = self.path, len(self.sizes)
        if len(self.doc_idx) == 0 or self.doc_idx[0] != 0:
            raise IndexedDatasetError(f"index file {path}: doc_idx must start with 0")
        doc_idx = self.doc_idx
        if np.any(doc_idx[1:] < doc_idx[:-1]) or doc_idx[-1] > n:
            raise IndexedDatasetError(
                f"index file {path}: doc_idx must be non-decreasing and at most N={n}: corrupt"
            )
        itemsize = self.dtype.itemsize
        expected_pointer = 0
        for start in range(0, n, _CHECK_CHUNK):
            sizes = self.sizes[start : start + _CHECK_CHUNK].astype(np.int64)
            if np.any(sizes < 0):
                raise IndexedDatasetError(f"index file {path}: negative sequence size: corrupt")
            ends = np.cumsum(sizes * itemsize) + expected_pointer
            starts = np.empty_like(ends)
            starts[0] = expected_pointer
            starts[1:] = ends[:-1]
            bad = np.flatnonzero(self.pointers[start : start + _CHECK_CHUNK] != starts)
            if bad.size:
                i = start + int(bad[0])
                raise IndexedDatasetError(
                    f"index file {path}: pointer of sequence {i} is {int(self.pointers[i])}, but "
                    f"the sizes before it put it at byte {int(starts[bad[0]])}: corrupt"
                )
            expected_pointer = int(ends[-1])
        return expected_pointer


class MMapIndexedDataset:
    """Read-only view of a Megatron mmap ``.bin``/``.idx`` pair; items are numpy arrays (no copy)."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = _prefix_of(prefix)
        bin_path = data_file_path(self.prefix)
        try:
            bin_size = os.path.getsize(bin_path)
        except OSError as e:
            raise IndexedDatasetError(f"cannot read data file {bin_path}: {e}") from None
        self._index = _Index(index_file_path(self.prefix), bin_size)
        # np.memmap cannot map an empty file.
        if bin_size:
            self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8)
        else:
            self._bin = np.empty(0, np.uint8)

    @staticmethod
    def exists(prefix: str | os.PathLike) -> bool:
        return exists(prefix)

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def sizes(self) -> np.ndarray:
        """Tokens per sequence, int32 [N]."""
        return self._index.sizes

    @property
    def pointers(self) -> np.ndarray:
        """Byte offset of each sequence in the .bin, int64 [N]."""
        return self._index.pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """Sequence index where each document starts, int64 [M]; doc_idx[0] == 0."""
        return self._index.doc_idx

    def __len__(self) -> int:
        return len(self._index.sizes)

    def _normalize(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence index {i} out of range for {n} sequences in {self.prefix}")
        return i + n if i < 0 else i

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            return [self.get(j) for j in range(start, stop, step)]
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i``: a view into the mmap, not a copy."""
        i = self._normalize(int(i))
        size = int(self._index.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {i} of {size} tokens"
            )
        start = int(self._index.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    def __repr__(self) -> str:
        return f"MMapIndexedDataset({self.prefix!r}, sequences={len(self)}, dtype={self.dtype})"


def exists(prefix: str | os.PathLike) -> bool:
    """True when both the .bin and the .idx of ``prefix`` exist."""
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


class MMapIndexedDatasetBuilder:
    """Writes a Megatron mmap pair. Tokens stream to a temporary .bin; ``finalize`` commits.

    ``add_item(tokens)`` appends one sequence; ``end_document()`` closes the current document
    (Megatron's tools call it after every document). Usable as a context manager: leaving the
    block with an exception deletes the temporary files.
    """

    def __init__(self, prefix_or_bin_path: str | os.PathLike, dtype=np.int64):
        self.prefix = _prefix_of(prefix_or_bin_path)
        self.bin_path = data_file_path(self.prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # fail early on a dtype Megatron cannot read
        self._tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tmp_bin = self.bin_path + self._tag
        os.makedirs(os.path.dirname(os.path.abspath(self.bin_path)), exist_ok=True)
        self._data_file = open(self._tmp_bin, "wb")
        self._sizes = array("i")
        self._doc_idx = array("q", [0])
        self._finalized = False

    def _as_tokens(self, tokens) -> np.ndarray:
        if hasattr(tokens, "detach"):  # torch.Tensor, without importing torch
            tokens = tokens.detach().cpu().numpy()
        values = np.asarray(tokens)
        if values.ndim != 1:
            values = values.reshape(-1)
        if values.dtype != self.dtype and values.size:
            if not np.issubdtype(values.dtype, np.integer):
                raise ValueError(f"token ids must be integers, got dtype {values.dtype}")
            info = np.iinfo(self.dtype)
            low, high = int(values.min()), int(values.max())
            if low < info.min or high > info.max:
                raise ValueError(
                    f"token ids in [{low}, {high}] do not fit the dataset dtype {self.dtype}; "
                    f"choose a wider dtype (best_dtype(vocab_size))"
                )
        return np.ascontiguousarray(values, dtype=self.dtype)

    def add_item(self, tokens) -> None:
        """Append one sequence of token ids (list, numpy array or CPU tensor)."""
        values = self._as_tokens(tokens)
        self._data_file.write(values.tobytes(order="C"))
        self._sizes.append(len(values))

    def end_document(self) -> None:
        """Close the current document: the next item starts a new one."""
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """Append a document made of ``len(lengths)`` sequences, given concatenated in ``tokens``."""
        values = self._as_tokens(tokens)
        lengths = [int(n) for n in lengths]
        if sum(lengths) != len(values) or any(n < 0 for n in lengths):
            raise ValueError(f"lengths {lengths} must be non-negative and sum to len(tokens)={len(values)}")
        self._data_file.write(values.tobytes(order="C"))
        self._sizes.extend(lengths)
        self.end_document()

    def merge_file_(self, other_prefix: str | os.PathLike) -> None:
        """Append every sequence and document of another (validated) dataset."""
        try:
            other_bin_size = os.path.getsize(data_file_path(other_prefix))
        except OSError as e:
            raise IndexedDatasetError(f"cannot read data file {data_file_path(other_prefix)}: {e}") from None
        other = _Index(index_file_path(other_prefix), other_bin_size)
        if other.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {other_prefix} (dtype {other.dtype}) into a {self.dtype} dataset; "
                f"re-tokenize or build with dtype={other.dtype}"
            )
        offset = len(self._sizes)
        self._sizes.extend(other.sizes.tolist())
        self._doc_idx.extend((other.doc_idx[1:] + offset).tolist())
        with open(data_file_path(other_prefix), "rb") as f:
            shutil.copyfileobj(f, self._data_file, 16 << 20)

    def _write_index(self, path: str) -> None:
        sizes = np.frombuffer(self._sizes, np.int32) if len(self._sizes) else np.zeros(0, np.int32)
        doc_idx = np.frombuffer(self._doc_idx, np.int64)
        pointers = np.zeros(len(sizes), np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(path, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, dtype_code(self.dtype), len(sizes), len(doc_idx)))
            f.write(sizes.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_idx.tobytes())
            f.flush()
            os.fsync(f.fileno())

    def finalize(self, idx_path: str | os.PathLike | None = None) -> None:
        """Write the index and move both files into place, the .idx last (see module docstring)."""
        if self._finalized:
            raise RuntimeError(f"builder for {self.bin_path} was already finalized")
        idx_path = os.fspath(idx_path) if idx_path is not None else index_file_path(self.prefix)
        self._data_file.flush()
        os.fsync(self._data_file.fileno())
        self._data_file.close()
        tmp_idx = idx_path + self._tag
        try:
            self._write_index(tmp_idx)
            # Drop the old commit marker first: from here until the final rename, no .idx exists,
            # so no reader can pair the new .bin with a stale index.
            if os.path.exists(idx_path):
                os.remove(idx_path)
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(tmp_idx, idx_path)
        except BaseException:
            for path in (tmp_idx, self._tmp_bin):
                if os.path.exists(path):
                    os.remove(path)
            raise
        self._finalized = True

    def abort(self) -> None:
        """Discard everything written so far (temporary files only; existing targets are untouched)."""
        if not self._data_file.closed:
            self._data_file.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)
        self._finalized = True

    def __enter__(self) -> "MMapIndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self._finalized:
            self.abort()


def merge_datasets(prefixes: Iterable[str | os.PathLike], out_prefix: str | os.PathLike, dtype=None) -> None:
    """Concatenate datasets (same dtype) into ``out_prefix``; dtype defaults to the first one's."""
    prefixes = list(prefixes)
    if not prefixes:
        raise ValueError("merge_datasets needs at least one input prefix")
    if dtype is None:
        dtype = _Index(index_file_path(prefixes[0])).dtype
    with MMapIndexedDatasetBuilder(out_prefix, dtype) as builder:
        for prefix in prefixes:
            builder.merge_file_(prefix)
        builder.finalize()
