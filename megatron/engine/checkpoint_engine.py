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

from megatron.checkpoint.safe_load import safe_load
from megatron.checkpoint.zero_files import DEEPSPEED_GLOBALS  # the DeepSpeed classes its files hold

__all__ = ["DEEPSPEED_GLOBALS", "SafeTorchCheckpointEngine", "use_safe_loading"]


class SafeTorchCheckpointEngine(TorchCheckpointEngine):
    def load(self, path: str, map_location=None):
        return safe_load(path, extra_globals=DEEPSPEED_GLOBALS, map_location=map_location)


def use_safe_loading(engine) -> None:
    """Give ``engine`` (after ``deepspeed.initialize``) the safe-loading engine in place of DeepSpeed's."""
    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise ValueError(f"DeepSpeed chose the checkpoint engine {type(engine.checkpoint_engine).__name__}; only its "
                         f"torch engine is supported here (remove the checkpoint engine settings from the JSON)")
    engine.checkpoint_engine = SafeTorchCheckpointEngine(engine._config)
