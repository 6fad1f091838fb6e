"""Llama-style blocks (RMSNorm, SwiGLU, grouped-query attention, no biases, untied head) against
independent references: a plain-torch block written here, and transformers' LlamaForCausalLM.

The reference reads our fused tensors by their documented layouts (QKV rows [kv, heads/kv + 2, hn],
SwiGLU rows [f, 2] = (gate, up)); the renaming to transformers' names here is test-local, so a wrong
layout in the model or in megatron.checkpoint.hf.llama cannot hide behind the other.
"""

import math

import pytest
import torch

from megatron.model import GPTModel, TransformerLayer
from megatron.model.layout import EMBEDDING, HEAD, model_name, parameter_layout, pipeline_items, pipeline_name
from megatron.testing.tolerance import OPS_PER_LAYER, model_tolerance, tolerance
from tests.helpers.model import tiny_config


def llama(**overrides):
    fields = dict(normalization="rmsnorm", swiglu=True, num_key_value_heads=2, add_bias_linear=False,
                  position_embedding_type="rotary", untie_embeddings_and_output_weights=True, ffn_hidden_size=96,
                  layernorm_epsilon=1e-6, rotary_base=500000.0)
    fields.update(overrides)
    return tiny_config(**fields)


def _perturbed(module, seed=1):
    # Norm weights start at 1 and biases at 0: perturb all so that a misplaced one shows.
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return module.eval()


def _split_qkv(w, config):
    kv, hn = config.num_kv_heads, config.head_dim
    grouped = w.reshape(kv, config.num_attention_heads // kv + 2, hn, *w.shape[1:])
    return (grouped[:, :-2].reshape(-1, *w.shape[1:]), grouped[:, -2].reshape(-1, *w.shape[1:]),
            grouped[:, -1].reshape(-1, *w.shape[1:]))


def _reference_block(x, p, config):
    """A Llama block from its definition, [s, b, h] -> [s, b, h], from our parameters ``p`` (by name)."""
    s, b, h = x.shape
    heads, kv, hn, eps = config.num_attention_heads, config.num_kv_heads, config.head_dim, config.layernorm_epsilon

    def rms(y, w):
        return y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + eps) * w

    def linear(y, name):
        return y @ p[name + ".weight"].T + (p[name + ".bias"] if name + ".bias" in p else 0)

    y = rms(x, p["input_layernorm.weight"])
    wq, wk, wv = _split_qkv(p["self_attention.query_key_value.weight"], config)
    q, k, v = y @ wq.T, y @ wk.T, y @ wv.T
    if "self_attention.query_key_value.bias" in p:
        bq, bk, bv = _split_qkv(p["self_attention.query_key_value.bias"], config)
        q, k, v = q + bq, k + bk, v + bv
    q, k, v = q.reshape(s, b, heads, hn), k.reshape(s, b, kv, hn), v.reshape(s, b, kv, hn)
    # rotary, half-split pairs (x[i], x[i + hn/2]) rotated by position * base^(-2i/hn)
    freqs = config.rotary_base ** (-torch.arange(0, hn, 2).float() / hn)
    angle = torch.arange(s).float()[:, None] * freqs[None]  # [s, hn/2]
    cos, sin = angle.cos()[:, None, None], angle.sin()[:, None, None]

    def rotate(t):
        a, c = t[..., :hn // 2], t[..., hn // 2:]
        return torch.cat((a * cos - c * sin, c * cos + a * sin), dim=-1)

    q, k = rotate(q), rotate(k)
    group = torch.arange(heads) // (heads // kv)  # the key / value head of each query head
    k, v = k[:, :, group], v[:, :, group]  # [s, b, heads, hn]
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(hn)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, h)
    x = x + linear(context, "self_attention.dense")
    y = rms(x, p["post_attention_layernorm.weight"])
    fc1 = linear(y, "mlp.dense_h_to_4h").reshape(s, b, -1, 2)
    return x + linear(torch.nn.functional.silu(fc1[..., 0]) * fc1[..., 1], "mlp.dense_4h_to_h")


@pytest.mark.parametrize("overrides", [dict(num_key_value_heads=4), dict(num_key_value_heads=2),
                                       dict(num_key_value_heads=1), dict(add_bias_linear=True),
                                       dict(add_qkv_bias=True, num_key_value_heads=1)])
