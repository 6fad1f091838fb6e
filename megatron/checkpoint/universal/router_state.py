"""MoE routers' expert biases in universal checkpoints: buffers moved outside the gradient (aux-loss-free
balancing), so not among the optimizer's parameter folders that DeepSpeed's universal loader reads.

    ROUTER_STATE_FILE                             written at conversion (``expert_folders.save_router_state``):
                                                  {GPTModel buffer name: expert bias}
    load_router_state(module, tag_dir, config)    at a universal resume: back into the routers of this rank's
                                                  module (a pipeline stage or a GPTModel)

No deepspeed import (``megatron.checkpoint.resume`` reads it).
"""

from __future__ import annotations

import os

import torch

from megatron.checkpoint.safe_load import safe_load
from megatron.config import ModelConfig
from megatron.model.layout import model_name

__all__ = ["ROUTER_STATE_FILE", "ROUTER_BUFFER", "load_router_state"]

ROUTER_STATE_FILE = "moe_router_state.pt"
ROUTER_BUFFER = "mlp.router.expert_bias"  # a router's bias, by its name in a transformer layer


@torch.no_grad()
def load_router_state(module: torch.nn.Module, tag_dir: str, config: ModelConfig) -> int:
    """Copy the expert biases of ``tag_dir/ROUTER_STATE_FILE`` (if any) into ``module``'s routers (a GPTModel or
    a pipeline stage); how many."""
    path = os.path.join(tag_dir, ROUTER_STATE_FILE)
    if not os.path.isfile(path):
        return 0
    saved = safe_load(path)
    count = 0
    for name, buffer in module.named_buffers():
        if name.endswith(ROUTER_BUFFER):
            buffer.copy_(saved[name if name.startswith("layers.") else model_name(name, config)])
            count += 1
    return count
