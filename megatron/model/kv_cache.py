"""BatchKVCache: one attention layer's keys and values for a batch of sequences of different lengths.

Continuous batching decodes sequences that joined at different times together: row r holds a
sequence of ``lengths[r]`` tokens, and its next token sits at position ``lengths[r]``, whatever the
other rows hold. So no row is left-padded: row r's key j is the key of its position j, the keys past
its length are zeros that the attention masks out, and ALiBi, rotary and learned positions all read
``position_ids()`` (per row) instead of one shared offset. Rows join with the caches their prompts
filled (``add_rows``: one prompt alone, or several right-padded in one pass) and leave when their
sequences end (``keep_rows``); the rows in between keep decoding.

Storage is [b, ng, cap, hn], grown along cap by doubling: each (row, head)'s keys are contiguous, the
layout the fused attention kernel reads fastest (with [cap, b, ng, hn] SDPA took 9x longer at 64 rows
on CPU). ``append`` hands attention a view [sk, b, ng, hn] (the layout ``KVCache`` returns), sk = the
longest row, which attention permutes back to [b, ng, sk, hn] without a copy.

Shape letters: sk keys, sq new positions, b rows (sequences), k joining rows, ng key / value heads per
partition, hn head dim, cap allocated positions.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["BatchKVCache"]


class BatchKVCache:
    """Per-row keys and values [b, ng, cap, hn] with per-row lengths [b]; a drop-in for ``KVCache`` in a
    model's forward (``length``, ``position_ids``, ``append``) plus ``row_lengths`` for the masks."""

    def __init__(self) -> None:
        self.key: Optional[torch.Tensor] = None    # [b, ng, cap, hn]
        self.value: Optional[torch.Tensor] = None  # [b, ng, cap, hn]
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

    def add_rows(self, key: torch.Tensor, value: torch.Tensor, lengths: Sequence[int]) -> None:
        """New last rows from a ``KVCache`` filled by right-padded prompts, keys and values [s, k, ng, hn]:
        row i keeps its first ``lengths[i]`` positions (the rest, padding, become zeros)."""
        s, k = key.shape[:2]
        if len(lengths) != k or not all(0 < n <= s for n in lengths):
            raise ValueError(f"lengths {list(lengths)} must give 1 .. {s} positions for each of the {k} rows")
        if self.key is None:
            self.key = key.new_zeros((0, key.shape[2], max(s, 16), key.shape[3]))  # [0, ng, cap, hn]
            self.value = value.new_zeros(self.key.shape)
        elif key.shape[2:] != (self.key.shape[1], self.key.shape[3]) or key.dtype != self.key.dtype:
            raise ValueError(f"rows of keys {list(key.shape)} ({key.dtype}) do not fit a cache of "
                             f"{list(self.key.shape)} ({self.key.dtype})")
        self._reserve(s)
        lengths_t = torch.tensor(list(lengths), dtype=torch.long)
        padding = torch.arange(s)[None, :] >= lengths_t[:, None]  # [k, s]
        rows = []
        for new in (key, value):
            row = new.new_zeros((k, self.key.shape[1], self.key.shape[2], self.key.shape[3]))  # [k, ng, cap, hn]
            row[:, :, :s] = new.permute(1, 2, 0, 3).masked_fill(padding[:, None, :, None].to(new.device), 0)
            rows.append(row)
        self.key = torch.cat((self.key, rows[0]), dim=0)  # [b + k, ng, cap, hn]
        self.value = torch.cat((self.value, rows[1]), dim=0)  # [b + k, ng, cap, hn]
        self.row_lengths = torch.cat((self.row_lengths, lengths_t))

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order); the others' sequences have ended."""
        index = torch.tensor(list(rows), dtype=torch.long)
        self.row_lengths = self.row_lengths[index]
        if self.key is not None:
            self.key = self.key.index_select(0, index.to(self.key.device))  # [b', ng, cap, hn]
            self.value = self.value.index_select(0, index.to(self.key.device))  # [b', ng, cap, hn]

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys and values [sq, b, ng, hn] at each row's own positions; return the keys
        and values of positions 0 .. longest row - 1 as views [sk, b, ng, hn] (rows shorter than sk: zeros
        past their length, which ``row_lengths`` lets the attention mask out)."""
        sq, b = key.shape[:2]
        if self.key is None or b != self.num_rows:
            raise ValueError(f"the cache holds {self.num_rows} rows but got keys for {b}; add each sequence "
                             f"with add_rows first")
        self._reserve(self.length + sq)
        positions = self.position_ids(sq, self.key.device)  # [b, sq]
        rows = torch.arange(b, device=self.key.device)[:, None].expand(b, sq)  # [b, sq]
        # the two index tensors are apart (ng between them), so the indexed view is [b, sq, ng, hn]
        self.key[rows, :, positions] = key.transpose(0, 1)
        self.value[rows, :, positions] = value.transpose(0, 1)
        self.row_lengths = self.row_lengths + sq
        sk = self.length
        return self.key[:, :, :sk].permute(2, 0, 1, 3), self.value[:, :, :sk].permute(2, 0, 1, 3)  # [sk, b, ng, hn]

    def _reserve(self, positions: int) -> None:
        cap = self.key.shape[2]
        if positions <= cap:
            return
        while cap < positions:
            cap *= 2
        grown = self.key.new_zeros((self.key.shape[0], self.key.shape[1], cap, self.key.shape[3]))  # [b, ng, cap, hn]
        grown_value = grown.clone()
        grown[:, :, :self.key.shape[2]], grown_value[:, :, :self.key.shape[2]] = self.key, self.value
        self.key, self.value = grown, grown_value
