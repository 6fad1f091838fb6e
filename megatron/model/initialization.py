"""Weight initialization that depends only on (seed, which parameter), never on build order.

A pipeline stage that builds only layers 3..5 must start from exactly the weights those layers have
in the full model, and a TP=2 model must start from exactly the TP=1 weights. Both follow if every
weight is drawn from its own ``torch.Generator`` seeded from ``(config.seed, parameter name)``, and
the tensor-parallel layers draw the FULL weight on every rank and keep their slice.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import torch

from megatron.config import ModelConfig
from megatron.parallel.utils import fp32_empty

__all__ = ["init_generator", "normal_init", "output_layer_std", "params_torch_dtype"]

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def params_torch_dtype(config: ModelConfig) -> torch.dtype:
    """The torch dtype named by ``config.params_dtype`` ('fp32' | 'bf16' | 'fp16')."""
    if config.params_dtype not in _TORCH_DTYPES:
        raise ValueError(f"params_dtype {config.params_dtype!r} is not one of {', '.join(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[config.params_dtype]


def init_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator whose stream depends only on ``seed`` and the parameter's ``name``.

    sha256 rather than Python's ``hash`` because the latter is salted per process: every rank and
    every run must derive the same stream.
    """
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def normal_init(std: float, seed: int, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init_method: fill a full (unsharded) weight in place with normal(0, std) from its own stream.

    Each call draws from a fresh generator, so calling it twice on the same shape gives the same
    tensor (as happens when every TP rank draws the full weight before keeping its slice).
    """
    def init_(weight: torch.Tensor) -> torch.Tensor:
        generator = init_generator(seed, name)
        with torch.no_grad():
            if weight.device.type == "cpu" and weight.dtype == torch.float32:
                return weight.normal_(0.0, std, generator=generator)
            # Draw on CPU in fp32 so the values do not depend on the device or the dtype.
            full = fp32_empty(weight.shape).normal_(0.0, std, generator=generator)
            return weight.copy_(full)

    return init_


def output_layer_std(config: ModelConfig) -> float:
    """std of the projections that write into the residual stream: std / sqrt(2 * num_layers).

    Each layer adds two such branches, so the residual's variance grows as 2 * num_layers
    (GPT-2 paper, section 2.3).
    """
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)
