"""Map full (TP=1) weights and configs between GPTModel and transformers' ``GPTNeoXForCausalLM``.

Rotary positions, no embedding LayerNorm, the GPT block (``megatron.checkpoint.hf.gpt2.check_gpt_block``):
sequential residuals (``use_parallel_residual`` False), full rotary (``partial_rotary_factor`` 1,
``rope_theta`` = rotary_base), biases, a tied head. GPT-NeoX's fused QKV rows are per head [heads, 3, hn] as
ours, so the tensors are only renamed; the vocabulary is trimmed on export and zero-padded on import.
Nothing here imports transformers. Shape letters: v vocabulary, h hidden, hn head dim.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron.checkpoint.hf.gpt2 import check_covers_layout
from megatron.config import ModelConfig
from megatron.model.layout import parameter_layout

__all__ = ["MODEL_TYPES", "ours_to_neox_state_dict", "neox_state_dict_to_ours", "neox_config_kwargs",
           "model_config_from_neox"]

MODEL_TYPES = {"gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM")}  # model_type -> (config class, model class)

# Our GPTModel name prefix -> GPT-NeoX's: the same tensors, renamed.
_NEOX_PREFIXES = (("embedding.word_embeddings.", "gpt_neox.embed_in."), ("final_layernorm.", "gpt_neox.final_layer_norm."),
                  ("layers.", "gpt_neox.layers."))


def _neox_names(config: ModelConfig) -> list[tuple[str, str]]:
    """(GPT-NeoX name, our name) of every parameter of ``megatron.model.layout``."""
    pairs = []
    for name in parameter_layout(config):
        prefix = next((p for p in _NEOX_PREFIXES if name.startswith(p[0])), None)
        if prefix is None:
            raise ValueError(f"{name!r} has no counterpart in transformers' GPT-NeoX")
        pairs.append((prefix[1] + name[len(prefix[0]):].replace(".self_attention.", ".attention."), name))
    return pairs


def ours_to_neox_state_dict(state: dict[str, torch.Tensor], config: ModelConfig,
                            vocab_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """A TP=1 GPTModel state dict (rotary) -> ``GPTNeoXForCausalLM`` names (without the tied lm_head)."""
    check_covers_layout(state, config, "GPT-NeoX")
    out = {theirs: state[ours] for theirs, ours in _neox_names(config)}
    if vocab_size is not None:
        out["gpt_neox.embed_in.weight"] = out["gpt_neox.embed_in.weight"][:vocab_size]  # [v, h]
    return out


def neox_state_dict_to_ours(neox: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``GPTNeoXForCausalLM`` state dict -> a TP=1 GPTModel state dict (vocab zero-padded)."""
    state = dict(neox)
    lm_head = state.pop("lm_head.weight", state.pop("embed_out.weight", None))
    ours = {}
    for theirs, mine in _neox_names(config):
        if theirs not in state:
            raise ValueError(f"GPT-NeoX tensor {theirs} is missing")
        ours[mine] = state.pop(theirs)
    if state:
        raise ValueError(f"GPT-NeoX tensors this converter does not know: {sorted(state)}")
    words = ours["embedding.word_embeddings.weight"]  # [v, h]
    if lm_head is not None and not torch.equal(lm_head, words):
        raise ValueError("GPT-NeoX's lm_head differs from embed_in; GPTModel ties the output head to the embedding")
    padding = words.new_zeros(config.padded_vocab_size - words.shape[0], words.shape[1])
    ours["embedding.word_embeddings.weight"] = torch.cat((words, padding), dim=0)  # [padded, h]
    return ours


def neox_config_kwargs(config: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """Keyword arguments for ``transformers.GPTNeoXConfig`` describing ``config``."""
    if config.yarn_rotary_scaling_factor not in (None, 1.0):
        raise ValueError("YaRN rotary scaling is exported with the Llama family (RMSNorm + SwiGLU); the GPT-NeoX "
                         "mapping writes plain rotary only")
    return dict(vocab_size=vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_attention_heads, intermediate_size=config.ffn_size,
                hidden_act="gelu_new", use_parallel_residual=False, tie_word_embeddings=True, attention_bias=True,
                attention_dropout=config.attention_dropout, hidden_dropout=config.hidden_dropout,
                layer_norm_eps=config.layernorm_epsilon, initializer_range=config.init_method_std,
                max_position_embeddings=config.seq_length,
                rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base,
                                 "partial_rotary_factor": 1.0})


def model_config_from_neox(hf_config: Any, seq_length: int, **overrides) -> ModelConfig:
    """A ModelConfig for a transformers ``GPTNeoXConfig``; ValueError for what differs from our block.

    seq_length: the training / inference length. overrides: any other ModelConfig field (padded_vocab_size...).
    """
    rope = getattr(hf_config, "rope_parameters", None) or {}
    problems = {"use_parallel_residual": (hf_config.use_parallel_residual, False),
                "hidden_act": (hf_config.hidden_act in ("gelu_new", "gelu_pytorch_tanh"), True),
                "attention_bias": (getattr(hf_config, "attention_bias", True), True),
                "rope_type": (rope.get("rope_type", "default"), "default"),
                "partial_rotary_factor": (rope.get("partial_rotary_factor", 1.0), 1.0)}
    wrong = {name: got for name, (got, want) in problems.items() if got != want}
    if wrong:
        raise ValueError(f"this GPT-NeoX differs from our architecture in {wrong} (needed: sequential residual, "
                         f"tanh GeLU, biases, full default rotary)")
    return ModelConfig(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
                       num_attention_heads=hf_config.num_attention_heads, seq_length=seq_length,
                       ffn_hidden_size=hf_config.intermediate_size, position_embedding_type="rotary",
                       embed_layernorm=False, layernorm_epsilon=hf_config.layer_norm_eps,
                       rotary_base=float(rope.get("rope_theta", 10000.0)), hidden_dropout=hf_config.hidden_dropout,
                       attention_dropout=hf_config.attention_dropout, init_method_std=hf_config.initializer_range,
                       **overrides).validate()
