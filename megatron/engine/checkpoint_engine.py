"""DeepSpeed's checkpoint engine, loading without running code.

DeepSpeed's ``TorchCheckpointEngine.load`` calls ``torch.load(weights_only=False)``: a crafted pickle
in any file of a checkpoint handed to ``--load`` would run. ``SafeTorchCheckpointEngine`` is the
same engine with ``load`` going through ``megatron.checkpoint.safe_load`` (tensors, containers,
numpy's RNG state, Megatron's args), plus the few DeepSpeed classes its own files hold
(``DEEPSPEED_GLOBALS``). It also reads checkpoints that
bigscience's Megatron-DeepSpeed wrote, whose args pickle its ``megatron.enums`` (read as stand-ins).
"""

from __future__ import annotations

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from megatron.checkpoint.safe_load import safe_load

# The DeepSpeed classes its own checkpoint files hold: the optimizer states' parameter mappings and,
# for ZeRO / fp16 optimizers, their loss scaler and ZeRO stage. Plain data classes: restoring them
# sets attributes, it runs nothing of the file's choosing.
DEEPSPEED_GLOBALS = (fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum)


class SafeTorchCheckpointEngine(TorchCheckpointEngine):
    def load(self, path: str, map_location=None):
        return safe_load(path, extra_globals=DEEPSPEED_GLOBALS, map_location=map_location)


def use_safe_loading(engine) -> None:
    """Give ``engine`` (after ``deepspeed.initialize``) the safe-loading engine in place of DeepSpeed's."""
    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise ValueError(f"DeepSpeed chose the checkpoint engine {type(engine.checkpoint_engine).__name__}; only its "
                         f"torch engine is supported here (remove the checkpoint engine settings from the JSON)")
    engine.checkpoint_engine = SafeTorchCheckpointEngine(engine._config)
