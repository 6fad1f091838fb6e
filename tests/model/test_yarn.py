"""YaRN rotary scaling (megatron.model.positional.Yarn) against transformers' implementation of the same config: the
frequencies (``_compute_yarn_parameters``' inv_freq), the attention factor cos and sin are multiplied by, cos / sin
at positions far beyond the original context (transformers' rotary embedding modules), and MLA's softmax scale
(``yarn_apply_mscale``), for a Qwen3-style config and DeepSeek-V3-style ones; and the attention modules use it."""

import dataclasses
import math

import pytest
import torch

from megatron.config import ModelConfig
from megatron.config.mla import MLAConfig
from megatron.model.positional import Yarn, rotary_cos_sin, rotary_inv_freq, rotary_scaling
from megatron.testing.tolerance import tolerance

# (transformers config class name, its kwargs, our head dim, base, Yarn)
QWEN3 = ("Qwen3Config", dict(hidden_size=64, num_attention_heads=4, head_dim=128, max_position_embeddings=131072,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                              "original_max_position_embeddings": 32768}),
         128, 1e6, Yarn(4.0, 32768))
LLAMA_UNROUNDED = ("LlamaConfig", dict(hidden_size=64, num_attention_heads=2, max_position_embeddings=8192,
                                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                        "original_max_position_embeddings": 1024, "beta_fast": 16.0,
                                                        "beta_slow": 2.0, "truncate": False}),
                   32, 1e4, Yarn(8.0, 1024, 16.0, 2.0, round_to_int=False))
