"""Map full (TP=1, every expert) weights and configs between GPTModel and transformers' MoE Llama relatives:
``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``.

Both are the Llama block (``megatron.checkpoint.hf.llama`` maps its attention, norms, embedding and head) with
the MLP of chosen layers replaced by routed SwiGLU experts, routed as transformers computes it:

    Mixtral:    scores = softmax(x W_g^T) (fp32), top-k, the k weights divided by their sum
    Qwen3-MoE:  the same, divided by their sum only with ``norm_topk_prob`` (else the softmax values:
                our ``router_pre_softmax``); every query / key head RMS-normed before the rotary
                (``q_norm`` / ``k_norm``: our ``--qk-layernorm``); layers in ``mlp_only_layers`` (or off
                ``decoder_sparse_step``) keep a dense MLP of ``intermediate_size``

which is ``megatron.model.moe.router.route`` with softmax scores, no groups, bias, scaling or capacity (both are
dropless). The checkpoints on disk (what ``save_pretrained`` writes; transformers fuses them in memory) hold one
matrix per expert, where we stack them:

    mlp.router.weight    [E, h]          <-> Mixtral block_sparse_moe.gate.weight, Qwen3 mlp.gate.weight
    mlp.experts.w1       [E, 2f, h]      <-> per expert: gate (Mixtral w1, Qwen3 gate_proj) and up (w3, up_proj)
                                             [f, h], our rows interleaved [f, 2] as the dense MLP's
    mlp.experts.w2       [E, h, f]       <-> per expert: down (Mixtral w2, Qwen3 down_proj) [h, f]
    self_attention.q_layernorm.weight    <-> self_attn.q_norm.weight [hn] (k likewise; ``llama`` maps them)

``DeepseekV3ForCausalLM`` (multi-head latent attention, sigmoid group-limited routing) is mapped by
``megatron.checkpoint.hf.deepseek`` with this module's expert helpers. Nothing here imports transformers.
Shape letters: E experts, h hidden, f expert width, hn head dim.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron.checkpoint.hf.llama import (
    check_llama_block,
    fuse_fc1,
    kv_heads_of,
    llama_block_fields,
    llama_config_kwargs,
    llama_family_of,
    llama_state_dict_to_ours,
    ours_to_llama_state_dict,
    rope_fields,
    split_fc1,
)
from megatron.config import ModelConfig
from megatron.config.moe import MoEConfig

__all__ = ["MODEL_TYPES", "moe_family_of", "experts_to_hf", "experts_from_hf", "ours_to_moe_state_dict",
           "moe_state_dict_to_ours", "moe_config_kwargs", "model_config_from_moe"]

MODEL_TYPES = {"mixtral": ("MixtralConfig", "MixtralForCausalLM"),  # model_type -> (config class, model class)
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
# Per family: the router's name and each expert's (gate, up, down) names inside ``model.layers.{i}.``.
_NAMES = {"mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                      "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
          "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                        "mlp.experts.{e}.down_proj.weight")}


def moe_family_of(config: ModelConfig) -> str:
    """'mixtral' or 'qwen3_moe' (the transformers model_type ``config`` exports to), or ValueError naming what
    neither has."""
    llama_family_of(config)
    moe = config.moe
    if moe is None:
        raise ValueError("a dense model is not a Mixtral / Qwen3-MoE model (no --num-experts)")
    wrong = [what for what, present in (
        ("biases (needs --disable-bias-linear, no --add-qkv-bias)", config.qkv_bias),
        (f"--moe-router-score-function {moe.router_score_function} (needs softmax)",
         moe.router_score_function != "softmax"),
        ("group-limited routing", moe.router_num_groups is not None),
        ("--moe-router-topk-scaling-factor", moe.router_topk_scaling_factor is not None),
        ("an expert bias (--moe-router-enable-expert-bias)", moe.router_enable_expert_bias),
        ("a shared expert", moe.shared_expert_intermediate_size is not None),
        ("capacity dropping (both are dropless)", moe.expert_capacity_factor is not None)) if present]
    family = "qwen3_moe" if config.qk_layernorm else "mixtral"
    if family == "mixtral" and moe.router_pre_softmax:
        wrong.append("--moe-router-pre-softmax without --qk-layernorm (Mixtral renormalises the top-k weights)")
    if family == "mixtral" and not all(moe.layer_pattern):
        wrong.append("dense layers without --qk-layernorm (every Mixtral layer is MoE)")
    if wrong:
        raise ValueError(f"transformers' Mixtral / Qwen3-MoE cannot hold this MoE model: {', '.join(wrong)}")
    return family


def _moe_layers(config: ModelConfig) -> list[int]:
    return [i for i in range(config.num_layers) if config.moe.is_moe_layer(i)]


def ours_to_moe_state_dict(state: dict[str, torch.Tensor], config: ModelConfig,
                           vocab_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """A TP=1 GPTModel state dict (every expert) -> a Mixtral / Qwen3-MoE state dict as ``save_pretrained``
    writes it (one matrix per expert). vocab_size: keep only the first rows of the embedding and the head."""
    family = moe_family_of(config)
    out = ours_to_llama_state_dict(state, config, vocab_size)  # all but the experts and the router
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        if not config.moe.is_moe_layer(i):
            continue
        out.update(experts_to_hf(state, ours, theirs, _NAMES[family], config.moe.num_experts))
    return out


def experts_to_hf(state: dict[str, torch.Tensor], ours: str, theirs: str, names: tuple[str, str, str, str],
                  num_experts: int) -> dict[str, torch.Tensor]:
    """One MoE layer's router and stacked experts (our names under ``ours``) -> one matrix per expert under
    ``theirs``; names: (router, gate, up, down) with ``{e}`` for the expert."""
    router, gate, up, down = names
    out = {theirs + router: state[ours + "mlp.router.weight"]}
    w1, w2 = state[ours + "mlp.experts.w1"], state[ours + "mlp.experts.w2"]  # [E, 2f, h], [E, h, f]
    for e in range(num_experts):
        out[theirs + gate.format(e=e)], out[theirs + up.format(e=e)] = split_fc1(w1[e])  # 2 x [f, h]
        out[theirs + down.format(e=e)] = w2[e]  # [h, f]
    return out


def experts_from_hf(state: dict[str, torch.Tensor], ours: str, theirs: str, names: tuple[str, str, str, str],
                    num_experts: int, family: str) -> dict[str, torch.Tensor]:
    """The inverse of :func:`experts_to_hf`: pops one layer's tensors from ``state``; ValueError naming the first
    one missing (``family``: the checkpoint's kind, for the message)."""
    router, gate, up, down = names
    experts = range(num_experts)
    try:
        return {ours + "mlp.router.weight": state.pop(theirs + router),
                ours + "mlp.experts.w1": torch.stack([fuse_fc1(state.pop(theirs + gate.format(e=e)), state.pop(
                    theirs + up.format(e=e))) for e in experts]),  # [E, 2f, h]
                ours + "mlp.experts.w2": torch.stack([state.pop(theirs + down.format(e=e)) for e in experts])}
    except KeyError as missing:
        raise ValueError(f"{theirs.rstrip('.')} lacks {missing.args[0]}: not a {family} checkpoint with {num_experts} "
                         f"experts per MoE layer") from None


def moe_state_dict_to_ours(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A Mixtral / Qwen3-MoE state dict (one matrix per expert) -> a TP=1 GPTModel state dict of ``config``.
    ValueError for any tensor left unmapped or missing."""
    family = moe_family_of(config)
    state = dict(hf_state)
    ours = {}
    for i in range(config.num_layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        if not config.moe.is_moe_layer(i):
            continue
        ours.update(experts_from_hf(state, mine, theirs, _NAMES[family], config.moe.num_experts, family))
    ours.update(llama_state_dict_to_ours(state, config))  # the rest; it refuses any tensor left over
    return ours


def moe_config_kwargs(config: ModelConfig, vocab_size: Optional[int] = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.MixtralConfig`` / ``Qwen3MoeConfig`` (``moe_family_of(config)``)."""
    family, moe = moe_family_of(config), config.moe
    kwargs = llama_config_kwargs(config, vocab_size)
    for name in ("attention_bias", "mlp_bias"):  # neither family has biases (moe_family_of checked)
        kwargs.pop(name, None)
    kwargs.update(num_experts_per_tok=moe.router_topk, router_aux_loss_coef=moe.aux_loss_coeff)
    if family == "mixtral":
        kwargs.update(num_local_experts=moe.num_experts, intermediate_size=config.expert_ffn_size,
                      router_jitter_noise=0.0, sliding_window=None)
    else:
        # Qwen3MoeConfig has no head_dim argument but keeps one given, and its attention reads it (hidden / heads
        # without it); transformers' Qwen3-MoE checkpoints carry it
        kwargs.update(num_experts=moe.num_experts, moe_intermediate_size=config.expert_ffn_size,
                      norm_topk_prob=not moe.router_pre_softmax, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(config.num_layers) if not moe.is_moe_layer(i)],
                      use_sliding_window=False)
    return kwargs


def _moe_config(hf_config: Any, model_type: str) -> tuple[MoEConfig, int]:
    """Our MoEConfig of a Mixtral / Qwen3-MoE config, and the dense MLP width of any dense layers."""
    n = hf_config.num_hidden_layers
    if model_type == "mixtral":
        if getattr(hf_config, "router_jitter_noise", 0.0):
            raise ValueError(f"router_jitter_noise {hf_config.router_jitter_noise}: the router's training noise is "
                             f"not implemented here (set it to 0)")
        return MoEConfig(num_experts=hf_config.num_local_experts, layer_pattern=(True,) * n,
                         ffn_hidden_size=hf_config.intermediate_size, router_topk=hf_config.num_experts_per_tok,
                         aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0))), \
            hf_config.intermediate_size
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = hf_config.decoder_sparse_step
    pattern = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))  # transformers' Qwen3MoeDecoderLayer
    return MoEConfig(num_experts=hf_config.num_experts, layer_pattern=pattern,
                     ffn_hidden_size=hf_config.moe_intermediate_size, router_topk=hf_config.num_experts_per_tok,
                     router_pre_softmax=not hf_config.norm_topk_prob,
                     aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0))), \
        hf_config.intermediate_size


def model_config_from_moe(hf_config: Any, seq_length: int, **overrides) -> ModelConfig:
    """A ModelConfig for a transformers ``MixtralConfig`` / ``Qwen3MoeConfig``.

    seq_length: the training / inference length. overrides: any other ModelConfig field (padded_vocab_size...).
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    check_llama_block(hf_config, model_type)
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("attention_bias True: this converter maps Mixtral / Qwen3-MoE without biases")
    moe, dense_width = _moe_config(hf_config, model_type)
    fields = dict(llama_block_fields(hf_config, seq_length), num_key_value_heads=kv_heads_of(hf_config),
                  ffn_hidden_size=dense_width, **rope_fields(hf_config), add_bias_linear=False,
                  qk_layernorm=model_type == "qwen3_moe", moe=moe)
    fields.update(overrides)
    return ModelConfig(**fields).validate()
