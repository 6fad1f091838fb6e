"""The multi-head latent attention flags (one argument group) and their step: Megatron-LM's names
(``--multi-latent-attention``, ``--q-lora-rank``, ``--kv-lora-rank``, ``--qk-head-dim``, ``--qk-pos-emb-head-dim``,
``--v-head-dim``); the parallelisms MLA is not implemented with are refused by name before launch by
``RunConfig.validate`` (``megatron.config.combinations``).
"""

from __future__ import annotations

from megatron.config.mla import MLAConfig

__all__ = ["add_mla_arguments", "resolve_mla"]


def add_mla_arguments(parser) -> None:
    g = parser.add_argument_group("multi-head latent attention")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V2/V3's multi-head latent attention in every layer instead of the fused-QKV "
                        "attention: keys and values through one low-rank latent per token, a rotary key part "
                        "shared by the heads. With --qk-layernorm the latents are normalized (DeepSeek-V3).")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="Rank of the query latent (DeepSeek-V3: 1536). Default: none, a full-rank query projection.")
    g.add_argument("--kv-lora-rank", type=int, default=32,
                   help="Rank of the key / value latent (DeepSeek-V3: 512). Default 32.")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="Per head: the query / key part without position information (DeepSeek-V3: 128).")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                   help="Per head: the rotary query / key part (DeepSeek-V3: 64).")
    g.add_argument("--v-head-dim", type=int, default=128, help="Per head: the value (DeepSeek-V3: 128).")


def resolve_mla(args) -> None:
    """``args.mla``: an ``MLAConfig`` with --multi-latent-attention, else None. The parallelisms MLA is not
    implemented with are refused by ``RunConfig.validate`` (the table in ``megatron.config.combinations``), the
    model shapes it needs by ``ModelConfig.validate``."""
    if not args.multi_latent_attention:
        args.mla = None
        return
    args.mla = MLAConfig(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                         qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim).validate()
