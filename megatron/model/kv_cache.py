"""BatchKVCache: one attention layer's keys and values for a batch of sequences of different lengths.

Continuous batching decodes sequences that joined at different times together: row r holds a
sequence of ``lengths[r]`` tokens, and its next token sits at position ``lengths[r]``, whatever the
other rows hold. So no row is left-padded: row r's key j is the key of its position j, the keys past
its length are zeros that the attention masks out, and ALiBi, rotary and learned positions all read
``position_ids()`` (per row) instead of one shared offset. A row joins with the cache its sequence's
prompt filled alone (``add_row``) and leaves when its sequence ends (``keep_rows``); the rows in
between keep decoding.

Storage is [cap, b, ng, hn] (the layout ``KVCache`` builds by concatenation), grown by doubling, so
the keys handed to attention are a contiguous view [sk, b, ng, hn] with sk = the longest row.

Shape letters: sk keys, sq new positions, b rows (sequences), ng key / value heads per partition,
hn head dim, cap allocated positions.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["BatchKVCache"]


class BatchKVCache:
    """Per-row keys and values [cap, b, ng, hn] with per-row lengths [b]; a drop-in for ``KVCache`` in a
    model's forward (``length``, ``position_ids``, ``append``) plus ``row_lengths`` for the masks."""

    def __init__(self) -> None:
        self.key: Optional[torch.Tensor] = None    # [cap, b, ng, hn]
        self.value: Optional[torch.Tensor] = None  # [cap, b, ng, hn]
        self.row_lengths = torch.zeros(0, dtype=torch.long)  # [b]: cached positions of each row

    @property
    def num_rows(self) -> int:
        return self.row_lengths.shape[0]

    @property
    def length(self) -> int:
        """The longest row (the keys attention sees span this many positions)."""
        return int(self.row_lengths.max()) if self.num_rows else 0

    def position_ids(self, sq: int, device: torch.device) -> torch.Tensor:
        """The positions [b, sq] of the next sq tokens of each row."""
        lengths = self.row_lengths.to(device)
        return lengths[:, None] + torch.arange(sq, device=device)[None, :]  # [b, sq]

    def add_row(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """A new last row holding one sequence's keys and values [s, 1, ng, hn] (a ``KVCache`` filled alone)."""
        s = key.shape[0]
        if self.key is None:
            self.key = key.new_zeros((max(s, 16), 0, *key.shape[2:]))  # [cap, 0, ng, hn]
            self.value = value.new_zeros(self.key.shape)
        elif key.shape[2:] != self.key.shape[2:] or key.dtype != self.key.dtype:
            raise ValueError(f"a row of keys {list(key.shape)} ({key.dtype}) does not fit a cache of "
                             f"{list(self.key.shape)} ({self.key.dtype})")
        self._reserve(s)
        row_key = self.key.new_zeros((self.key.shape[0], 1, *self.key.shape[2:]))  # [cap, 1, ng, hn]
        row_value = row_key.clone()
        row_key[:s], row_value[:s] = key, value
        self.key = torch.cat((self.key, row_key), dim=1)  # [cap, b + 1, ng, hn]
        self.value = torch.cat((self.value, row_value), dim=1)  # [cap, b + 1, ng, hn]
        self.row_lengths = torch.cat((self.row_lengths, torch.tensor([s])))

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order); the others' sequences have ended."""
        index = torch.tensor(list(rows), dtype=torch.long)
        self.row_lengths = self.row_lengths[index]
        if self.key is not None:
            self.key = self.key.index_select(1, index.to(self.key.device))  # [cap, b', ng, hn]
            self.value = self.value.index_select(1, index.to(self.key.device))  # [cap, b', ng, hn]

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys and values [sq, b, ng, hn] at each row's own positions; return the keys
        and values of positions 0 .. longest row - 1, [sk, b, ng, hn] (rows shorter than sk: zeros past
        their length, which ``row_lengths`` lets the attention mask out)."""
        sq, b = key.shape[:2]
        if self.key is None or b != self.num_rows:
            raise ValueError(f"the cache holds {self.num_rows} rows but got keys for {b}; add each sequence "
                             f"with add_row first")
        self._reserve(self.length + sq)
        positions = self.position_ids(sq, self.key.device)  # [b, sq]
        rows = torch.arange(b, device=self.key.device)[:, None].expand(b, sq)  # [b, sq]
        self.key[positions, rows] = key.transpose(0, 1)  # [b, sq, ng, hn] scattered
        self.value[positions, rows] = value.transpose(0, 1)
        self.row_lengths = self.row_lengths + sq
        sk = self.length
        return self.key[:sk], self.value[:sk]

    def _reserve(self, positions: int) -> None:
        cap = self.key.shape[0]
        if positions <= cap:
            return
        while cap < positions:
            cap *= 2
        grown = self.key.new_zeros((cap, *self.key.shape[1:]))  # [cap, b, ng, hn]
        grown_value = grown.clone()
        grown[:self.key.shape[0]], grown_value[:self.key.shape[0]] = self.key, self.value
        self.key, self.value = grown, grown_value
