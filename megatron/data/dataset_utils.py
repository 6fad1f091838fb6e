"""Parsing of Megatron's dataset flags: ``--split``, weighted ``--data-path`` and Megatron-DeepSpeed's
weighted split paths (``--{train,valid,test}-weighted-split-paths[-path]``).

Pure functions over strings and numbers; every malformed input raises ``ValueError`` naming the
value and the expected form. Imports only the standard library.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(splits_string: str, num_documents: int) -> list[int]:
    """Document boundaries [0, a, b, num_documents] for ``--split`` such as "969,30,1" or "98/2/0".

    Parts are normalized to their sum (missing parts are 0), each split gets
    ``round(fraction * num_documents)`` documents, and any rounding excess is taken off the
    later boundaries so the last is exactly ``num_documents`` (Megatron's rule).
    """
    text = splits_string.strip()
    separator = "," if "," in text else "/"
    try:
        parts = [float(s) for s in text.split(separator)]
    except ValueError:
        raise ValueError(
            f"--split {splits_string!r}: expected up to three numbers separated by ',' or '/', e.g. '969,30,1'"
        ) from None
    if len(parts) > 3:
        raise ValueError(f"--split {splits_string!r} has {len(parts)} parts; give train,valid,test (at most 3)")
    parts += [0.0] * (3 - len(parts))
    if any(p < 0 or not math.isfinite(p) for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {splits_string!r}: parts must be finite, non-negative and sum to > 0")
    if num_documents < 0:
        raise ValueError(f"num_documents must be >= 0, got {num_documents}")
    total = sum(parts)
    bounds = [0]
    for part in parts:
        bounds.append(bounds[-1] + int(round(part / total * num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    bounds = [max(0, b) for b in bounds]
    return bounds


def parse_range(range_string: str, num_documents: int) -> tuple[int, int]:
    """Documents [start, end) for a weighted-split range "START:END" given as fractions in [0, 1]."""
    try:
        start, end = (float(s) for s in range_string.split(":"))
    except ValueError:
        raise ValueError(f"range {range_string!r}: expected 'START:END' with fractions, e.g. '0:0.95'") from None
    if not 0.0 <= start < end <= 1.0:
        raise ValueError(f"range {range_string!r}: need 0 <= START < END <= 1")
    return int(round(start * num_documents)), int(round(end * num_documents))


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """``--data-path`` values -> (prefixes, normalized weights).

    Either a single prefix (weight 1), or pairs "W1 PREFIX1 W2 PREFIX2 ..." with weights > 0.
    """
    values = [str(v) for v in data_path]
    if not values:
        raise ValueError("--data-path is empty; give a prefix or 'WEIGHT PREFIX' pairs")
    if len(values) == 1:
        return values, [1.0]
    if len(values) % 2:
        raise ValueError(
            f"--data-path {' '.join(values)}: with several datasets give 'WEIGHT PREFIX' pairs "
            f"(got {len(values)} values, an odd number)"
        )
    prefixes, weights = [], []
    for weight_text, prefix in zip(values[0::2], values[1::2]):
        try:
            weight = float(weight_text)
        except ValueError:
            raise ValueError(f"--data-path: {weight_text!r} (before {prefix!r}) is not a weight") from None
        if not weight > 0 or not math.isfinite(weight):
            raise ValueError(f"--data-path: weight {weight_text} of {prefix!r} must be a finite number > 0")
        prefixes.append(prefix)
        weights.append(weight)
    return prefixes, normalize_weights(weights)


def normalize_weights(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"weights {list(weights)} must sum to > 0")
    return [float(w) / total for w in weights]


def per_dataset_num_samples(weights: Sequence[float], num_samples: Sequence[int]) -> list[list[int]]:
    """Samples to build per dataset and split: ``ceil(weight * num * 1.005)``.

    The 0.5 % margin (Megatron's) lets the greedy blend draw slightly more than weight * num
    from a dataset in a prefix without running past its end.
    """
    return [[int(math.ceil(n * w * 1.005)) for n in num_samples] for w in weights]


@dataclass(frozen=True)
class WeightedSplitEntry:
    """One dataset of a group: documents [start, end) (fractions of the dataset) of ``prefix``."""

    weight: float
    start: float
    end: float
    prefix: str

    @property
    def range_string(self) -> str:
        return f"{self.start}:{self.end}"


@dataclass(frozen=True)
class WeightedSplitGroup:
    """A named blend, e.g. ``valid-en: 0.6 0.95:1 /data/en, 0.4 0.95:1 /data/fr``."""

    name: str
    entries: tuple[WeightedSplitEntry, ...]

    @property
    def weights(self) -> list[float]:
        return normalize_weights([e.weight for e in self.entries])


def parse_weighted_split_group(group: str) -> WeightedSplitGroup:
    """Parse "NAME: W1 START:END PATH1, W2 START:END PATH2" (Megatron-DeepSpeed's format).

    The name is the text before the first colon; entries are separated by commas; a path may
    contain spaces (everything after the range is the path) but not commas.
    """
    expected = "expected 'NAME: WEIGHT START:END PATH, WEIGHT START:END PATH, ...'"
    name, colon, body = group.partition(":")
    name = name.strip()
    if not colon or not name or " " in name:
        raise ValueError(f"weighted split group {group!r}: {expected} (a name without spaces, then ':')")
    entries = []
    for entry_text in body.split(","):
        fields = entry_text.strip().split(None, 2)
        if len(fields) != 3:
            raise ValueError(f"weighted split group {name!r}: entry {entry_text.strip()!r}: {expected}")
        weight_text, range_text, prefix = fields
        try:
            weight = float(weight_text)
            start, end = (float(s) for s in range_text.split(":"))
        except ValueError:
            raise ValueError(f"weighted split group {name!r}: entry {entry_text.strip()!r}: {expected}") from None
        if not weight > 0 or not math.isfinite(weight):
            raise ValueError(f"weighted split group {name!r}: weight {weight_text} of {prefix!r} must be > 0")
        if not 0.0 <= start < end <= 1.0:
            raise ValueError(f"weighted split group {name!r}: range {range_text} of {prefix!r}: need 0 <= START < END <= 1")
        entries.append(WeightedSplitEntry(weight, start, end, prefix))
    return WeightedSplitGroup(name, tuple(entries))


def parse_weighted_split_paths(groups: Sequence[str], split: str = "valid") -> list[WeightedSplitGroup]:
    """Parse the values of ``--{split}-weighted-split-paths``; names must be unique; train allows one group."""
    parsed = [parse_weighted_split_group(g) for g in groups]
    if split == "train" and len(parsed) > 1:
        raise ValueError(
            f"--train-weighted-split-paths takes one group, got {len(parsed)} "
            f"({', '.join(g.name for g in parsed)}); blend them into a single group"
        )
    names = [g.name for g in parsed]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--{split}-weighted-split-paths: group names must be unique, repeated: {duplicates}")
    return parsed


def read_weighted_split_paths_file(path: str | os.PathLike) -> list[str]:
    """Group strings from a ``--*-weighted-split-paths-path`` file: one group per line.

    Blank lines and lines starting with '#' are ignored; surrounding quotes are stripped.
    """
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read weighted split paths file {path}: {e}") from None
    groups = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if len(line) >= 2 and line[0] == line[-1] and line[0] in "\"'":
            line = line[1:-1].strip()
        groups.append(line)
    if not groups:
        raise ValueError(f"weighted split paths file {path} holds no group lines")
    return groups
