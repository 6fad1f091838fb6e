"""FP8 delayed scaling's state in universal checkpoints: each FP8 layer's amax history and scales are buffers
(``megatron.parallel.fp8_linear``), not among the optimizer's parameter folders that DeepSpeed's universal loader
reads, so the conversion keeps them in a file of their own, by GPTModel name, and a universal resume puts them
back. They are the same on every TP, data and expert rank (reduced over them every iteration), so any layout
takes them as saved; a history of another length keeps its newest rows (or starts the missing rows at zero).

    FP8_STATE_FILE                              written at conversion (``save_fp8_state``)
    load_fp8_state(module, tag_dir, config)     at a universal resume: into this rank's module

No deepspeed import (``megatron.checkpoint.resume`` reads it).
"""

from __future__ import annotations

import glob
import os
import shutil

import torch

from megatron.checkpoint.safe_load import safe_load
from megatron.config import ModelConfig
from megatron.model.layout import model_name, pipeline_items
from megatron.parallel.fp8_linear import is_fp8_state_key

__all__ = ["FP8_STATE_FILE", "save_fp8_state", "load_fp8_state"]

FP8_STATE_FILE = "fp8_scaling_state.pt"


def save_fp8_state(tag_dir: str, out_dir: str, config: ModelConfig) -> int:
    """Copy the FP8 scaling state of the regular checkpoint ``tag_dir`` (the pipeline engine's layer files, or the
    model engine's model states) to ``out_dir/FP8_STATE_FILE`` by GPTModel name; how many tensors (0: no file)."""
    state = {}
    for item in pipeline_items(config):
        if item.layer_number is None:
            continue
        files = sorted(glob.glob(os.path.join(tag_dir, f"layer_{item.index:02d}-model_*-model_states.pt")))
        if files:  # the same on every TP rank: the first file's
            saved = safe_load(files[0])
            state.update({item.prefix + key: t for key, t in saved.items() if is_fp8_state_key(key)})
    if not state:
        for path in sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))[:1]:
            module = safe_load(path).get("module") or {}
            state = {name: t for name, t in module.items() if is_fp8_state_key(name)}
    if state:
        torch.save(state, os.path.join(out_dir, FP8_STATE_FILE))
    # DeepSpeed's converter writes a zero/ folder for every module-state entry of a model-engine checkpoint that
    # has no optimizer fragment, buffers included: this state lives in FP8_STATE_FILE
    for name in state:
        shutil.rmtree(os.path.join(out_dir, "zero", name), ignore_errors=True)
    return len(state)


@torch.no_grad()
def load_fp8_state(module: torch.nn.Module, tag_dir: str, config: ModelConfig) -> int:
    """Copy the FP8 scaling state of ``tag_dir/FP8_STATE_FILE`` (if any) into ``module``'s FP8 layers that have
    it saved (a GPTModel or a pipeline stage); how many tensors."""
    path = os.path.join(tag_dir, FP8_STATE_FILE)
    if not os.path.isfile(path):
        return 0
    saved = safe_load(path)
    count = 0
    for name, buffer in module.named_buffers():
        if not is_fp8_state_key(name):
            continue
        source = saved.get(name if name.startswith("layers.") else model_name(name, config))
        if source is None:
            continue
        rows = min(buffer.shape[0], source.shape[0]) if buffer.dim() == 2 else buffer.shape[0]
        if buffer.dim() == 2:
            buffer.zero_()
        buffer[:rows].copy_(source[:rows])
        count += 1
    return count
