"""Reading a checkpoint file without running code: ``torch.load(weights_only=True)`` only.

A checkpoint may come from anyone; a pickle can run any code when it is loaded. Tensors, numbers,
strings and containers load; the only classes allowed beyond torch's own are what numpy's RNG state
(in our client state) needs and Megatron's ``args`` Namespace with the enums bigscience's Megatron-DeepSpeed keeps in it
(read as stand-ins of the same names and values; their module is never imported). Anything else is a
CheckpointFormatError naming the file and the globals it asks for.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from megatron.checkpoint.tags import CheckpointFormatError

__all__ = ["safe_load", "only_safe_loading"]


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


_torch_load = torch.serialization.load  # torch's own, whatever only_safe_loading puts in torch.load
_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def safe_load(path: str, extra_globals: Sequence[Any] = (), map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` with ``SAFE_GLOBALS`` (and ``extra_globals``) allowed;
    CheckpointFormatError naming the file and what it needs otherwise."""
    allowed = SAFE_GLOBALS + list(extra_globals)
    with torch.serialization.safe_globals(allowed):
        try:
            return _torch_load(path, map_location=map_location, weights_only=True)
        except Exception as error:  # noqa: BLE001 - name the offending globals, whatever torch raised
            try:  # inside the allowlist's context: only what it does not allow is named
                needs = f"it asks for {sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))}, which "
                needs += "only an unsafe load would import"
            except Exception:  # noqa: BLE001 - not even a readable torch file
                needs = "it is not a readable torch file"
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CheckpointFormatError(f"{path!r} does not load with torch.load(weights_only=True) ({needs}): "
                                        f"{first_line}") from error


@contextlib.contextmanager
def only_safe_loading(extra_globals: Sequence[Any] = ()) -> Iterator[None]:
    """Within: every ``torch.load`` of this process is ``safe_load``, whatever its caller asks for.

    For code that is not ours and asks torch for ``weights_only=False`` itself (DeepSpeed's universal
    checkpoint converter and loader). A file path is read by ``safe_load`` (a refusal names the file);
    a file object by torch's weights-only unpickler. Worker processes forked inside inherit it; for
    any started otherwise, ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` in the environment makes torch refuse
    unsafe globals there too (without our allowlist: they fail closed).
    """
    allowed = SAFE_GLOBALS + list(extra_globals)

    def load(f, map_location=None, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            return safe_load(os.fspath(f), extra_globals=extra_globals, map_location=map_location)
        kwargs.pop("weights_only", None)
        with torch.serialization.safe_globals(allowed):
            return _torch_load(f, map_location, *args, weights_only=True, **kwargs)

    saved_load, saved_env = torch.load, os.environ.get(_FORCE_WEIGHTS_ONLY)
    torch.load = load
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        yield
    finally:
        torch.load = saved_load
        if saved_env is None:
            os.environ.pop(_FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[_FORCE_WEIGHTS_ONLY] = saved_env
