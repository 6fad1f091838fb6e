"""Megatron-DeepSpeed's two ways of naming training data, parsed into ``DataConfig`` pieces.

1. ``--data-path PREFIX`` or ``--data-path W1 PREFIX1 W2 PREFIX2 ...`` (a weighted blend);
2. ``--train-weighted-split-paths "NAME: W START:END PREFIX, W START:END PREFIX"`` (and valid/test,
   which may hold several groups), or the same groups read from a file by the ``-path`` variants:
   one line, each group between double quotes, groups separated by a space, as BigScience's
   ``load_ratios_meg_ds_format.py`` writes them.

Every prefix must have its ``.bin`` and ``.idx``: a missing one is named before any process starts.
"""

from __future__ import annotations

import os
import shlex
from typing import Optional, Sequence

from megatron.config import DatasetGroup, DatasetSplit

GROUP_FORMAT = '"NAME: WEIGHT START:END PREFIX, WEIGHT START:END PREFIX, ..."'


def parse_data_path(values: Optional[Sequence[str]]) -> tuple[tuple[float, str], ...]:
    """``--data-path`` values -> ((weight, prefix), ...); a single prefix gets weight 1.0."""
    if not values:
        return ()
    if len(values) == 1:
        return ((1.0, values[0]),)
    if len(values) % 2:
        raise ValueError(f"--data-path takes one PREFIX or WEIGHT PREFIX pairs, got {len(values)} values: "
                         f"{' '.join(values)}")
    pairs = []
    for weight, prefix in zip(values[0::2], values[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"--data-path: {weight!r} should be the weight before prefix {prefix!r}") from None
        if w < 0:
            raise ValueError(f"--data-path: weight {w} of {prefix!r} is negative")
        pairs.append((w, prefix))
    if not sum(w for w, _ in pairs) > 0:
        raise ValueError("--data-path: the weights sum to zero")
    return tuple(pairs)


def parse_group(text: str, flag: str) -> DatasetGroup:
    """One ``"NAME: W START:END PREFIX, ..."`` group."""
    name, sep, body = text.partition(":")
    if not sep or not name.strip() or not body.strip():
        raise ValueError(f"{flag}: {text!r} is not of the form {GROUP_FORMAT}")
    datasets = []
    for item in body.split(","):
        parts = item.split()
        if len(parts) != 3 or parts[1].count(":") != 1:
            raise ValueError(f"{flag}: {item.strip()!r} in group {name.strip()!r} is not 'WEIGHT START:END PREFIX'")
        try:
            weight = float(parts[0])
            start, end = (float(x) for x in parts[1].split(":"))
        except ValueError:
            raise ValueError(f"{flag}: {item.strip()!r} in group {name.strip()!r}: WEIGHT, START and END must "
                             "be numbers") from None
        if not 0 <= start < end <= 1 or weight < 0:
            raise ValueError(f"{flag}: {item.strip()!r} in group {name.strip()!r}: need 0 <= START < END <= 1 "
                             f"and WEIGHT >= 0")
        datasets.append(DatasetSplit(weight, start, end, parts[2]))
    return DatasetGroup(name.strip(), tuple(datasets))


def read_groups_file(path: str, flag: str) -> list[str]:
    """The group strings of a ``--*-weighted-split-paths-path`` file."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r}: no such file")
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    if len(lines) != 1 or not (lines[0].strip().startswith('"') and lines[0].strip().endswith('"')):
        raise ValueError(f"{flag} {path!r}: expected one line of double-quoted groups "
                         f"{GROUP_FORMAT} {GROUP_FORMAT}, got {len(lines)} line(s)")
    try:
        return shlex.split(lines[0])
    except ValueError as e:
        raise ValueError(f"{flag} {path!r}: {e}") from None


def parse_weighted_split(values: Optional[Sequence[str]], file: Optional[str], split: str) -> tuple[DatasetGroup, ...]:
    """The groups of ``--{split}-weighted-split-paths`` or of its ``-path`` file (not both)."""
    flag = f"--{split}-weighted-split-paths"
    if values and file:
        raise ValueError(f"{flag} and {flag}-path both given; pass one")
    if file:
        values, flag = read_groups_file(file, f"{flag}-path"), f"{flag}-path {file}"
    groups = tuple(parse_group(v, flag) for v in values or ())
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"{flag}: group names must be unique, got {names}")
    return groups


def missing_prefixes(prefixes: Sequence[str]) -> list[str]:
    """``prefix.bin`` / ``prefix.idx`` files that do not exist."""
    missing = []
    for prefix in dict.fromkeys(prefixes):
        missing += [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    return missing
