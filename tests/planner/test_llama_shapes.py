"""The planner's parameter, FLOPs and activation counts for Llama-style shapes (SwiGLU, GQA, RMSNorm, no
biases, untied head): by hand for Llama-2-7B and Llama-3-70B, and against the modules themselves."""

import pytest
import torch

from megatron.config import ModelConfig
from megatron.config.model import megatron_flops
from megatron.model import GPTModel
from megatron.model.layout import parameter_layout
from megatron.planner import LLAMA_SIZES, ModelShape, model_shape_of
from megatron.planner.candidate import Layout
from megatron.planner.memory import layer_activation_bytes, stage_param_counts
from megatron.testing.tolerance import tolerance

# The planner's formulas and the ones written out here are both Python float64 arithmetic of a dozen or so
# operations, in other orders: within 16 roundings in sequence of float64, nothing summed wider
# (megatron.testing.tolerance), relative. Python's float arithmetic is the same on every CPU.
F64 = tolerance(torch.float64, 16, 1)


def test_llama_2_7b_has_6_74_billion_parameters():
    h, f, v, layers = 4096, 11008, 32000, 32
    attention = 4 * h * h                # q, k, v, o: 32 key / value heads, all h wide
    mlp = 3 * h * f                      # gate, up, down
    by_hand = 2 * v * h + layers * (attention + mlp + 2 * h) + h   # untied embedding + head, 2 RMSNorms, final norm
    assert by_hand == 6_738_415_616
    assert LLAMA_SIZES["llama-2-7b"].total_params() == by_hand


def test_llama_3_70b_has_70_6_billion_parameters():
    h, f, v, layers, kv = 8192, 28672, 128256, 80, 8 * 128   # 8 key / value heads of 128
    attention = 2 * h * h + 2 * h * kv   # q and o h x h; k and v h x 1024
    by_hand = 2 * v * h + layers * (attention + 3 * h * f + 2 * h) + h
    assert by_hand == 70_553_706_496
    assert LLAMA_SIZES["llama-3-70b"].total_params() == by_hand


LLAMA_TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=256, seq_length=16,
                  normalization="rmsnorm", swiglu=True, num_key_value_heads=2, add_bias_linear=False,
                  position_embedding_type="rotary", untie_embeddings_and_output_weights=True, ffn_hidden_size=96)


@pytest.mark.parametrize("overrides", [dict(), dict(add_bias_linear=True), dict(add_qkv_bias=True),
                                       dict(num_key_value_heads=1, untie_embeddings_and_output_weights=False),
                                       dict(normalization="layernorm", swiglu=False, num_key_value_heads=None,
                                            add_bias_linear=True, untie_embeddings_and_output_weights=False,
                                            embed_layernorm=True, position_embedding_type="alibi"),
                                       dict(kv_channels=32, qk_layernorm=True), dict(kv_channels=8, add_bias_linear=True),
                                       dict(kv_channels=24, qk_layernorm=True, normalization="layernorm")])
def test_the_shape_counts_what_the_model_builds(overrides):
    config = ModelConfig(**{**LLAMA_TINY, **overrides}).validate()
    shape = model_shape_of(config)
    assert shape.total_params() == sum(p.numel() for p in GPTModel(config).parameters())
    layer = sum(p.numel() for n, p in GPTModel(config).named_parameters() if n.startswith("layers.0."))
    assert shape.layer_params() == layer
    # One TP=2 rank holds half of every split tensor and all of every replicated one (the layout's tags).
    split = sum(GPTModel(config).get_parameter(n).numel() for n, e in parameter_layout(config).items()
                if n.startswith("layers.0.") and not e.replicated)
    assert shape.layer_params(2) == split // 2 + (layer - split)


def test_kv_channels_sets_the_query_key_value_and_output_widths():
    """Qwen3-235B-A22B's attention: hidden 4096, 64 query heads and 4 key / value heads of 128 (--kv-channels 128,
    not 4096 / 64 = 64): QKV [(64 + 2 x 4) x 128, h], the output projection [h, 64 x 128], twice as wide as h."""
    h, heads, kv, hn, f = 4096, 64, 4, 128, 1536
    shape = ModelShape(94, h, heads, 151936, f, embed_layernorm=False, tied_embeddings=False,
                       num_key_value_heads=kv, kv_channels=hn, swiglu=True, add_bias_linear=False,
                       normalization="rmsnorm")
    qkv, dense = (heads + 2 * kv) * hn * h, h * heads * hn
    assert (shape.q_hidden, shape.kv_hidden) == (8192, 512)
    assert shape.layer_params() == qkv + dense + 3 * f * h + 2 * h
    assert shape.layer_params(8) == (qkv + dense + 3 * f * h) // 8 + 2 * h
    s, b, L, V = 4096, 8, 94, 151936
    by_hand = 3 * b * s * (L * (2 * (qkv + dense + 3 * f * h) + 4 * s * heads * hn) + 1.5 * V * h)
    assert shape.flops_per_iteration(s, b, recompute=False) == pytest.approx(by_hand, rel=F64, abs=0)
    without = ModelShape(94, h, heads, 151936, f, embed_layernorm=False, tied_embeddings=False,
                         num_key_value_heads=kv, swiglu=True, add_bias_linear=False, normalization="rmsnorm")
    assert shape.layer_params() - without.layer_params() == (heads + 2 * kv) * 64 * h + h * heads * 64


