"""MoE routers' expert biases in universal checkpoints: buffers moved outside the gradient (aux-loss-free
balancing), so not among the optimizer's parameter folders that DeepSpeed's universal loader reads.

    ROUTER_STATE_FILE                             written at conversion (``expert_folders.save_router_state``):
                                                  {GPTModel buffer name: expert bias}
    load_router_state(module, tag_dir, config)    at a universal resume: back into the routers of this rank's
                                                  module (a pipeline stage or a GPTModel)
    saved_buffers(module, tag_dir, config, ...)   a module's buffers paired with their saved tensors (also
                                                  FP8 scaling state's, ``fp8_state``)

No deepspeed import (``megatron.checkpoint.resume`` reads it).
"""

from __future__ import annotations

import os
from typing import Iterator, Optional

import torch

from megatron.checkpoint.safe_load import safe_load
from megatron.config import ModelConfig
from megatron.model.layout import model_name

__all__ = ["ROUTER_STATE_FILE", "ROUTER_BUFFER", "load_router_state", "saved_buffers"]

ROUTER_STATE_FILE = "moe_router_state.pt"
ROUTER_BUFFER = "mlp.router.expert_bias"  # a router's bias, by its name in a transformer layer


def saved_buffers(module: torch.nn.Module, tag_dir: str, config: ModelConfig, file_name: str,
                  wanted) -> Iterator[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Each buffer of ``module`` (a GPTModel or a pipeline stage) whose name ``wanted(name)`` accepts, with its
    tensor in ``tag_dir/file_name`` by GPTModel name (None where it is not there); nothing without the file."""
    path = os.path.join(tag_dir, file_name)
    if not os.path.isfile(path):
        return
    saved = safe_load(path)
    for name, buffer in module.named_buffers():
        if wanted(name):
            yield buffer, saved.get(name if name.startswith("layers.") else model_name(name, config))


@torch.no_grad()
def load_router_state(module: torch.nn.Module, tag_dir: str, config: ModelConfig) -> int:
    """Copy the expert biases of ``tag_dir/ROUTER_STATE_FILE`` (if any) into ``module``'s routers (a GPTModel or
    a pipeline stage); how many."""
    count = 0
    for buffer, saved in saved_buffers(module, tag_dir, config, ROUTER_STATE_FILE,
                                       lambda name: name.endswith(ROUTER_BUFFER)):
        if saved is None:
            raise KeyError(f"{ROUTER_STATE_FILE} of {tag_dir!r} has no expert bias for a router of this model")
        buffer.copy_(saved)
        count += 1
    return count
