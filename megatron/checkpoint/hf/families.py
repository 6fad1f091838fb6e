"""The transformers families we convert to and from: one registry, one ``Family`` entry per module of this package.

    FAMILIES["llama"].model_types          {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ..., "qwen2": ...}
    family, model_type = family_for(config)   the family (and transformers model_type) a ModelConfig exports to
    family = family_of("qwen3_moe")           the family that reads a transformers model_type

Which family exports a model of ours (each ``holds`` accepts its own kind; at most one accepts a model):

- ``--multi-latent-attention``                                  -> deepseek_v3 (``DeepseekV3ForCausalLM``)
- MoE layers (``--num-experts``), softmax top-k                 -> mixtral_qwen3 (Mixtral, or Qwen3-MoE with
  ``--qk-layernorm``)
- dense, RMSNorm + SwiGLU + rotary                              -> llama (Llama, or Qwen2 with q / k / v biases only)
- the GPT block (LayerNorm, GeLU, biases, one key / value head per query head, a tied head), then by positions:
  ALiBi + embedding LayerNorm -> bloom, learned positions -> gpt2, rotary -> gpt_neox

A model none holds is refused with the reason, rather than exported wrongly. A new family is one module of this
package (its config and tensor mappings, nothing of transformers imported) plus one ``Family`` line below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megatron.checkpoint.hf import bloom, deepseek, gpt2, llama, mixtral_qwen3, neox
from megatron.config import ModelConfig

__all__ = ["Family", "FAMILIES", "hf_architecture", "family_for", "family_of"]


@dataclass(frozen=True)
class Family:
    """What ``megatron.checkpoint.hf.io`` asks of a family; the functions take and return plain tensors and
    attribute holders (no transformers import)."""

    model_types: dict[str, tuple[str, str]]  # transformers model_type -> (its config class, its model class)
    holds: Callable[[ModelConfig], bool]  # whether a model of ours is this family's to export
    model_type_of: Callable[[ModelConfig], str]  # the model_type it exports to; ValueError naming what it lacks
    from_ours: Callable[..., dict]  # (our TP=1 state dict, config, vocab_size) -> their tensors, vocab trimmed
    to_ours: Callable[..., dict]  # (their tensors, config) -> our TP=1 state dict, vocab zero-padded
    config_kwargs: Callable[..., dict]  # (config, vocab_size) -> keyword arguments of the config class
    model_config: Callable[..., ModelConfig]  # (their config, seq_length, **fields) -> ModelConfig
    default_seq_length: Callable[[Any], int]  # their config -> the length recorded when none is given
    records_training_tp: bool = False  # their config records the training TP (``pretraining_tp``)
    fit_config: Callable[..., ModelConfig] = lambda config, tensors: config  # what the tensors hold that the config
                                                                            # cannot say (DeepSeek's MTP layers)


def _dense(config: ModelConfig) -> bool:
    return config.moe is None and config.mla is None


def _llama_like(config: ModelConfig) -> bool:
    return config.qk_layernorm or config.normalization == "rmsnorm" or config.swiglu


def _gpt_block(position: str, embed_layernorm: bool) -> Callable[[ModelConfig], bool]:
    return lambda c: (_dense(c) and not _llama_like(c) and c.position_embedding_type == position
                      and c.embed_layernorm == embed_layernorm)


def _checked_gpt_block(model_type: str) -> Callable[[ModelConfig], str]:
    def model_type_of(config: ModelConfig) -> str:
        gpt2.check_gpt_block(config)
        return model_type
    return model_type_of


def _max_positions(hf_config: Any) -> int:
    return hf_config.max_position_embeddings


FAMILIES: dict[str, Family] = {
    "bloom": Family(bloom.MODEL_TYPES, _gpt_block("alibi", True), _checked_gpt_block("bloom"),
                    lambda state, config, vocab: bloom.ours_to_bloom_state_dict(state, config, vocab, with_lm_head=False),
                    bloom.bloom_state_dict_to_ours, bloom.bloom_config_kwargs, bloom.model_config_from_bloom,
                    lambda hf_config: 2048, records_training_tp=True),  # Bloom's config records no length
    "gpt2": Family(gpt2.MODEL_TYPES, _gpt_block("absolute", False), _checked_gpt_block("gpt2"),
                   gpt2.ours_to_gpt2_state_dict, gpt2.gpt2_state_dict_to_ours, gpt2.gpt2_config_kwargs,
                   gpt2.model_config_from_gpt2, lambda hf_config: hf_config.n_positions),
    "gpt_neox": Family(neox.MODEL_TYPES, _gpt_block("rotary", False), _checked_gpt_block("gpt_neox"),
                       neox.ours_to_neox_state_dict, neox.neox_state_dict_to_ours, neox.neox_config_kwargs,
                       neox.model_config_from_neox, _max_positions),
    "llama": Family(llama.MODEL_TYPES, lambda c: _dense(c) and _llama_like(c), llama.dense_llama_family_of,
                    llama.ours_to_llama_state_dict, llama.llama_state_dict_to_ours, llama.llama_config_kwargs,
                    llama.model_config_from_llama, _max_positions),
    "mixtral_qwen3": Family(mixtral_qwen3.MODEL_TYPES, lambda c: c.moe is not None and c.mla is None,
                            mixtral_qwen3.moe_family_of, mixtral_qwen3.ours_to_moe_state_dict,
                            mixtral_qwen3.moe_state_dict_to_ours, mixtral_qwen3.moe_config_kwargs,
                            mixtral_qwen3.model_config_from_moe, _max_positions),
    "deepseek_v3": Family(deepseek.MODEL_TYPES, lambda c: c.mla is not None, deepseek.deepseek_model_type,
                          deepseek.ours_to_deepseek_state_dict, deepseek.deepseek_state_dict_to_ours,
                          deepseek.deepseek_config_kwargs, deepseek.model_config_from_deepseek, _max_positions,
                          fit_config=deepseek.fit_config),
}


def family_for(config: ModelConfig) -> tuple[Family, str]:
    """The family ``config`` exports to and its transformers model_type; ValueError for a configuration no
    transformers architecture maps, naming why."""
    for family in FAMILIES.values():
        if family.holds(config):
            return family, family.model_type_of(config)
    gpt2.check_gpt_block(config)
    raise ValueError(f"no transformers architecture maps position_embedding_type "
                     f"{config.position_embedding_type!r} with embed_layernorm {config.embed_layernorm} here: "
                     f"ALiBi + embedding LayerNorm exports to Bloom, learned positions without it to GPT-2, "
                     f"rotary without it to GPT-NeoX")


def hf_architecture(config: ModelConfig) -> str:
    """'bloom', 'gpt2', 'gpt_neox', 'llama', 'qwen2', 'mixtral', 'qwen3_moe' or 'deepseek_v3' (the transformers
    model_type), or ValueError for a configuration no transformers architecture maps."""
    return family_for(config)[1]


def family_of(model_type: str) -> Family:
    """The family that reads transformers' ``model_type``; ValueError naming the model types we read."""
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    known = [name for family in FAMILIES.values() for name in family.model_types]
    raise ValueError(f"a {model_type!r} model; this converter reads {', '.join(known)}")
