"""The one parser of Megatron's dataset flags, used by ``megatron.arguments`` and the dataset builders:

    --split "969,30,1"                                            document boundaries per split
    --data-path PREFIX | --data-path W1 PREFIX1 W2 PREFIX2 ...     ((weight, prefix), ...)
    --{train,valid,test}-weighted-split-paths "NAME: W START:END PREFIX, W START:END PREFIX" ...
    --{train,valid,test}-weighted-split-paths-path FILE            the same groups, read from FILE

and the blend arithmetic on the results. Groups parse into ``megatron.config.DatasetGroup``, the type
``DataConfig`` holds, so the command line and the builders share one representation. Pure functions
over strings, numbers and one small file; every malformed input raises ``ValueError`` naming the
flag, the offending group or entry, and the expected form. Imports only the standard library and
``megatron.config``.
"""

from __future__ import annotations

import math
import os
import shlex
from typing import Optional, Sequence, Union

from megatron.config import DatasetGroup, DatasetSplit

SPLIT_NAMES = ("train", "valid", "test")
GROUP_FORMAT = '"NAME: WEIGHT START:END PREFIX, WEIGHT START:END PREFIX, ..."'


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


def _weight(text: str, what: str, flag: str) -> float:
    """A blend weight: a finite number > 0 (a zero-weight dataset would be asked for 0 samples)."""
    try:
        weight = float(text)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} ({what}) is not a weight") from None
    if not weight > 0 or not math.isfinite(weight):
        raise ValueError(f"{flag}: weight {text} ({what}) must be a finite number > 0; drop the dataset instead "
                         "of giving it weight 0")
    return weight


def parse_data_path(values: Optional[Sequence[Union[str, os.PathLike]]],
                    flag: str = "--data-path") -> tuple[tuple[float, str], ...]:
    """``--data-path`` values -> ((weight, prefix), ...), as ``DataConfig.data_path`` holds them.

    Either a single prefix (weight 1.0) or "W1 PREFIX1 W2 PREFIX2 ..." pairs; the weights are kept as
    given (``normalize_weights`` makes them fractions). No values -> ``()`` (the flag is optional).
    """
    values = [os.fspath(v) for v in values or ()]
    if len(values) == 1:
        return ((1.0, values[0]),)
    if len(values) % 2:
        raise ValueError(f"{flag} {' '.join(values)}: with several datasets give 'WEIGHT PREFIX' pairs "
                         f"(got {len(values)} values, an odd number)")
    return tuple((_weight(w, f"before {prefix!r}", flag), prefix) for w, prefix in zip(values[0::2], values[1::2]))


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


def parse_group(text: str, flag: str = "--valid-weighted-split-paths") -> DatasetGroup:
    """One ``"NAME: W1 START:END PREFIX1, W2 START:END PREFIX2"`` group (Megatron-DeepSpeed's format).

    The name is the text before the first colon (no spaces: a forgotten name is then reported as
    such); entries are separated by commas; everything after the range is the prefix, which may
    hold spaces but not commas. START:END are fractions of the dataset's documents.
    """
    name, colon, body = text.partition(":")
    name = name.strip()
    if not colon or not name or len(name.split()) != 1 or not body.strip():
        raise ValueError(f"{flag}: {text!r} is not of the form {GROUP_FORMAT} (a name without spaces, then ':')")
    datasets = []
    for item in body.split(","):
        entry = item.strip()
        fields = entry.split(None, 2)
        if len(fields) != 3 or fields[1].count(":") != 1:
            raise ValueError(f"{flag}: {entry!r} in group {name!r} is not 'WEIGHT START:END PREFIX'")
        weight_text, range_text, prefix = fields
        weight = _weight(weight_text, f"of {prefix!r} in group {name!r}", flag)
        try:
            start, end = (float(x) for x in range_text.split(":"))
        except ValueError:
            raise ValueError(f"{flag}: {entry!r} in group {name!r}: START and END must be numbers") from None
        if not 0.0 <= start < end <= 1.0:
            raise ValueError(f"{flag}: {entry!r} in group {name!r}: range {range_text} needs 0 <= START < END <= 1")
        datasets.append(DatasetSplit(weight, start, end, prefix))
    return DatasetGroup(name, tuple(datasets))


def read_groups_file(path: Union[str, os.PathLike], flag: str) -> list[str]:
    """The group strings of a ``--*-weighted-split-paths-path`` file (Megatron-DeepSpeed's
    ``ParseDataPathsPath``): exactly one line, each group in double quotes, separated by spaces."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot read it ({e.strerror or e})") from None
    if len(lines) != 1 or not (lines[0].startswith('"') and lines[0].endswith('"')):
        raise ValueError(f"{flag} {path!r}: expected one line of double-quoted groups "
                         f"{GROUP_FORMAT} {GROUP_FORMAT}, got {len(lines)} line(s)")
    try:
        return shlex.split(lines[0])
    except ValueError as e:
        raise ValueError(f"{flag} {path!r}: {e}") from None


def parse_weighted_split_paths(values: Optional[Sequence[Union[str, DatasetGroup]]], split: str,
                               file: Optional[Union[str, os.PathLike]] = None) -> tuple[DatasetGroup, ...]:
    """The groups of ``--{split}-weighted-split-paths`` (``values``) or of its ``-path`` ``file`` (not both).

    ``values`` may also hold ``DatasetGroup`` objects, passed through unchanged and checked alike.
    Group names must be unique; train takes one group.
    """
    if split not in SPLIT_NAMES:
        raise ValueError(f"split {split!r} is not one of {SPLIT_NAMES}")
    flag = f"--{split}-weighted-split-paths"
    if values and file:
        raise ValueError(f"{flag} and {flag}-path both given; pass one")
    if file:
        values, flag = read_groups_file(file, f"{flag}-path"), f"{flag}-path {os.fspath(file)}"
    groups = tuple(v if isinstance(v, DatasetGroup) else parse_group(v, flag) for v in values or ())
    if split == "train" and len(groups) > 1:
        raise ValueError(f"{flag} takes one group, got {len(groups)} ({', '.join(g.name for g in groups)}); "
                         "blend them into a single group")
    names = [g.name for g in groups]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{flag}: group names must be unique, repeated: {repeated}")
    return groups


def document_range(dataset: DatasetSplit, num_documents: int) -> tuple[int, int]:
    """Documents [start, end) of a group entry's START:END fractions, over ``num_documents``."""
    return int(round(dataset.start * num_documents)), int(round(dataset.end * num_documents))
