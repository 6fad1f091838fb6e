"""Map full (TP=1) weights and configs between GPTModel and transformers' Llama family.

transformers' ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` name their tensors
alike (``model.layers.{i}.self_attn.q_proj`` ... ``mlp.down_proj``, ``model.norm``, ``lm_head``) and
compute the same block: RMSNorm, rotary positions in the GPT-NeoX half-split form (what
``megatron.model.positional`` computes), grouped-query attention, SwiGLU. They differ in biases only:
Llama has none (or, with ``attention_bias``, on q / k / v / o; ``mlp_bias`` on the MLP), Qwen2 has them
on q / k / v alone (our ``add_qkv_bias`` with ``add_bias_linear`` off), Mistral has none. Qwen3 has none and
RMS-normalizes each query / key head before the rotary (``q_norm`` / ``k_norm`` [hn]: our ``--qk-layernorm``).
A ``head_dim`` other than hidden / heads (every Qwen3) is our ``kv_channels``. Mistral's
sliding window is not implemented here and is refused; Llama 3.1's rope scaling (rope_type llama3) maps
to ``rope_scaling_factor`` and its three companions, YaRN (rope_type yarn: factor, original_max_position_embeddings,
beta_fast, beta_slow, mscale, mscale_all_dim, truncate) to the ``yarn_*`` fields, both ways.

Two of our tensors are fused where theirs are separate, both interleaved so that TP slicing along dim 0
hands out whole units (``megatron.model.attention``, ``megatron.model.transformer``):

    query_key_value  [kv_heads, heads / kv_heads + 2, hn, h]  <-> q_proj [heads * hn, h], k_proj, v_proj [kv_heads * hn, h]
    dense_h_to_4h    [f, 2, h] (gate row, up row)             <-> gate_proj, up_proj [f, h]

The vocabulary is zero-padded to the padded size on import and trimmed on export, the untied head too.
Which tensors there are comes from ``megatron.model.layout``; nothing here imports transformers.
Shape letters: v vocabulary, h hidden, hn head dim (not necessarily h / heads), f ffn hidden size.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from megatron.config import ModelConfig
from megatron.model.layout import parameter_layout

__all__ = ["MODEL_TYPES", "llama_family_of", "dense_llama_family_of", "ours_to_llama_state_dict",
           "llama_state_dict_to_ours", "llama_config_kwargs", "model_config_from_llama", "check_llama_block", "split_fc1",
           "fuse_fc1", "rope_fields", "yarn_rope_parameters", "llama_block_fields", "kv_heads_of"]

MODEL_TYPES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),  # model_type -> (config class, model class)
               "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}

# Per block: our name -> theirs, for the tensors that are only renamed.
_BLOCK_RENAMES = {"input_layernorm.weight": "input_layernorm.weight",
                  "post_attention_layernorm.weight": "post_attention_layernorm.weight",
                  "self_attention.dense.weight": "self_attn.o_proj.weight",
                  "self_attention.dense.bias": "self_attn.o_proj.bias",
                  "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
                  "mlp.dense_4h_to_h.bias": "mlp.down_proj.bias"}
_QKV, _FC1 = "self_attention.query_key_value.", "mlp.dense_h_to_4h."
# --qk-layernorm (Qwen3, Qwen3-MoE): each query / key head's RMSNorm weight [hn]
QK_NORMS = (("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"))


def _qk_norms(config: ModelConfig) -> tuple[tuple[str, str], ...]:
    """The per-head query / key norms' names (ours, theirs) of the fused-QKV attention (MLA's latent norms are
    ``megatron.checkpoint.hf.deepseek``'s)."""
    return QK_NORMS if config.qk_layernorm and config.mla is None else ()


def llama_family_of(config: ModelConfig) -> str:
    """'llama', 'qwen2' or 'qwen3' (the transformers model_type ``config`` exports to), or ValueError naming what
    no member of the family has."""
    wrong = []
    if config.normalization != "rmsnorm":
        wrong.append(f"normalization {config.normalization!r} (needs rmsnorm)")
    if not config.swiglu:
        wrong.append("a GeLU MLP (needs swiglu)")
    if config.position_embedding_type != "rotary":
        wrong.append(f"position_embedding_type {config.position_embedding_type!r} (needs rotary)")
    if config.embed_layernorm:
        wrong.append("an embedding LayerNorm")
    if config.qk_layernorm and config.qkv_bias:
        wrong.append("--qk-layernorm with biases (Qwen3 has none: needs --disable-bias-linear, no --add-qkv-bias)")
    if wrong:
        raise ValueError(f"transformers' Llama family cannot hold this model: {', '.join(wrong)}")
    if config.qk_layernorm:
        return "qwen3"
    return "qwen2" if config.add_qkv_bias and not config.add_bias_linear else "llama"


