"""The planner's multi-head latent attention (MLA; DeepSeek-V2 / V3): its parameters against what GPTModel builds
(whole and on a TP=2 rank), DeepSeek-V3's published 671B by hand, its FLOPs (Megatron-LM's MLA count) and the
tensors the attention keeps for backward, measured on the module."""

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig
from megatron.config.mla import MLAConfig
from megatron.config.moe import MoEConfig
from megatron.model import GPTModel
from megatron.model.latent_attention import MultiLatentAttention
from megatron.model.layout import parameter_layout
from megatron.planner import MODEL_SIZES, model_shape_of
from megatron.planner.candidate import Layout
from megatron.planner.memory import layer_activation_bytes
from megatron.testing.tolerance import tolerance

# float64 formulas of a dozen operations in other orders (tests/planner/test_llama_shapes.py's bound)
F64 = tolerance(torch.float64, 16, 1)

MLA = MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10)
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=256, seq_length=16,
            normalization="rmsnorm", swiglu=True, add_bias_linear=False, position_embedding_type="rotary",
            untie_embeddings_and_output_weights=True, ffn_hidden_size=96, mla=MLA, qk_layernorm=True)


def _moe(**overrides):
    return MoEConfig(**{**dict(num_experts=4, layer_pattern=(False, True), ffn_hidden_size=32, router_topk=2,
                               shared_expert_intermediate_size=32), **overrides})


@pytest.mark.parametrize("overrides", [
    dict(), dict(qk_layernorm=False), dict(mla=dataclasses.replace(MLA, q_lora_rank=None)),
    dict(normalization="layernorm", untie_embeddings_and_output_weights=False),
    dict(moe=_moe(), mtp_num_layers=1)], ids=["latents", "no-latent-norms", "full-rank-query", "layernorm-tied",
                                              "moe-mtp"])
def test_the_mla_shape_counts_what_the_model_builds(overrides):
    config = ModelConfig(**{**TINY, **overrides}).validate()
    shape, model = model_shape_of(config), GPTModel(config)
    assert shape.total_params() == sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0."))
    assert shape.layer_params() == layer
    # One TP=2 rank holds half of every split tensor (the up- and output projections) and all of every replicated
    # one (the down-projections and the latent norms), the layout's tags
    split = sum(model.get_parameter(n).numel() for n, e in parameter_layout(config).items()
                if n.startswith("layers.0.") and not e.replicated)
    assert shape.layer_params(2) == split // 2 + (layer - split)


def test_deepseek_v3_has_671b_parameters_and_a_11_6b_mtp_layer():
    """DeepSeek-V3 (its paper: 671B total, 37B activated per token; Hugging Face's 685B = those and the 14B MTP
    module, stored with its own copy of the embedding and the head), by hand from its config."""
    h, V, f, fe, E, k = 7168, 129280, 18432, 2048, 256, 8
    dq, dc, dn, dr, dv, heads = 1536, 512, 128, 64, 128, 128
    attention = (h * dq + dq + dq * heads * (dn + dr)     # W_qA, its norm, W_qB
                 + h * (dc + dr) + dc + dc * heads * (dn + dv)  # W_kvA, its norm, W_kvB
                 + heads * dv * h)                        # W_o
    assert attention == 187_107_328
    expert = 3 * h * fe
    dense_layer = attention + 3 * h * f + 2 * h
    moe_layer = attention + (E + 1) * expert + E * h + 2 * h   # routed and shared experts, the router, 2 norms
    by_hand = 3 * dense_layer + 58 * moe_layer + 2 * V * h + h
    shape = MODEL_SIZES["deepseek-v3"]
    assert shape.total_params() == by_hand == 671_026_404_352
    activated = by_hand - 58 * (E - k) * expert - V * h     # 8 of 256 experts; the embedding is a lookup
    assert round(activated / 1e9) == 37
    mtp = dataclasses.replace(shape, mtp_num_layers=1)
    mtp_module = moe_layer + 2 * h * h + 3 * h             # its layer, the projection [h, 2h], enorm, hnorm, norm
    assert mtp.total_params() - by_hand == mtp.mtp_params() == mtp_module
    assert round(mtp_module / 1e9, 1) == 11.6
    # Hugging Face's count: the MTP module stores the embedding and the head again (~14B with them)
    assert (by_hand + mtp_module + 2 * V * h) / 1e9 == pytest.approx(685, rel=0.001)


def test_mla_flops_are_megatron_lms_count():
    """Megatron-LM's MLA FLOPs (num_floating_point_operations, its MLA branch, less the norms' +1 terms and the
    causal halving this formula's attention term never had): the projections' weights, 2 FLOPs each, and the core
    2 s np (dn + dr) for the scores plus 2 s np dv for the context, forward; x3 with the backward."""
    config = ModelConfig(**TINY).validate()
    s, b, L, h, V, f, heads = 16, 8, 2, 64, 256, 96, 4
    dq, dc, dn, dr, dv = 24, 16, 12, 8, 10
    projections = h * dq + dq * heads * (dn + dr) + h * (dc + dr) + dc * heads * (dn + dv) + heads * dv * h
    by_hand = 3 * b * s * (L * (2 * (projections + 3 * f * h) + 2 * s * heads * (dn + dr) + 2 * s * heads * dv)
                           + 1.5 * V * h)
    assert config.flops_per_iteration(b, recompute=False) == pytest.approx(by_hand, rel=F64, abs=0)
    assert model_shape_of(config).flops_per_iteration(s, b, recompute=False) == \
        config.flops_per_iteration(b, recompute=False)  # exact: megatron_flops of the same numbers


@pytest.mark.parametrize("overrides", [dict(), dict(qk_layernorm=False),
                                       dict(mla=dataclasses.replace(MLA, q_lora_rank=None))],
                         ids=["latents", "no-latent-norms", "full-rank-query"])
def test_mla_keeps_what_the_planner_counts(overrides):
    """The tensors MultiLatentAttention keeps for backward (autograd's saved tensors, each storage once), but its
    weights, the norms' statistics, RoPE's cos / sin and the stored attention probabilities (the planner's scores
    term): per token exactly the heads' q, k, key / value up-projection and context and the latents of
    ``ModelShape.mla_kept_widths``."""
    s, b = 32, 2
    config = ModelConfig(**{**TINY, **overrides, "seq_length": s, "attention_backend": "sdpa"}).validate()
    attention = MultiLatentAttention(config)
    x = torch.randn(s, b, config.hidden_size, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in attention.parameters()} | {x.untyped_storage().data_ptr()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        statistics, probabilities = tensor.shape[-1] == 1, tuple(tensor.shape[-2:]) == (s, s)
        cos_sin = tuple(tensor.shape[:-1]) == (s, 1, 1)
        if storage.data_ptr() not in params and not (statistics or probabilities or cos_sin):
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        attention(x).sum().backward()
    heads_part, latents = model_shape_of(config).mla_kept_widths
    assert sum(kept.values()) == (heads_part + latents) * s * b * 4  # fp32
    # the planner's layer: those at w bytes each, the heads' part split by TP, the latents too under SP
    shape, w = model_shape_of(config), 2
    plain = dataclasses.replace(shape, mla=None, num_key_value_heads=None)
    layout = Layout(tp=2, pp=1, dp=1, micro_batch_size=b, sequence_parallel=True, store_attention_scores=False)
    extra = layer_activation_bytes(shape, layout, s, w) - layer_activation_bytes(plain, layout, s, w)
    assert extra == pytest.approx(s * b * w * ((heads_part - 4 * shape.q_hidden) / 2 + latents / 2), rel=F64, abs=0)
