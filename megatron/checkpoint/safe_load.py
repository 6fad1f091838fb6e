"""Reading a checkpoint file without running code: ``torch.load(weights_only=True)`` only.

A checkpoint may come from anyone; a pickle can run any code when it is loaded. Tensors, numbers,
strings and containers load; the only classes allowed beyond torch's own are what numpy's RNG state
(in our client state) needs and Megatron's ``args`` Namespace with the enums bigscience's Megatron-DeepSpeed keeps in it
(read as stand-ins of the same names and values; their module is never imported). Anything else is a CheckpointFormatError naming the file and the
globals it asks for.
"""

from __future__ import annotations

import argparse
import enum
from typing import Any, Sequence

import numpy as np
import torch

from megatron.checkpoint.tags import CheckpointFormatError

__all__ = ["safe_load"]


class PositionEmbeddingType(enum.Enum):
    """Read in place of bigscience Megatron-DeepSpeed's ``megatron.enums.PositionEmbeddingType``, which
    its ``args`` hold (the same names and values); its code is not needed, nor run."""

    rotary = 1
    absolute = 2
    alibi = 3


class AttnMaskType(enum.Enum):
    """In place of ``megatron.enums.AttnMaskType`` (bigscience's values)."""

    padding = 1
    causal = 2
    prefix = 3
    custom = 4


# numpy's RNG state (in our client state) pickles as an ndarray; Megatron's ``args`` record is an
# argparse.Namespace (its attributes are loaded by the same safe unpickler), with Megatron's enums.
SAFE_GLOBALS = [np.ndarray, np.dtype, np._core.multiarray._reconstruct, type(np.dtype(np.uint32)), argparse.Namespace,
                (PositionEmbeddingType, "megatron.enums.PositionEmbeddingType"),
                (AttnMaskType, "megatron.enums.AttnMaskType")]


def safe_load(path: str, extra_globals: Sequence[Any] = (), map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` with ``SAFE_GLOBALS`` (and ``extra_globals``) allowed;
    CheckpointFormatError naming the file and what it needs otherwise."""
    allowed = SAFE_GLOBALS + list(extra_globals)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # noqa: BLE001 - name the offending globals, whatever torch raised
        try:
            needs = f"it needs {torch.serialization.get_unsafe_globals_in_checkpoint(path)}"
        except Exception:  # noqa: BLE001 - not even a readable torch file
            needs = "it is not a readable torch file"
        raise CheckpointFormatError(f"{path!r} does not load with torch.load(weights_only=True) ({needs}): "
                                    f"{error}") from error
