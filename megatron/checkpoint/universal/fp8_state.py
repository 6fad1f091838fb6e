"""FP8 delayed scaling's state in universal checkpoints: each FP8 layer's amax history and scales are buffers
(``megatron.parallel.fp8_linear``), not among the optimizer's parameter folders that DeepSpeed's universal loader
reads, so the conversion keeps them in a file of their own, by GPTModel name (``expert_folders.save_fp8_state``),
and a universal resume puts them back. They are the same on every TP, data and expert rank (reduced over them every
iteration), so any layout takes them as saved; a history of another length keeps its newest rows (or starts the
missing rows at zero).

    FP8_STATE_FILE                              written at conversion
    load_fp8_state(module, tag_dir, config)     at a universal resume: into this rank's module

No deepspeed import (``megatron.checkpoint.resume`` reads it).
"""

from __future__ import annotations

import torch

from megatron.checkpoint.universal.router_state import saved_buffers
from megatron.config import ModelConfig
from megatron.parallel.fp8_linear import is_fp8_state_key

__all__ = ["FP8_STATE_FILE", "load_fp8_state"]

FP8_STATE_FILE = "fp8_scaling_state.pt"


@torch.no_grad()
def load_fp8_state(module: torch.nn.Module, tag_dir: str, config: ModelConfig) -> int:
    """Copy the FP8 scaling state of ``tag_dir/FP8_STATE_FILE`` (if any) into ``module``'s FP8 layers that have
    it saved (a GPTModel or a pipeline stage); how many tensors."""
    count = 0
    for buffer, source in saved_buffers(module, tag_dir, config, FP8_STATE_FILE, is_fp8_state_key):
        if source is None:
            continue
        if buffer.dim() == 2:  # an amax history: the newest rows that fit, the rest zero
            rows = min(buffer.shape[0], source.shape[0])
            buffer.zero_()
            buffer[:rows].copy_(source[:rows])
        else:
            buffer.copy_(source)
        count += 1
    return count