def test_block_matches_a_plain_torch_llama_block(overrides):
    config = llama(**overrides)
    layer = _perturbed(TransformerLayer(config, layer_number=0))
    params = {n: t.detach() for n, t in layer.named_parameters()}
    expected_biases = {"self_attention.query_key_value.bias"} if config.qkv_bias else set()
    if config.add_bias_linear:
        expected_biases |= {"self_attention.dense.bias", "mlp.dense_h_to_4h.bias", "mlp.dense_4h_to_h.bias"}
    assert {n for n in params if n.endswith("bias")} == expected_biases
    assert params["self_attention.query_key_value.weight"].shape == ((4 + 2 * config.num_kv_heads) * 16, 64)
    x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = _reference_block(x, params, config)
        diff = (layer(x) - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert diff <= tolerance(torch.float32, OPS_PER_LAYER, config.ffn_hidden_size, scale), diff


def _to_transformers(state, config):
    """Our state dict -> LlamaForCausalLM names, from the documented layouts (test-local)."""
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["final_layernorm.weight"],
           "lm_head.weight": state.get("output_layer.weight", state["embedding.word_embeddings.weight"])}
    for i in range(config.num_layers):
        p, t = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = _split_qkv(state[p + "self_attention.query_key_value.weight"], config)
        fc1 = state[p + "mlp.dense_h_to_4h.weight"].reshape(-1, 2, config.hidden_size)
        out.update({t + "self_attn.q_proj.weight": q, t + "self_attn.k_proj.weight": k,
                    t + "self_attn.v_proj.weight": v, t + "self_attn.o_proj.weight": state[p + "self_attention.dense.weight"],
                    t + "mlp.gate_proj.weight": fc1[:, 0], t + "mlp.up_proj.weight": fc1[:, 1],
                    t + "mlp.down_proj.weight": state[p + "mlp.dense_4h_to_h.weight"],
                    t + "input_layernorm.weight": state[p + "input_layernorm.weight"],
                    t + "post_attention_layernorm.weight": state[p + "post_attention_layernorm.weight"]})
    return out


@pytest.mark.parametrize("kv_heads,untied", [(2, True), (1, False), (4, True)])
def test_model_matches_transformers_llama(kv_heads, untied):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = llama(num_key_value_heads=kv_heads, untie_embeddings_and_output_weights=untied)
    ours = _perturbed(GPTModel(config))
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, rms_norm_eps=1e-6, rope_theta=500000.0, max_position_embeddings=16,
        tie_word_embeddings=not untied, attention_bias=False, mlp_bias=False)).eval()
    missing, unexpected = hf.load_state_dict(_to_transformers(ours.state_dict(), config), strict=False)
    assert not unexpected and all("rotary" in n for n in missing), (missing, unexpected)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(ids).logits  # [b, s, v]
        diff = (ours(ids).transpose(0, 1) - expected).abs().max().item()
    assert diff <= model_tolerance(config, torch.float32, expected), diff


def test_layout_knows_the_untied_head_and_the_grouped_qkv():
    config = llama(num_layers=3)
    layout = parameter_layout(config)
    assert list(layout) == [n for n, _ in GPTModel(config).named_parameters()]
    assert not any(n.endswith(".bias") for n in layout)
    head, words = layout["output_layer.weight"], layout["embedding.word_embeddings.weight"]
    assert (head.pipeline_index, head.partition_dim, head.vocab_parallel, head.tied_to_head) == (8, 0, True, False)
    assert (words.tied_to_head, words.in_tied_module) == (False, False)
    assert pipeline_name(words) == "1.word_embeddings.weight" and pipeline_name(head) == "8.weight"
    for name, entry in layout.items():
        assert model_name(pipeline_name(entry), config) == name
    assert layout["layers.0.self_attention.query_key_value.weight"].partition_dim == 0
    assert layout["layers.0.input_layernorm.weight"].replicated
    items = pipeline_items(config)
    assert items[-1].kind == HEAD and items[-1].prefix == "output_layer." and items[1].kind == EMBEDDING
    tied = parameter_layout(llama(untie_embeddings_and_output_weights=False))
    assert "output_layer.weight" not in tied and tied["embedding.word_embeddings.weight"].tied_to_head
