"""DeepSpeed's own checkpoint files: the classes they pickle, and the weights its model engine saved.

A run with ``--zero-stage`` 2 or 3 (``megatron.engine.model_engine``) saves what DeepSpeed's model
engine writes: per TP rank ``t`` and DP rank ``d``, ``zero_pp_rank_{d}_mp_rank_{t}_optim_states.pt``
holding that rank's partition of the fp32 master weights (and Adam's moments), and the module's
bookkeeping (``mp_rank_{t}_model_states.pt`` under ZeRO-2, ``zero_pp_rank_{d}_mp_rank_{t}_model_states.pt``
under ZeRO-3: parameter names and shapes; under ZeRO-3 no weights at all). ``sharded_state_dict``
puts the fp32 masters back together with DeepSpeed's ``zero_to_fp32`` (one TP rank at a time: it
reads one model-parallel rank's files), every file read weights-only (``only_safe_loading``), then
merges the TP slices as the parameter layout says: the GPTModel state dict the exporters take. At ZeRO-0/1
(DeepSpeed-Ulysses runs) the weights are the module's own, in ``mp_rank_{t}_model_states.pt``
(``module_states_state_dict``).
"""

from __future__ import annotations

import os
import re
import tempfile

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from megatron.checkpoint.safe_load import only_safe_loading, safe_load
from megatron.checkpoint.tags import CheckpointFormatError
from megatron.checkpoint.tp_shards import merge_tp_shards
from megatron.config import ModelConfig
from megatron.model.layout import parameter_layout

__all__ = ["DEEPSPEED_GLOBALS", "sharded_state_dict", "module_states_state_dict"]

# The DeepSpeed classes its own checkpoint files hold: the optimizer states' parameter mappings and,
# for ZeRO / fp16 optimizers, their loss scaler and ZeRO stage. Plain data classes: restoring them
# sets attributes, it runs nothing of the file's choosing.
DEEPSPEED_GLOBALS = (fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum)

_MP_RANK = re.compile(r"mp_rank_(\d+)")


def _files_of_tp_rank(tag_dir: str, tp_rank: int) -> list[str]:
    return sorted(name for name in os.listdir(tag_dir) if name.endswith(".pt")
                  and (m := _MP_RANK.search(name)) is not None and int(m.group(1)) == tp_rank)


def _tp_rank_masters(tag_dir: str, tp_rank: int) -> dict[str, torch.Tensor]:
    """The fp32 master weights of one TP rank's slice, by GPTModel name (zero_to_fp32 on its files alone)."""
    names = _files_of_tp_rank(tag_dir, tp_rank)
    if not any(name.endswith("_optim_states.pt") for name in names):
        raise CheckpointFormatError(f"{tag_dir!r} has no ZeRO optimizer states of tensor-parallel rank {tp_rank} "
                                    f"(zero_pp_rank_*_mp_rank_{tp_rank:02d}_optim_states.pt): incomplete")
    with tempfile.TemporaryDirectory() as root:
        # zero_to_fp32 reads the files of model-parallel rank 0 only: show it this rank's under that name
        view = os.path.join(root, "tag")
        os.makedirs(view)
        real = {}
        for name in names:
            shown = os.path.join(view, _MP_RANK.sub("mp_rank_00", name))
            real[shown] = os.path.join(os.path.abspath(tag_dir), name)
            os.symlink(real[shown], shown)
        try:
            with only_safe_loading(DEEPSPEED_GLOBALS):
                state = get_fp32_state_dict_from_zero_checkpoint(root, tag="tag")
        except CheckpointFormatError as error:  # name the checkpoint's file, not the view's link
            message = str(error)
            for shown, path in real.items():
                message = message.replace(shown, path)
            raise CheckpointFormatError(message) from error
    return dict(state)


def sharded_state_dict(tag_dir: str, config: ModelConfig, tp: int) -> dict[str, torch.Tensor]:
    """The TP=1 GPTModel state dict (fp32 master weights) of a ZeRO-2 / ZeRO-3 checkpoint saved at TP ``tp``."""
    return _merged(tag_dir, config, [_tp_rank_masters(tag_dir, rank) for rank in range(tp)], "the ZeRO states")


def module_states_state_dict(tag_dir: str, config: ModelConfig, tp: int) -> dict[str, torch.Tensor]:
    """The TP=1 GPTModel state dict of a checkpoint DeepSpeed's model engine saved at ZeRO-0/1 (a
    DeepSpeed-Ulysses run): each TP rank's whole module, in ``mp_rank_{t}_model_states.pt``, in its saved dtype."""
    shards = []
    for rank in range(tp):
        path = os.path.join(tag_dir, f"mp_rank_{rank:02d}_model_states.pt")
        if not os.path.isfile(path):
            raise CheckpointFormatError(f"{tag_dir!r} has no {os.path.basename(path)} (tensor-parallel rank {rank}'s "
                                        f"module): incomplete")
        module = safe_load(path, DEEPSPEED_GLOBALS).get("module")
        if not isinstance(module, dict):
            raise CheckpointFormatError(f"{path!r} holds no module state dict under 'module'")
        shards.append(module)
    return _merged(tag_dir, config, shards, "the module states")


def _merged(tag_dir: str, config: ModelConfig, shards: list[dict], what: str) -> dict[str, torch.Tensor]:
    layout = parameter_layout(config)
    for rank, shard in enumerate(shards):
        if set(shard) != set(layout):
            missing, extra = sorted(set(layout) - set(shard)), sorted(set(shard) - set(layout))
            raise CheckpointFormatError(f"{tag_dir!r}, tensor-parallel rank {rank}: {what} hold other parameters "
                                        f"than the recorded model (missing {missing[:5]}, unknown {extra[:5]})")
    return {name: merge_tp_shards(layout[name], [shard[name] for shard in shards]) for name in layout}