def dense_llama_family_of(config: ModelConfig) -> str:
    """:func:`llama_family_of` for a dense model (``--qk-layernorm``: Qwen3)."""
    return llama_family_of(config)


def _split_qkv(tensor: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our fused QKV rows [kv, q/kv + 2, hn] (any trailing dims) -> q [heads * hn], k, v [kv * hn]."""
    kv, hn, rest = config.num_kv_heads, config.head_dim, tensor.shape[1:]
    per_group = config.num_attention_heads // kv
    grouped = tensor.reshape(kv, per_group + 2, hn, *rest)  # [kv, q/kv + 2, hn, ...]
    q = grouped[:, :per_group].reshape(kv * per_group * hn, *rest)  # [heads * hn, ...]
    return q, grouped[:, per_group].reshape(kv * hn, *rest), grouped[:, per_group + 1].reshape(kv * hn, *rest)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The inverse of :func:`_split_qkv`."""
    kv, hn, rest = config.num_kv_heads, config.head_dim, q.shape[1:]
    grouped = torch.cat((q.reshape(kv, -1, hn, *rest), k.reshape(kv, 1, hn, *rest), v.reshape(kv, 1, hn, *rest)),
                        dim=1)  # [kv, q/kv + 2, hn, ...]
    return grouped.reshape(-1, *rest)


def split_fc1(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our fused SwiGLU rows [f, 2] (gate, up interleaved; any trailing dims) -> gate [f], up [f]."""
    pairs = tensor.reshape(-1, 2, *tensor.shape[1:])  # [f, 2, ...]
    return pairs[:, 0], pairs[:, 1]


def fuse_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack((gate, up), dim=1).reshape(-1, *gate.shape[1:])  # [2f, ...]


def ours_to_llama_state_dict(state: dict[str, torch.Tensor], config: ModelConfig,
                             vocab_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """A TP=1 GPTModel state dict -> a ``LlamaForCausalLM`` (Qwen2 / Mistral) state dict.

    vocab_size: keep only the first rows of the embedding and the head (drop our padding); default all.
    A tied model gets ``lm_head.weight`` = the word embedding (set ``tie_word_embeddings`` then).
    """
    llama_family_of(config)
    expected = set(parameter_layout(config))
    if set(state) != expected:
        raise ValueError(f"not a GPTModel state dict of this configuration: missing {sorted(expected - set(state))}, "
                         f"unexpected {sorted(set(state) - expected)}")
    rows = slice(None, vocab_size)
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][rows],
           "model.norm.weight": state["final_layernorm.weight"],
           "lm_head.weight": state.get("output_layer.weight", state["embedding.word_embeddings.weight"])[rows]}
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for mine, hf in _BLOCK_RENAMES.items():
            if ours + mine in state:
                out[theirs + hf] = state[ours + mine]
        for mine, hf in _qk_norms(config):
            out[theirs + hf] = state[ours + mine]
        for kind in ("weight", "bias"):
            if ours + _QKV + kind in state:
                q, k, v = _split_qkv(state[ours + _QKV + kind], config)
                out.update({f"{theirs}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v))})
            if ours + _FC1 + kind in state:
                gate, up = split_fc1(state[ours + _FC1 + kind])
                out.update({f"{theirs}mlp.gate_proj.{kind}": gate, f"{theirs}mlp.up_proj.{kind}": up})
    return out


def _pad_rows(tensor: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    if tensor.shape[0] > rows:
        raise ValueError(f"{what} has {tensor.shape[0]} rows, more than padded_vocab_size {rows}")
    return torch.cat((tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])), dim=0)  # [padded, h]


def llama_state_dict_to_ours(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` / Mistral / Qwen2 state dict -> a TP=1 GPTModel state dict of ``config``.

    A tied ``config`` needs ``lm_head.weight`` (if present) equal to the embedding. ValueError for any
    tensor left unmapped or missing.
    """
    llama_family_of(config)
    state = dict(hf_state)
    layers = {int(m.group(1)) for name in state if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    if layers != set(range(config.num_layers)):
        raise ValueError(f"the state dict has layers {sorted(layers)}, the config num_layers {config.num_layers}")
    take = state.pop
    padded = config.padded_vocab_size
    words = take("model.embed_tokens.weight")  # [v, h]
    ours = {"embedding.word_embeddings.weight": _pad_rows(words, padded, "model.embed_tokens.weight"),
            "final_layernorm.weight": take("model.norm.weight")}
    head = take("lm_head.weight", None)
    if config.tied_embeddings:
        if head is not None and not torch.equal(head, words):
            raise ValueError("lm_head.weight differs from the embedding but the model ties them: set "
                             "untie_embeddings_and_output_weights")
    else:
        if head is None:
            raise ValueError("lm_head.weight is missing but the model has an untied output head")
        ours["output_layer.weight"] = _pad_rows(head, padded, "lm_head.weight")
    expected = set(parameter_layout(config))
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        for ours_name, hf in _BLOCK_RENAMES.items():
            if mine + ours_name in expected:
                ours[mine + ours_name] = take(theirs + hf)
        for ours_name, hf in _qk_norms(config):
            ours[mine + ours_name] = take(theirs + hf)
        for kind in ("weight", "bias"):
            if mine + _QKV + kind in expected:
                q, k, v = (take(f"{theirs}self_attn.{p}_proj.{kind}") for p in "qkv")
                ours[mine + _QKV + kind] = _fuse_qkv(q, k, v, config)
            if mine + _FC1 + kind in expected:
                ours[mine + _FC1 + kind] = fuse_fc1(take(f"{theirs}mlp.gate_proj.{kind}"),
                                                     take(f"{theirs}mlp.up_proj.{kind}"))
    if state:
        raise ValueError(f"tensors this model configuration has no place for: {sorted(state)} (biases? check "
                         f"add_bias_linear / add_qkv_bias)")
    return ours


def llama_config_kwargs(config: ModelConfig, vocab_size: Optional[int] = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.LlamaConfig`` (or ``Qwen2Config`` / ``Qwen3Config`` when
    ``llama_family_of(config)`` says qwen2 / qwen3) describing ``config``."""
    family = llama_family_of(config)
    if vocab_size is None:
        vocab_size = config.original_vocab_size or config.padded_vocab_size
    kwargs = dict(vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
                  num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
                  num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, hidden_act="silu",
                  max_position_embeddings=config.seq_length, rms_norm_eps=config.layernorm_epsilon,
                  initializer_range=config.init_method_std,
                  attention_dropout=config.attention_dropout, tie_word_embeddings=config.tied_embeddings)
    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rope_scaling_factor is not None:
        rope.update(rope_type="llama3", factor=config.rope_scaling_factor,
                    low_freq_factor=config.rope_scaling_low_freq_factor,
                    high_freq_factor=config.rope_scaling_high_freq_factor,
                    original_max_position_embeddings=config.rope_scaling_original_max_positions)
    rope.update(yarn_rope_parameters(config))
    kwargs["rope_parameters"] = rope
    if family == "llama":
        kwargs.update(attention_bias=config.add_bias_linear, mlp_bias=config.add_bias_linear)
    if family == "qwen3":
        kwargs.update(attention_bias=False, use_sliding_window=False)
    return kwargs


def rope_fields(hf_config: Any) -> dict[str, Any]:
    """ModelConfig's rotary fields of a transformers config: the base, and Llama 3.1's scaling if any."""
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    fields = {"rotary_base": float(theta if theta is not None else 10000.0)}
    if kind == "llama3":
        fields.update(rope_scaling_factor=float(rope["factor"]),
                      rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_scaling_original_max_positions=int(rope["original_max_position_embeddings"]))
    elif kind == "yarn":
        fields.update(_yarn_fields(rope, hf_config))
    elif kind != "default":
        raise ValueError(f"rope_type {kind!r} is not implemented here; plain rotary positions, Llama 3.1's "
                         f"scaling (llama3) and YaRN (yarn) are")
    return fields


def _yarn_fields(rope: dict, hf_config: Any) -> dict[str, Any]:
    """ModelConfig's yarn_* fields of transformers' yarn rope parameters, read as transformers'
    ``_compute_yarn_parameters`` and DeepSeek-V3's attention (``yarn_apply_mscale``) read them. ValueError for what
    our (Megatron-LM's) YaRN does not compute the same way."""
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope_type yarn without original_max_position_embeddings (transformers requires it)")
    factor = rope.get("factor")
    if factor is None:  # transformers: the ratio of the extended to the original context
        factor = hf_config.max_position_embeddings / original
    if rope.get("attention_factor") is not None:
        raise ValueError(f"rope_type yarn with attention_factor {rope['attention_factor']}: an explicit attention "
                         f"factor is not mapped; ours (Megatron-LM's) derives it from factor, mscale and "
                         f"mscale_all_dim")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if bool(mscale) != bool(mscale_all_dim) and (mscale_all_dim or mscale != 1):
        # transformers takes the ratio only when both are set (else 0.1 ln(factor) + 1, mscale ignored); Megatron-LM
        # (and ours) always takes mscale(factor, mscale) / mscale(factor, mscale_all_dim)
        raise ValueError(f"rope_type yarn with mscale {mscale} and mscale_all_dim {mscale_all_dim}: transformers "
                         f"ignores one without the other, Megatron-LM's YaRN does not; give both, or neither")
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0  # transformers' 0.1 ln(factor) + 1, which these give
    return dict(yarn_rotary_scaling_factor=float(factor), yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
                yarn_mscale=float(mscale), yarn_mscale_all_dim=float(mscale_all_dim),
                yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))


def yarn_rope_parameters(config: ModelConfig) -> dict[str, Any]:
    """transformers' yarn rope parameters for ``config``'s YaRN (an empty dict without it); ValueError for a
    mscale / mscale_all_dim pair transformers would read otherwise (it ignores one without the other)."""
    factor = config.yarn_rotary_scaling_factor
    if factor is None or factor == 1.0:
        return {}
    rope = dict(rope_type="yarn", factor=factor,
                original_max_position_embeddings=config.yarn_original_max_position_embeddings,
                beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow)
    mscale, mscale_all_dim = config.yarn_mscale, config.yarn_mscale_all_dim
    if mscale and mscale_all_dim:
        rope.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    elif (mscale, mscale_all_dim) != (1.0, 0.0):
        raise ValueError(f"--mscale {mscale} with --mscale-all-dim {mscale_all_dim}: transformers takes mscale "
                         f"into account only with a nonzero mscale_all_dim (else it uses 0.1 ln(factor) + 1); this "
                         f"YaRN has no transformers equivalent")
    if not config.yarn_correction_range_round_to_int:
        rope["truncate"] = False
    return rope


def check_llama_block(hf_config: Any, model_type: str) -> None:
    """ValueError for what our Llama block lacks: an MLP other than SwiGLU, sliding-window attention (Mistral's
    and Mixtral's always when set, the others' with use_sliding_window). A head dim other than h / heads is
    ``kv_channels`` (:func:`llama_block_fields`)."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r}: only SwiGLU (silu) is mapped")
    if getattr(hf_config, "sliding_window", None) is not None and (
            model_type in ("mistral", "mixtral") or getattr(hf_config, "use_sliding_window", False)):
        raise ValueError(f"{model_type} with sliding_window {hf_config.sliding_window}: sliding-window attention is "
                         f"not implemented here (set sliding_window None for full attention)")


def model_config_from_llama(hf_config: Any, seq_length: int, **overrides) -> ModelConfig:
    """A ModelConfig for a transformers ``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config``.

    seq_length: the training / inference length. overrides: any other ModelConfig field (padded_vocab_size...).
    """
    model_type = getattr(hf_config, "model_type", "llama")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    check_llama_block(hf_config, model_type)
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError(f"attention_bias {attention_bias} with mlp_bias {mlp_bias}: biases are all or none here "
                         f"(add_bias_linear), or q / k / v only (Qwen2)")
    if model_type == "qwen3" and attention_bias:
        raise ValueError("Qwen3 with attention_bias True: this converter maps Qwen3 without biases")
    fields = dict(llama_block_fields(hf_config, seq_length), num_key_value_heads=kv_heads_of(hf_config),
                  ffn_hidden_size=hf_config.intermediate_size, **rope_fields(hf_config),
                  add_bias_linear=attention_bias, add_qkv_bias=model_type == "qwen2", qk_layernorm=model_type == "qwen3")
    fields.update(overrides)
    return ModelConfig(**fields).validate()


def llama_block_fields(hf_config: Any, seq_length: int) -> dict[str, Any]:
    """The ModelConfig fields every Llama-style transformers config maps the same way (Llama, Mistral, Qwen2,
    Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3): sizes (a ``head_dim`` other than hidden / heads: ``kv_channels``),
    rotary positions (``rope_fields`` adds the scaling), RMSNorm, SwiGLU, the head's tying, dropout and the init std."""
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim == hf_config.hidden_size // hf_config.num_attention_heads:
        head_dim = None  # the default: hidden / heads
    return dict(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, kv_channels=head_dim,
                num_attention_heads=hf_config.num_attention_heads, padded_vocab_size=hf_config.vocab_size,
                seq_length=seq_length, position_embedding_type="rotary", normalization="rmsnorm", swiglu=True,
                layernorm_epsilon=hf_config.rms_norm_eps,
                untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", False),
                attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)), hidden_dropout=0.0,
                init_method_std=getattr(hf_config, "initializer_range", 0.02))


def kv_heads_of(hf_config: Any) -> int:
    """Key / value heads (grouped-query attention), one per head where the config does not say."""
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
