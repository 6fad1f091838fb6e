"""Map full (TP=1, every expert) weights and configs between GPTModel and transformers' ``DeepseekV3ForCausalLM``.

DeepSeek-V3 is the Llama block (``megatron.checkpoint.hf.llama`` maps the embedding, the norms, the dense MLPs of
the first ``first_k_dense_replace`` layers, the output projection and the head) with multi-head latent attention
(``megatron.model.latent_attention``: the same matrices, renamed; the rotary part stays interleaved as DeepSeek's
checkpoints hold it, and our MLA de-interleaves it as transformers' ``rope_interleave`` does) and MoE layers
routed as transformers' ``DeepseekV3TopkRouter`` computes it:

    scores = sigmoid(x W_g^T) (fp32); group score = the sum of each group's 2 best (scores + bias); the top-k
    (scores + bias) among the ``topk_group`` best groups; weights = their scores, divided by their sum
    (``norm_topk_prob``), times ``routed_scaling_factor``

which is ``megatron.model.moe.router.route`` with sigmoid scores, ``--moe-router-num-groups n_group``,
``--moe-router-group-topk topk_group`` (our group score sums the k / group_topk best: equal when that is 2,
refused otherwise), the expert bias (``e_score_correction_bias``) and the scaling factor; our sigmoid weights are
normalised exactly when k > 1, so ``norm_topk_prob`` must be k > 1. On disk (``save_pretrained``) one matrix per
expert, where we stack them:

    self_attention. linear_q_down_proj / q_layernorm / linear_q_up_proj  <-> self_attn. q_a_proj / q_a_layernorm / q_b_proj
    self_attention. linear_q_proj (no query latent)                      <-> self_attn. q_proj
    self_attention. linear_kv_down_proj / kv_layernorm / linear_kv_up_proj
                                                   <-> self_attn. kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj
    mlp.router.weight [E, h], mlp.router.expert_bias [E]   <-> mlp.gate.weight, mlp.gate.e_score_correction_bias
    mlp.experts.w1 [E, 2f, h], w2 [E, h, f]    <-> per expert: mlp.experts.{e}.gate_proj / up_proj [f, h], down_proj [h, f]
    mlp.shared_expert.dense_h_to_4h [2fs, h] (gate, up interleaved), dense_4h_to_h [h, fs]
                                               <-> mlp.shared_experts.gate_proj / up_proj [fs, h], down_proj [h, fs]

Multi-token-prediction layers (``num_mtp_layers`` / ``num_nextn_predict_layers``; DeepSeek-V3's layer 61) map to
our MTP depths (``megatron.model.mtp``, --mtp-num-layers): DeepSeek's layer n + k holds depth k's decoder layer under
its usual names, and

    mtp.layers.{k}.enorm / hnorm / eh_proj [h, 2h] / final_layernorm   <-> model.layers.{n+k}.enorm / hnorm / eh_proj /
                                                                            shared_head.norm
    mtp.layers.{k}.transformer_layer.*                                 <-> model.layers.{n+k}.* (a decoder layer)
    (the shared embedding and head)              <-> model.layers.{n+k}.embed_tokens / shared_head.head (copies)

The copies of the embedding and head are written on export and checked equal to the model's on import. A
configuration announcing MTP layers that the checkpoint does not hold (transformers' default ``num_mtp_layers`` 1
with a model saved without them) imports without MTP (``fit_config``). Nothing here imports transformers.
Shape letters: E experts, h hidden, f expert width, fs shared-expert width.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Optional

import torch

from megatron.checkpoint.hf import llama
from megatron.checkpoint.hf.mixtral_qwen3 import experts_from_hf, experts_to_hf
from megatron.checkpoint.single_process import router_buffer_names
from megatron.config import ModelConfig
from megatron.config.mla import MLAConfig
from megatron.config.moe import MoEConfig
from megatron.model.layout import parameter_layout

__all__ = ["MODEL_TYPES", "MLA_NAMES", "check_deepseek", "fit_config", "deepseek_model_type", "ours_to_deepseek_state_dict",
           "deepseek_state_dict_to_ours", "deepseek_config_kwargs", "model_config_from_deepseek"]

MODEL_TYPES = {"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}  # model_type -> (config, model class)
# Our name under ``self_attention.`` -> theirs under ``self_attn.`` (the matrices are the same).
MLA_NAMES = (("linear_q_proj.weight", "q_proj.weight"), ("linear_q_down_proj.weight", "q_a_proj.weight"),
             ("q_layernorm.weight", "q_a_layernorm.weight"), ("linear_q_up_proj.weight", "q_b_proj.weight"),
             ("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
             ("kv_layernorm.weight", "kv_a_layernorm.weight"), ("linear_kv_up_proj.weight", "kv_b_proj.weight"))
_EXPERTS = ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
            "mlp.experts.{e}.down_proj.weight")
_BIAS = ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias")
_SHARED_FC1, _SHARED_FC2 = "mlp.shared_expert.dense_h_to_4h.weight", "mlp.shared_expert.dense_4h_to_h.weight"
_LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm ignore rms_norm_eps


def _num_dense_first(config: ModelConfig) -> int:
    pattern = config.moe.layer_pattern
    return pattern.index(True)


def check_deepseek(config: ModelConfig) -> None:
    """ValueError naming what transformers' DeepseekV3ForCausalLM cannot hold of ``config`` (an MLA model)."""
    llama.llama_family_of(config)
    moe, mla = config.moe, config.mla
    if moe is None:
        raise ValueError("a dense model with --multi-latent-attention: DeepseekV3ForCausalLM needs MoE layers "
                         "(--num-experts)")
    k, expert_width = moe.router_topk, config.expert_ffn_size
    shared = moe.shared_expert_intermediate_size
    first = _num_dense_first(config)
    wrong = [what for what, present in (
        ("no latent norms (needs --qk-layernorm)", not config.qk_layernorm),
        (f"--moe-router-score-function {moe.router_score_function} (needs sigmoid)", moe.router_score_function != "sigmoid"),
        (f"a group score of the {k // (moe.router_group_topk or 1)} best experts per group (transformers sums 2: "
         f"--moe-router-topk / --moe-router-group-topk must be 2)",
         moe.router_num_groups is not None and k // moe.router_group_topk != 2),
        (f"{moe.num_experts // (moe.router_num_groups or 1)} experts per group (transformers needs >= 2)",
         moe.num_experts // (moe.router_num_groups or 1) < 2),
        (f"--moe-shared-expert-intermediate-size {shared} (needs a multiple of the expert width {expert_width})",
         shared is None or shared % expert_width),
        (f"--moe-layer-freq {''.join(str(int(x)) for x in moe.layer_pattern)} (needs dense layers first, then MoE)",
         not all(moe.layer_pattern[first:])),
        ("capacity dropping (DeepSeek-V3 is dropless)", moe.expert_capacity_factor is not None),
        ("--use-rope-scaling (plain rotary and YaRN are mapped for DeepSeek-V3)",
         config.rope_scaling_factor is not None),
        (f"--layernorm-epsilon {config.layernorm_epsilon} (its latent norms use {_LATENT_NORM_EPS})",
         config.layernorm_epsilon != _LATENT_NORM_EPS)) if present]
    if mla is None:
        wrong.append("fused-QKV attention (needs --multi-latent-attention)")
    if wrong:
        raise ValueError(f"transformers' DeepseekV3ForCausalLM cannot hold this model: {', '.join(wrong)}")


def deepseek_model_type(config: ModelConfig) -> str:
    """'deepseek_v3' for a model ``check_deepseek`` accepts."""
    check_deepseek(config)
    return "deepseek_v3"


def ours_to_deepseek_state_dict(state: dict[str, torch.Tensor], config: ModelConfig,
                                vocab_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """A TP=1 GPTModel state dict (every expert; the routers' expert biases if enabled) -> a DeepseekV3ForCausalLM
    state dict as ``save_pretrained`` writes it. vocab_size: keep only the first rows of the embedding and head."""
    check_deepseek(config)
    if config.mtp_num_layers:
        flat, n = _flattened(config), config.num_layers
        out = ours_to_deepseek_state_dict(_mtp_as_layers(state, config), flat, vocab_size)
        for k in range(config.mtp_num_layers):
            mine, theirs = f"mtp.layers.{k}.", f"model.layers.{n + k}."
            out.update({theirs + hf: state[mine + ours] for ours, hf in _MTP_NAMES})
            out[theirs + "embed_tokens.weight"] = out["model.embed_tokens.weight"]
            out[theirs + "shared_head.head.weight"] = out["lm_head.weight"]
        return out
    biases = set(router_buffer_names(config))
    out = llama.ours_to_llama_state_dict({n: t for n, t in state.items() if n not in biases}, config, vocab_size)
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for mine, hf in MLA_NAMES:
            if ours + "self_attention." + mine in state:
                out[theirs + "self_attn." + hf] = state[ours + "self_attention." + mine]
        if not config.moe.is_moe_layer(i):
            continue
        out.update(experts_to_hf(state, ours, theirs, _EXPERTS, config.moe.num_experts))
        bias = state.get(ours + _BIAS[0])
        out[theirs + _BIAS[1]] = bias if bias is not None else torch.zeros(config.moe.num_experts)
        gate, up = llama.split_fc1(state[ours + _SHARED_FC1])  # 2 x [fs, h]
        out.update({theirs + "mlp.shared_experts.gate_proj.weight": gate,
                    theirs + "mlp.shared_experts.up_proj.weight": up,
                    theirs + "mlp.shared_experts.down_proj.weight": state[ours + _SHARED_FC2]})
    return out


_MTP_NAMES = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
              ("final_layernorm.weight", "shared_head.norm.weight"))


def _flattened(config: ModelConfig) -> ModelConfig:
    """``config`` with its MTP depths' decoder layers as layers n .. n + D - 1 of the decoder (their kind the last
    layer's): DeepSeek's numbering, so that the layer mapping above converts them."""
    d = config.mtp_num_layers
    moe = dataclasses.replace(config.moe, layer_pattern=config.moe.layer_pattern + (config.moe.layer_pattern[-1],) * d)
    return dataclasses.replace(config, num_layers=config.num_layers + d, mtp_num_layers=0, moe=moe)


def _mtp_as_layers(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict with each depth's ``mtp.layers.{k}.transformer_layer.*`` renamed ``layers.{n+k}.*`` and its
    other tensors (``_MTP_NAMES``) left out."""
    out = {}
    for name, tensor in state.items():
        m = re.match(r"mtp\.layers\.(\d+)\.(.*)", name)
        if m is None:
            out[name] = tensor
        elif m.group(2).startswith("transformer_layer."):
            out[f"layers.{config.num_layers + int(m.group(1))}.{m.group(2)[len('transformer_layer.'):]}"] = tensor
    return out


def fit_config(config: ModelConfig, hf_state: dict[str, torch.Tensor]) -> ModelConfig:
    """``config`` without MTP depths when the checkpoint holds none (module docstring)."""
    if config.mtp_num_layers and not any(name.startswith(f"model.layers.{config.num_layers}.") for name in hf_state):
        warnings.warn(f"DeepSeek-V3: the config announces {config.mtp_num_layers} multi-token-prediction layer(s) but "
                      f"the checkpoint holds none (no model.layers.{config.num_layers}.*): imported without MTP",
                      stacklevel=2)
        return dataclasses.replace(config, mtp_num_layers=0)
    return config


def _drop_mtp_layers(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    extra = sorted({int(m.group(1)) for name in state if (m := re.match(r"model\.layers\.(\d+)\.", name))
                    and int(m.group(1)) >= num_layers})
    if extra:
        warnings.warn(f"DeepSeek-V3: dropping layers {extra} (multi-token prediction; transformers' "
                      f"DeepseekV3ForCausalLM ignores them too)", stacklevel=3)
    return {name: t for name, t in state.items()
            if not ((m := re.match(r"model\.layers\.(\d+)\.", name)) and int(m.group(1)) >= num_layers)}


def deepseek_state_dict_to_ours(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A DeepseekV3ForCausalLM state dict -> a TP=1 GPTModel state dict of ``config`` (the expert biases included).
    ValueError for any tensor left unmapped or missing."""
    check_deepseek(config)
    if config.mtp_num_layers:
        return _mtp_state_dict_to_ours(hf_state, config)
    state = _drop_mtp_layers(hf_state, config.num_layers)
    ours = {}
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        for our_name, hf in MLA_NAMES:
            if theirs + "self_attn." + hf in state:
                ours[mine + "self_attention." + our_name] = state.pop(theirs + "self_attn." + hf)
        if config.moe.is_moe_layer(i):
            ours.update(experts_from_hf(state, mine, theirs, _EXPERTS, config.moe.num_experts, "DeepSeek-V3"))
            ours.update(_router_bias_and_shared_expert(state, mine, theirs))
    ours.update(llama.llama_state_dict_to_ours(state, config))  # the rest; it refuses any tensor left over
    missing = sorted(set(parameter_layout(config)) - set(ours))
    if missing:
        raise ValueError(f"the DeepSeek-V3 checkpoint lacks what this configuration has: {missing} (a query latent? "
                         f"check q_lora_rank)")
    return ours


def _mtp_state_dict_to_ours(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    n, state = config.num_layers, dict(hf_state)
    extras = {}
    for k in range(config.mtp_num_layers):
        theirs = f"model.layers.{n + k}."
        missing = [theirs + hf for _, hf in _MTP_NAMES if theirs + hf not in state]
        if missing:
            raise ValueError(f"the DeepSeek-V3 checkpoint's MTP layer {n + k} lacks {', '.join(missing)}")
        extras.update({f"mtp.layers.{k}.{ours}": state.pop(theirs + hf) for ours, hf in _MTP_NAMES})
        for copy, main in (("embed_tokens.weight", "model.embed_tokens.weight"),
                           ("shared_head.head.weight", "lm_head.weight")):
            tensor = state.pop(theirs + copy, None)
            if tensor is not None and main in state and not torch.equal(tensor, state[main]):
                raise ValueError(f"the DeepSeek-V3 checkpoint's {theirs + copy} differs from {main}: our MTP depths "
                                 f"share the model's embedding and head")
    flat = deepseek_state_dict_to_ours(state, _flattened(config))
    ours = {}
    for name, tensor in flat.items():
        m = re.match(r"layers\.(\d+)\.(.*)", name)
        if m is not None and int(m.group(1)) >= n:
            name = f"mtp.layers.{int(m.group(1)) - n}.transformer_layer.{m.group(2)}"
        ours[name] = tensor
    ours.update(extras)
    missing = sorted(set(parameter_layout(config)) - set(ours))
    if missing:
        raise ValueError(f"the DeepSeek-V3 checkpoint lacks what this configuration has: {missing}")
    return ours


def _router_bias_and_shared_expert(state: dict[str, torch.Tensor], mine: str, theirs: str) -> dict[str, torch.Tensor]:
    """Pops one MoE layer's expert bias and shared expert from ``state``; ValueError naming one that is missing."""
    names = (theirs + _BIAS[1], theirs + "mlp.shared_experts.gate_proj.weight",
             theirs + "mlp.shared_experts.up_proj.weight", theirs + "mlp.shared_experts.down_proj.weight")
    missing = [name for name in names if name not in state]
    if missing:
        raise ValueError(f"{theirs.rstrip('.')} lacks {', '.join(missing)}: not a DeepSeek-V3 MoE layer")
    bias, gate, up, down = (state.pop(name) for name in names)
    return {mine + _BIAS[0]: bias.float(), mine + _SHARED_FC1: llama.fuse_fc1(gate, up), mine + _SHARED_FC2: down}


def deepseek_config_kwargs(config: ModelConfig, vocab_size: Optional[int] = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.DeepseekV3Config`` describing ``config``."""
    check_deepseek(config)
    moe, mla = config.moe, config.mla
    kwargs = llama.llama_config_kwargs(config, vocab_size)
    for name in ("attention_bias", "mlp_bias", "head_dim"):
        kwargs.pop(name, None)
    kwargs.update(moe_intermediate_size=config.expert_ffn_size, n_routed_experts=moe.num_experts,
                  n_shared_experts=moe.shared_expert_intermediate_size // config.expert_ffn_size,
                  num_experts_per_tok=moe.router_topk, n_group=moe.router_num_groups or 1,
                  topk_group=moe.router_group_topk or 1, norm_topk_prob=moe.router_topk > 1,
                  routed_scaling_factor=moe.router_topk_scaling_factor or 1.0,
                  first_k_dense_replace=_num_dense_first(config), q_lora_rank=mla.q_lora_rank,
                  kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_head_dim,
                  qk_rope_head_dim=mla.qk_pos_emb_head_dim, v_head_dim=mla.v_head_dim, rope_interleave=True,
                  attention_bias=False, num_mtp_layers=config.mtp_num_layers)
    return kwargs


def _check_hf_deepseek(hf_config: Any) -> None:
    """ValueError for what our model does not compute as transformers' DeepseekV3 does."""
    heads, k = hf_config.num_attention_heads, hf_config.num_experts_per_tok
    groups, group_topk = hf_config.n_group or 1, hf_config.topk_group or 1
    wrong = [what for what, present in (
        (f"hidden_act {hf_config.hidden_act!r} (only SwiGLU, silu, is mapped)", hf_config.hidden_act != "silu"),
        ("rope_interleave False (only DeepSeek's interleaved rotary layout is mapped)",
         not getattr(hf_config, "rope_interleave", True)),
        ("attention_bias True", getattr(hf_config, "attention_bias", False)),
        (f"num_key_value_heads {hf_config.num_key_value_heads} != num_attention_heads {heads}",
         hf_config.num_key_value_heads not in (None, heads)),
        (f"rms_norm_eps {hf_config.rms_norm_eps} (its latent norms use {_LATENT_NORM_EPS}: ours share one epsilon)",
         hf_config.rms_norm_eps != _LATENT_NORM_EPS),
        (f"num_experts_per_tok {k} / topk_group {group_topk} != 2 (its group score sums the 2 best experts, ours "
         f"the k / group_topk best)", groups > 1 and k // group_topk != 2),
        (f"norm_topk_prob {hf_config.norm_topk_prob} with num_experts_per_tok {k} (our sigmoid weights are "
         f"normalised exactly when k > 1)", bool(hf_config.norm_topk_prob) != (k > 1)),
        ("n_shared_experts 0 (a shared expert is mapped, none is not)", not hf_config.n_shared_experts)) if present]
    if wrong:
        raise ValueError(f"DeepseekV3ForCausalLM with {', '.join(wrong)} is not converted here")


def model_config_from_deepseek(hf_config: Any, seq_length: int, **overrides) -> ModelConfig:
    """A ModelConfig for a transformers ``DeepseekV3Config``; ValueError for what is not mapped (see above).

    seq_length: the training / inference length. overrides: any other ModelConfig field (padded_vocab_size...).
    """
    _check_hf_deepseek(hf_config)
    rope = llama.rope_fields(hf_config)
    if "rope_scaling_factor" in rope:
        raise ValueError("rope_type llama3 with DeepSeek-V3 is not mapped; plain rotary (rope_type default) and "
                         "YaRN (yarn, DeepSeek-V3's own) are")
    n, first = hf_config.num_hidden_layers, hf_config.first_k_dense_replace
    groups = hf_config.n_group if (hf_config.n_group or 1) > 1 else None
    moe = MoEConfig(num_experts=hf_config.n_routed_experts, layer_pattern=tuple(i >= first for i in range(n)),
                    ffn_hidden_size=hf_config.moe_intermediate_size, router_topk=hf_config.num_experts_per_tok,
                    router_score_function="sigmoid", router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
                    router_num_groups=groups, router_group_topk=hf_config.topk_group if groups else None,
                    router_enable_expert_bias=True,
                    shared_expert_intermediate_size=hf_config.moe_intermediate_size * hf_config.n_shared_experts)
    mla = MLAConfig(q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
                    qk_head_dim=hf_config.qk_nope_head_dim, qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
                    v_head_dim=hf_config.v_head_dim)
    fields = dict(llama.llama_block_fields(hf_config, seq_length), ffn_hidden_size=hf_config.intermediate_size,
                  **rope, add_bias_linear=False, qk_layernorm=True, moe=moe, mla=mla,
                  kv_channels=None,  # MLA's head sizes are its own (transformers' head_dim is the rotary part)
                  mtp_num_layers=getattr(hf_config, "num_mtp_layers", 0) or 0)
    fields.update(overrides)
    return ModelConfig(**fields).validate()