DEEPSEEK_V3 = ("DeepseekV3Config", dict(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                        max_position_embeddings=163840,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
               64, 1e4, Yarn(40.0, 4096, 32.0, 1.0, 1.0, 1.0))
# mscale != mscale_all_dim: the attention factor is not 1 (DeepSeek-V2's 0.707 in one of them)
DEEPSEEK_RATIO = ("DeepseekV3Config", dict(DEEPSEEK_V3[1], rope_parameters=dict(DEEPSEEK_V3[1]["rope_parameters"],
                                                                                  mscale=1.0, mscale_all_dim=0.707)),
                  64, 1e4, Yarn(40.0, 4096, 32.0, 1.0, 1.0, 0.707))
CASES = {"qwen3": QWEN3, "llama_unrounded": LLAMA_UNROUNDED, "deepseek_v3": DEEPSEEK_V3,
         "deepseek_ratio": DEEPSEEK_RATIO}


def _hf_config(case):
    import transformers

    name, kwargs, *_ = case
    return getattr(transformers, name)(**kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_and_attention_factor_are_transformers(name):
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    case = CASES[name]
    _, _, head_dim, base, yarn = case
    theirs, their_factor = _compute_yarn_parameters(_hf_config(case), torch.device("cpu"))
    ours = rotary_inv_freq(head_dim, base, yarn)
    assert ours.shape == theirs.shape == (head_dim // 2,)
    # per frequency: the power (ours base^-x, theirs 1 / base^x), the division by the factor, the ramp's two products
    # and their sum: 5 fp32 roundings of numbers of its own size
    bound = torch.tensor([tolerance(torch.float32, 5, 1, scale=f) for f in theirs.tolist()])
    assert ((ours - theirs).abs() <= bound).all(), (ours - theirs).abs().max()
    # the ramp does mix: some frequencies kept, some interpolated, some between (or the comparison is weak)
    plain = rotary_inv_freq(head_dim, base)
    ratio = (plain / ours).tolist()
    assert min(ratio) == pytest.approx(1.0) and max(ratio) == pytest.approx(yarn.factor, rel=1e-5)
    assert any(1.01 < r < yarn.factor * 0.99 for r in ratio), ratio
    # the factor cos and sin are multiplied by: the same formula in float64, one division apart
    assert abs(yarn.attention_factor - their_factor) <= tolerance(torch.float64, 2, 1, scale=their_factor)
    if name in ("qwen3", "llama_unrounded"):  # no mscale: transformers' 0.1 ln(factor) + 1
        assert yarn.attention_factor == pytest.approx(0.1 * math.log(yarn.factor) + 1, rel=1e-15)
    if name == "deepseek_v3":
        assert yarn.attention_factor == 1.0


@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_beyond_the_original_context_are_transformers(name):
    import transformers

    case = CASES[name]
    config = _hf_config(case)
    _, _, head_dim, base, yarn = case
    module = {"Qwen3Config": transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding,
              "LlamaConfig": transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
              "DeepseekV3Config": transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding}[
        case[0]](config)
    positions = torch.tensor([0, 1, 7, yarn.original_max_positions - 1, yarn.original_max_positions,
                              2 * yarn.original_max_positions + 3, int(yarn.factor * yarn.original_max_positions) - 1])
    cos_t, sin_t = module(torch.zeros(1, dtype=torch.float32), positions[None])  # [1, s, hn]
    cos, sin = rotary_cos_sin(positions, head_dim, base, yarn)  # [s, hn]
    # an angle p f carries the frequency's few roundings relative to its size (test above) and one of the product;
    # cos / sin move by as much, times the attention factor, plus their own and the factor's product's roundings
    angles = positions.double()[:, None] * rotary_inv_freq(head_dim, base, yarn).double()[None, :]
    for ours, theirs in ((cos, cos_t[0]), (sin, sin_t[0])):
        per_angle = torch.cat([angles, angles], dim=-1).clamp(min=1.0)
        bound = yarn.attention_factor * per_angle * tolerance(torch.float32, 8, 1)
        assert ((ours.double() - theirs.double()).abs() <= bound).all(), (ours - theirs).abs().max()
    assert cos.abs().max() == pytest.approx(yarn.attention_factor, rel=1e-6)  # position 0's cos 1, scaled


def test_mla_softmax_scale_is_transformers():
    """DeepSeek-V3's MLA multiplies its softmax scale by mscale(factor, mscale_all_dim)^2 (transformers'
    yarn_apply_mscale, Megatron-LM's MultiLatentAttention); the fused-QKV attention does not."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    from megatron.model.latent_attention import MultiLatentAttention

    for case in (DEEPSEEK_V3, DEEPSEEK_RATIO):
        rope = case[1]["rope_parameters"]
        config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, padded_vocab_size=64, seq_length=8,
                             position_embedding_type="rotary", normalization="rmsnorm", swiglu=True,
                             add_bias_linear=False, qk_layernorm=True, layernorm_epsilon=1e-6,
                             mla=MLAConfig(q_lora_rank=None, kv_lora_rank=16, qk_head_dim=128, qk_pos_emb_head_dim=64,
                                           v_head_dim=16),
                             yarn_rotary_scaling_factor=rope["factor"], yarn_mscale=rope["mscale"],
                             yarn_mscale_all_dim=rope["mscale_all_dim"]).validate()
        theirs = yarn_apply_mscale(rope, (128 + 64) ** -0.5)
        ours = MultiLatentAttention(config)._scale
        assert abs(ours - theirs) <= tolerance(torch.float64, 4, 1, scale=theirs), (ours, theirs)
        assert ours > 1.5 * (128 + 64) ** -0.5  # (0.1 ln 40 + 1)^2 or so: the check sees the factor
        plain = MultiLatentAttention(dataclasses.replace(config, yarn_rotary_scaling_factor=None))._scale
        assert plain == 1.0 / math.sqrt(128 + 64)


def test_a_factor_of_one_is_plain_rotary():
    """Megatron-LM's default --rotary-scaling-factor 1 (MLA's default rope type is yarn): exactly plain rotary."""
    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, padded_vocab_size=64, seq_length=8,
                         position_embedding_type="rotary", yarn_rotary_scaling_factor=1.0)
    assert rotary_scaling(config) is None
    assert rotary_scaling(dataclasses.replace(config, yarn_rotary_scaling_factor=2.0)) == Yarn(2.0)
