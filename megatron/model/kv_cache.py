"""BatchKVCache: one attention layer's keys and values for a batch of sequences of different lengths.

Continuous batching decodes sequences that joined at different times together: row r holds a
sequence of ``lengths[r]`` tokens, and its next token sits at position ``lengths[r]``, whatever the
other rows hold. So no row is left-padded: row r's key j is the key of its position j, the keys past
its length are zeros that the attention masks out, and ALiBi, rotary and learned positions all read
``position_ids()`` (per row) instead of one shared offset. Rows join with the caches their prompts
filled (``add_rows``: one prompt alone, or several right-padded in one pass) and leave when their
sequences end (``keep_rows``); the rows in between keep decoding.

Storage is [rows, ng, cap, hn], allocated ahead along both rows and cap (doubling when full) and written
in place: a step writes one position per row, a joining row writes its own slot, a leaving row moves
only the rows after it (each row's whole slot, so positions past a row's length stay zeros). Each (row,
head)'s keys are contiguous, the layout the fused attention kernel reads fastest (with [cap, b, ng, hn]
SDPA took 9x longer at 64 rows on CPU). The room is kept while rows leave (the next ones reuse it), until at
most a quarter of it is in use along rows or positions, when that dim is halved; the last row leaving frees the
storage (an idle server holds no cache). ``append`` hands attention a view [sk, b, ng, hn] (the layout
``KVCache`` returns), sk = the longest row, which attention permutes back to [b, ng, sk, hn] without a copy.

The lengths are kept twice: ``lengths``, a tuple of ints (the longest row, and the key of the masks
that every layer of one step shares, without reading a tensor back), and ``row_lengths`` [b] on the
cache's device (the positions).

Shape letters: sk keys, sq new positions, b rows (sequences), k joining rows, ng key / value heads per
partition, hn head dim, cap allocated positions.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["BatchKVCache"]

MIN_POSITIONS = 16  # positions allocated at least, so that short prompts do not regrow at every step


class BatchKVCache:
    """Per-row keys and values [rows, ng, cap, hn] (the first ``num_rows`` rows in use) with per-row lengths;
    a drop-in for ``KVCache`` in a model's forward (``length``, ``position_ids``, ``append``) plus ``lengths``
    and ``row_lengths`` for the masks."""

    def __init__(self) -> None:
        self.key: Optional[torch.Tensor] = None    # [rows, ng, cap, hn]; rows >= num_rows
        self.value: Optional[torch.Tensor] = None  # [rows, ng, cap, hn]
        self.lengths: tuple[int, ...] = ()         # cached positions of each row
        self.row_lengths = torch.zeros(0, dtype=torch.long)  # [b]: the same, on the cache's device

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        """The longest row (the keys attention sees span this many positions)."""
        return max(self.lengths, default=0)

    def position_ids(self, sq: int, device: torch.device) -> torch.Tensor:
        """The positions [b, sq] of the next sq tokens of each row."""
        lengths = self.row_lengths.to(device)
        if sq == 1:
            return lengths[:, None]  # [b, 1]
        return lengths[:, None] + torch.arange(sq, device=device)[None, :]  # [b, sq]

    def _set_lengths(self, lengths: Sequence[int]) -> None:
        self.lengths = tuple(lengths)
        device = self.key.device if self.key is not None else None
        self.row_lengths = torch.tensor(self.lengths, dtype=torch.long, device=device)

    def add_rows(self, key: torch.Tensor, value: torch.Tensor, lengths: Sequence[int]) -> None:
        """New last rows from a ``KVCache`` filled by right-padded prompts, keys and values [s, k, ng, hn]:
        row i keeps its first ``lengths[i]`` positions (the rest, padding, become zeros)."""
        s, k = key.shape[:2]
        if len(lengths) != k or not all(0 < n <= s for n in lengths):
            raise ValueError(f"lengths {list(lengths)} must give 1 .. {s} positions for each of the {k} rows")
        if self.key is None:
            self.key = key.new_zeros((k, key.shape[2], max(s, MIN_POSITIONS), key.shape[3]))  # [k, ng, cap, hn]
            self.value = value.new_zeros(self.key.shape)
        elif key.shape[2:] != (self.key.shape[1], self.key.shape[3]) or key.dtype != self.key.dtype:
            raise ValueError(f"rows of keys {list(key.shape)} ({key.dtype}) do not fit a cache of "
                             f"{list(self.key.shape)} ({self.key.dtype})")
        b = self.num_rows
        self._reserve(b + k, s)
        padding = (torch.arange(s)[None, :] >= torch.tensor(list(lengths))[:, None]).to(key.device)  # [k, s]
        for store, new in ((self.key, key), (self.value, value)):
            store[b:b + k] = 0  # a slot that an earlier row left holds its keys
            store[b:b + k, :, :s] = new.permute(1, 2, 0, 3).masked_fill(padding[:, None, :, None], 0)
        self._set_lengths(self.lengths + tuple(lengths))

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order); the others' sequences have ended. Only the rows whose slot
        changes are copied (none when the ones leaving are the last)."""
        rows = list(rows)
        if len(set(rows)) != len(rows) or not all(0 <= r < self.num_rows for r in rows):
            raise ValueError(f"rows {rows} must be distinct rows of the {self.num_rows} in the cache")
        if not rows:  # the batch has emptied: give the storage back (the next rows allocate for their size)
            self.key = self.value = None
            self._set_lengths(())
            return
        first = next((i for i, r in enumerate(rows) if r != i), len(rows))  # rows before it stay where they are
        if self.key is not None and first < len(rows):
            moved = torch.tensor(rows[first:], dtype=torch.long, device=self.key.device)
            # storage filled under inference_mode can only be written under it (a step runs there; this may not)
            with torch.inference_mode(self.key.is_inference()):
                # index_select copies the moved rows out first, so sources and destinations may overlap
                self.key[first:len(rows)] = self.key.index_select(0, moved)  # [m, ng, cap, hn]
                self.value[first:len(rows)] = self.value.index_select(0, moved)
        self._set_lengths([self.lengths[r] for r in rows])
        self._shrink()

    def _shrink(self) -> None:
        """Halve the storage along each dim while at most a quarter of it is in use (rows, or the longest row's
        positions, down to MIN_POSITIONS): a server whose batch never empties still gives back what a burst
        grew. Quarter, not half, so that a row joining or a step after a halving does not double it again."""
        slots, cap = self.key.shape[0], self.key.shape[2]
        new_slots, new_cap = slots, cap
        while new_slots > 1 and 4 * self.num_rows <= new_slots:
            new_slots //= 2
        while new_cap > MIN_POSITIONS and 4 * self.length <= new_cap:
            new_cap //= 2
        if (new_slots, new_cap) != (slots, cap):
            with torch.inference_mode(self.key.is_inference()):  # as keep_rows: the kind of storage it had
                self._resize(new_slots, new_cap)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys and values [sq, b, ng, hn] at each row's own positions; return the keys
        and values of positions 0 .. longest row - 1 as views [sk, b, ng, hn] (rows shorter than sk: zeros
        past their length, which ``row_lengths`` lets the attention mask out)."""
        sq, b = key.shape[:2]
        if self.key is None or b != self.num_rows:
            raise ValueError(f"the cache holds {self.num_rows} rows but got keys for {b}; add each sequence "
                             f"with add_rows first")
        self._reserve(b, self.length + sq)
        positions = self.position_ids(sq, self.key.device)  # [b, sq]
        rows = torch.arange(b, device=self.key.device)[:, None].expand(b, sq)  # [b, sq]
        # the two index tensors are apart (ng between them), so the indexed view is [b, sq, ng, hn]
        self.key[rows, :, positions] = key.transpose(0, 1)
        self.value[rows, :, positions] = value.transpose(0, 1)
        self.lengths = tuple(n + sq for n in self.lengths)
        self.row_lengths = self.row_lengths + sq
        sk = self.length
        return (self.key[:b, :, :sk].permute(2, 0, 1, 3),
                self.value[:b, :, :sk].permute(2, 0, 1, 3))  # 2 x [sk, b, ng, hn]

    def _reserve(self, rows: int, positions: int) -> None:
        """Room for this many rows and positions; the storage doubles along each dim that is short."""
        slots, cap = self.key.shape[0], self.key.shape[2]
        if rows <= slots and positions <= cap:
            return
        while slots < rows:
            slots *= 2
        while cap < positions:
            cap *= 2
        self._resize(slots, cap)

    def _resize(self, slots: int, cap: int) -> None:
        """New zeroed storage [slots, ng, cap, hn] holding the rows in use, up to ``cap`` of their positions."""
        b, kept = self.num_rows, min(cap, self.key.shape[2])
        shape = (slots, self.key.shape[1], cap, self.key.shape[3])  # [rows, ng, cap, hn]
        key, value = self.key.new_zeros(shape), self.value.new_zeros(shape)
        key[:b, :, :kept], value[:b, :, :kept] = self.key[:b, :, :kept], self.value[:b, :, :kept]
        self.key, self.value = key, value
