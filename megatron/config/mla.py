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

    def split_weights(self, hidden: int, heads: int) -> int:
        """The weights of the projections split over the tensor-parallel ranks by heads (their sum over the ranks):
        the query's up-projection W_qB [np (dn + dr), dq] (or W_q [np (dn + dr), h] without a query latent), the
        key / value up-projection W_kvB [np (dn + dv), dc] and the output projection W_o [h, np dv]."""
        query_in = hidden if self.q_lora_rank is None else self.q_lora_rank
        return heads * (self.q_head_dim * query_in + (self.qk_head_dim + self.v_head_dim) * self.kv_lora_rank
                        + self.v_head_dim * hidden)

    def replicated_weights(self, hidden: int, norm_weights_per_element: int = 0) -> int:
        """The weights every tensor-parallel rank holds whole: the down-projections W_qA [dq, h] and W_kvA
        [dc + dr, h], and the two latent norms (``norm_weights_per_element``: 0 without --qk-layernorm, 1 an
        RMSNorm's weight, 2 a LayerNorm's weight and bias)."""
        query = 0 if self.q_lora_rank is None else (hidden + norm_weights_per_element) * self.q_lora_rank
        return query + hidden * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + \
            norm_weights_per_element * self.kv_lora_rank

    def matmul_weights(self, hidden: int, heads: int) -> int:
        """The weights one token's projections multiply (the norms aside): what sets their FLOPs, 2 per weight
        (Megatron-LM's count for MLA, its norms' few FLOPs left out)."""
        return self.split_weights(hidden, heads) + self.replicated_weights(hidden)

    def score_width(self, heads: int) -> float:
        """The width q with which Megatron's attention term 4 s q (scores and context, forward) counts MLA's
        core: 2 s np (dn + dr) for the scores and 2 s np dv for the context, so q = np (dn + dr + dv) / 2."""
        return heads * (self.q_head_dim + self.v_head_dim) / 2

    def validate(self) -> "MLAConfig":
        _positive("--q-lora-rank", self.q_lora_rank, allow_none=True)
        for flag, value in (("--kv-lora-rank", self.kv_lora_rank), ("--qk-head-dim", self.qk_head_dim),
                            ("--qk-pos-emb-head-dim", self.qk_pos_emb_head_dim), ("--v-head-dim", self.v_head_dim)):
            _positive(flag, value)
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim} must be even: the rotary part "
                             f"turns pairs of dimensions")
        return self
