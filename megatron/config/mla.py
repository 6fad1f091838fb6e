"""MLAConfig: multi-head latent attention (DeepSeek-V2 / V3), what replaces the fused-QKV attention of every layer.

Field names follow Megatron-LM's flags (``--q-lora-rank``, ``--kv-lora-rank``, ``--qk-head-dim``,
``--qk-pos-emb-head-dim``, ``--v-head-dim``); ``megatron.arguments.mla_flags`` maps the flags onto them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.config._checks import _positive

__all__ = ["MLAConfig"]


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """The sizes of multi-head latent attention (``megatron.model.latent_attention``).

    Queries: q = W_qB norm(W_qA x) through a rank-``q_lora_rank`` latent, or q = W_q x when it is None. Keys and
    values: one latent c = norm(W_kvA x) of rank ``kv_lora_rank`` per token, expanded per head by W_kvB into the
    key's position-free part (``qk_head_dim``) and the value (``v_head_dim``); the key's rotary part
    (``qk_pos_emb_head_dim``) is computed from x once and shared by every head. The norms exist with
    ``--qk-layernorm`` (Megatron-LM's meaning of that flag under MLA; DeepSeek-V3 has them).
    """

    q_lora_rank: Optional[int] = None  # None: a full-rank query projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = 32
    qk_head_dim: int = 128             # per head: the query / key part without positions
    qk_pos_emb_head_dim: int = 64      # per head: the rotary part of query and key
    v_head_dim: int = 128              # per head: the value

    @property
    def q_head_dim(self) -> int:
        """A query / key head's width: the position-free part and the rotary part."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def validate(self) -> "MLAConfig":
        _positive("--q-lora-rank", self.q_lora_rank, allow_none=True)
        for flag, value in (("--kv-lora-rank", self.kv_lora_rank), ("--qk-head-dim", self.qk_head_dim),
                            ("--qk-pos-emb-head-dim", self.qk_pos_emb_head_dim), ("--v-head-dim", self.v_head_dim)):
            _positive(flag, value)
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim} must be even: the rotary part "
                             f"turns pairs of dimensions")
        return self