def test_stage_counts_put_the_untied_head_on_the_last_stage():
    shape = model_shape_of(ModelConfig(**LLAMA_TINY).validate())
    first, last = stage_param_counts(shape, Layout(tp=1, pp=2, dp=1, micro_batch_size=1))
    assert first == 256 * 64 + shape.layer_params()             # embedding (no norm) + layer 0
    assert last == shape.layer_params() + 64 + 256 * 64         # layer 1 + final RMSNorm + output head
    assert first + last == shape.total_params()


def test_stage_counts_put_only_the_word_embedding_on_a_tied_last_stage():
    """BLOOM's tied head on the last stage is LMHeadPipe: the word embedding alone, no embedding LayerNorm."""
    config = ModelConfig(**{**LLAMA_TINY, "normalization": "layernorm", "swiglu": False, "num_key_value_heads": None,
                            "add_bias_linear": True, "untie_embeddings_and_output_weights": False,
                            "embed_layernorm": True, "position_embedding_type": "alibi", "ffn_hidden_size": None}
                         ).validate()
    shape = model_shape_of(config)
    first, last = stage_param_counts(shape, Layout(tp=1, pp=2, dp=1, micro_batch_size=1))
    assert first + last == shape.total_params() + 256 * 64  # the tied copy, and nothing else, counted twice


def test_flops_count_swiglu_and_gqa():
    s, b = 4096, 1024
    llama = LLAMA_SIZES["llama-3-70b"]
    h, f, kv, L, V = 8192, 28672, 1024, 80, 128256
    by_hand = 3 * b * s * (L * (2 * (h * (h + 2 * kv) + h * h + 3 * f * h) + 4 * s * h) + 1.5 * V * h)
    assert llama.flops_per_iteration(s, b, recompute=False) == by_hand  # exact: megatron_flops' expression, in its order
    # ~ 6 N per token plus attention: the dense weights dominate
    dense_params = llama.total_params() - 2 * V * h
    # (a modelling bound, not a rounding one: the norms' weights are parameters but no products' FLOPs)
    assert by_hand / (3 * b * s) == pytest.approx(2 * dense_params + L * 4 * s * h + 1.5 * V * h, rel=1e-4)
    # The GPT defaults keep Megatron's formula: 24 c B s L h^2 (1 + s / 6h + V / 16 L h)
    gpt = megatron_flops(24, 1024, 50304, 2048, 512, True)
    assert gpt == pytest.approx(24 * 4 * 512 * 2048 * 24 * 1024 ** 2 * (1 + 2048 / 6144 + 50304 / (16 * 24 * 1024)),
                                rel=F64, abs=0)
    config = ModelConfig(**LLAMA_TINY).validate()
    # exact: megatron_flops of the same numbers
    assert config.flops_per_iteration(8, recompute=False) == \
        model_shape_of(config).flops_per_iteration(16, 8, recompute=False)


def test_activations_count_gqa_and_swiglu():
    layout = Layout(tp=2, pp=1, dp=1, micro_batch_size=1)
    s, h, a = 2048, 4096, 32
    gpt = ModelShape(32, h, a, 32000)
    assert layer_activation_bytes(gpt, layout, s) == pytest.approx(s * h * (10 + 24 / 2 + 5 * a * s / (h * 2)), rel=F64, abs=0)
    llama = ModelShape(32, h, a, 32000, ffn_hidden_size=11008, swiglu=True, num_key_value_heads=8)
    # q and context 4, k and v 4 x 1/4, SwiGLU 2 x 16 x f / 4h
    tp_region = 4 + 1 + 32 * 11008 / (4 * h)
    assert layer_activation_bytes(llama, layout, s) == pytest.approx(
        s * h * (10 + tp_region / 2 + 5 * a * s / (h * 2)), rel=F64, abs=0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mtp_depths_are_counted_as_built_and_on_the_last_stage(tied):
    """--mtp-num-layers 2: the shape counts what GPTModel builds (each depth's layer, projection and three norms),
    the last stage holds the depths and a copy of the word embedding (beside an untied head too), and the FLOPs
    count each depth's layer, projection and logits (Megatron-LM's num_floating_point_operations)."""
    config = ModelConfig(**{**LLAMA_TINY, "mtp_num_layers": 2, "untie_embeddings_and_output_weights": not tied}
                         ).validate()
    plain = ModelConfig(**{**LLAMA_TINY, "untie_embeddings_and_output_weights": not tied}).validate()
    shape, plain_shape = model_shape_of(config), model_shape_of(plain)
    built = sum(p.numel() for p in GPTModel(config).parameters())
    assert shape.total_params() == built
    mtp = sum(p.numel() for n, p in GPTModel(config).named_parameters() if n.startswith("mtp."))
    assert shape.mtp_params() == mtp == built - plain_shape.total_params()
    first, last = stage_param_counts(shape, Layout(tp=1, pp=2, dp=1, micro_batch_size=1))
    plain_first, plain_last = stage_param_counts(plain_shape, Layout(tp=1, pp=2, dp=1, micro_batch_size=1))
    V, h = 256, 64
    assert first == plain_first and last == plain_last + mtp + (0 if tied else V * h)
    s, b, L = 16, 8, 2
    q, kv, f = 64, 2 * 16, 96
    layer = h * (q + 2 * kv) + q * h + 3 * f * h
    by_hand = 3 * b * s * ((L + 2) * (2 * layer + 4 * s * q) + 2 * 2 * (2 * h * h + 3 * h) + 1.5 * V * h * 3)
    assert shape.flops_per_iteration(s, b, recompute=False) == pytest.approx(by_hand, rel=F64, abs=0)
    assert config.flops_per_iteration(b, recompute=False) == shape.flops_per_iteration(s, b, recompute=False)
