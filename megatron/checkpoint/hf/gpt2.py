"""Map full (TP=1) weights and configs between GPTModel and transformers' ``GPT2LMHeadModel``; the GPT block.

Learned absolute positions, no embedding LayerNorm. GPT-2 stores its linear layers as ``Conv1D`` ([in, out], so
every matrix is transposed) and its fused ``c_attn`` columns as [q of all heads | k of all heads | v of all heads],
where our rows are per head [heads, 3, hn]; both are converted here. GeLU tanh = ``gelu_new``; scale 1/sqrt(hn).

The GPT block (LayerNorm, GeLU, biases, one key / value head per query head, a tied head) is what GPT-2, Bloom
and GPT-NeoX need: ``check_gpt_block`` refuses anything else rather than exporting it wrongly. The vocabulary is
trimmed on export and zero-padded to the padded size on import. Nothing here imports transformers.
Shape letters: v vocabulary, h hidden, hn head dim.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron.config import ModelConfig
from megatron.model.layout import parameter_layout

__all__ = ["MODEL_TYPES", "check_gpt_block", "check_covers_layout", "ours_to_gpt2_state_dict",
           "gpt2_state_dict_to_ours", "gpt2_config_kwargs", "model_config_from_gpt2"]

MODEL_TYPES = {"gpt2": ("GPT2Config", "GPT2LMHeadModel")}  # transformers model_type -> (config class, model class)

_GPT2_BLOCK = [  # (GPT-2 name, our name, transposed: GPT-2's Conv1D stores [in, out])
    ("ln_1.weight", "input_layernorm.weight", False),
    ("ln_1.bias", "input_layernorm.bias", False),
    ("attn.c_proj.weight", "self_attention.dense.weight", True),
    ("attn.c_proj.bias", "self_attention.dense.bias", False),
    ("ln_2.weight", "post_attention_layernorm.weight", False),
    ("ln_2.bias", "post_attention_layernorm.bias", False),
    ("mlp.c_fc.weight", "mlp.dense_h_to_4h.weight", True),
    ("mlp.c_fc.bias", "mlp.dense_h_to_4h.bias", False),
    ("mlp.c_proj.weight", "mlp.dense_4h_to_h.weight", True),
    ("mlp.c_proj.bias", "mlp.dense_4h_to_h.bias", False),
]


def check_gpt_block(config: ModelConfig) -> None:
    """ValueError naming what of the GPT block (biases, multi-head attention, a tied head) ``config`` lacks:
    Bloom, GPT-2 and GPT-NeoX need all of it."""
    gpt_block = {"biases": config.add_bias_linear, "one key / value head per query head":
                 config.num_kv_heads == config.num_attention_heads, "a tied output head": config.tied_embeddings}
    missing = [what for what, present in gpt_block.items() if not present]
    if missing:
        raise ValueError(f"Bloom, GPT-2 and GPT-NeoX need the GPT block (LayerNorm, GeLU, biases, multi-head "
                         f"attention, tied head); this model lacks {', '.join(missing)}. With RMSNorm and SwiGLU it "
                         f"would export to Llama")


def check_covers_layout(names, config: ModelConfig, family: str) -> None:
    """ValueError unless ``names`` are exactly the parameters ``megatron.model.layout`` lists for
    ``config``: a parameter a model variant adds must be mapped, never silently dropped."""
    expected = set(parameter_layout(config))
    missing, unexpected = sorted(expected - set(names)), sorted(set(names) - expected)
    if missing or unexpected:
        raise ValueError(f"the {family} mapping does not cover this model: missing {missing}, unexpected {unexpected}")


def _per_head_to_grouped(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """QKV rows [heads, 3, hn] (ours) -> [3, heads, hn] (GPT-2's q | k | v), any trailing dims."""
    rest = tensor.shape[1:]
    hn = tensor.shape[0] // (3 * heads)
    return tensor.reshape(heads, 3, hn, *rest).transpose(0, 1).reshape(3 * heads * hn, *rest)


def _grouped_to_per_head(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """QKV rows [3, heads, hn] (GPT-2) -> [heads, 3, hn] (ours)."""
    rest = tensor.shape[1:]
    hn = tensor.shape[0] // (3 * heads)
    return tensor.reshape(3, heads, hn, *rest).transpose(0, 1).reshape(3 * heads * hn, *rest)


def ours_to_gpt2_state_dict(state: dict[str, torch.Tensor], config: ModelConfig,
                            vocab_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """A TP=1 GPTModel state dict (learned positions) -> ``GPT2LMHeadModel`` names (without the tied lm_head)."""
    check_covers_layout(state, config, "GPT-2")
    heads = config.num_attention_heads
    words = state["embedding.word_embeddings.weight"]  # [padded, h]
    out = {"transformer.wte.weight": words[:vocab_size] if vocab_size is not None else words,
           "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": state["final_layernorm.weight"],
           "transformer.ln_f.bias": state["final_layernorm.bias"]}
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        qkv_w = state[ours + "self_attention.query_key_value.weight"]  # [3h, h], rows per head
        out[theirs + "attn.c_attn.weight"] = _per_head_to_grouped(qkv_w, heads).t().contiguous()  # [h, 3h]
        out[theirs + "attn.c_attn.bias"] = _per_head_to_grouped(state[ours + "self_attention.query_key_value.bias"],
                                                               heads)  # [3h]
        for hf_name, our_name, transposed in _GPT2_BLOCK:
            tensor = state[ours + our_name]
            out[theirs + hf_name] = tensor.t().contiguous() if transposed else tensor
    return out


def gpt2_state_dict_to_ours(gpt2: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` / ``GPT2Model`` state dict -> a TP=1 GPTModel state dict (vocab zero-padded)."""
    state = {name.removeprefix("transformer."): tensor for name, tensor in gpt2.items()
             if not name.endswith(".attn.bias") and not name.endswith(".attn.masked_bias")}  # old causal buffers
    lm_head = state.pop("lm_head.weight", None)
    heads = config.num_attention_heads
    words = state.pop("wte.weight")  # [v, h]
    if lm_head is not None and not torch.equal(lm_head, words):
        raise ValueError("lm_head.weight differs from wte.weight; GPTModel ties the output head to the embedding")
    if words.shape[0] > config.padded_vocab_size:
        raise ValueError(f"GPT-2 vocabulary {words.shape[0]} exceeds padded_vocab_size {config.padded_vocab_size}")
    padding = words.new_zeros(config.padded_vocab_size - words.shape[0], words.shape[1])
    ours = {"embedding.word_embeddings.weight": torch.cat((words, padding), dim=0),  # [padded, h]
            "embedding.position_embeddings.weight": state.pop("wpe.weight"),
            "final_layernorm.weight": state.pop("ln_f.weight"), "final_layernorm.bias": state.pop("ln_f.bias")}
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"h.{i}."
        ours[mine + "self_attention.query_key_value.weight"] = _grouped_to_per_head(
            state.pop(theirs + "attn.c_attn.weight").t(), heads).contiguous()  # [3h, h]
        ours[mine + "self_attention.query_key_value.bias"] = _grouped_to_per_head(
            state.pop(theirs + "attn.c_attn.bias"), heads)
        for hf_name, our_name, transposed in _GPT2_BLOCK:
            tensor = state.pop(theirs + hf_name)
            ours[mine + our_name] = tensor.t().contiguous() if transposed else tensor
    if state:
        raise ValueError(f"GPT-2 tensors this converter does not know: {sorted(state)}")
    check_covers_layout(ours, config, "GPT-2")
    return ours


def gpt2_config_kwargs(config: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """Keyword arguments for ``transformers.GPT2Config`` describing ``config``."""
    return dict(vocab_size=vocab_size, n_positions=config.max_positions, n_embd=config.hidden_size,
                n_layer=config.num_layers, n_head=config.num_attention_heads, n_inner=config.ffn_size,
                activation_function="gelu_new", layer_norm_epsilon=config.layernorm_epsilon,
                resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
                attn_pdrop=config.attention_dropout, initializer_range=config.init_method_std,
                scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                tie_word_embeddings=True)


def model_config_from_gpt2(hf_config: Any, seq_length: int, **overrides) -> ModelConfig:
    """A ModelConfig for a transformers ``GPT2Config`` (tanh GeLU, attention scaled by 1/sqrt(hn)).

    seq_length: the training / inference length. overrides: any other ModelConfig field (padded_vocab_size...).
    """
    if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"GPT-2 activation {hf_config.activation_function!r} is not the tanh GeLU our MLP computes")
    if hf_config.scale_attn_by_inverse_layer_idx or not hf_config.scale_attn_weights:
        raise ValueError("GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported")
    return ModelConfig(num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
                       num_attention_heads=hf_config.n_head, seq_length=seq_length,
                       max_position_embeddings=hf_config.n_positions, ffn_hidden_size=hf_config.n_inner,
                       position_embedding_type="absolute", embed_layernorm=False,
                       layernorm_epsilon=hf_config.layer_norm_epsilon, hidden_dropout=hf_config.resid_pdrop,
                       attention_dropout=hf_config.attn_pdrop, init_method_std=hf_config.initializer_range,
                       **overrides).validate()
