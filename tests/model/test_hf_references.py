"""Rotary and learned positions against independent references: transformers' GPT-NeoX and GPT-2.

(ALiBi is checked against Bloom in test_hf_bloom.py.) The weight renaming here is test-local.
"""

import torch

from megatron.model import GPTModel
from megatron.testing.tolerance import model_tolerance
from tests.helpers.model import tiny_config


def _perturbed(model):
    # transformers initializes LayerNorms to (1, 0) and biases to 0: perturb all so misplacing one shows.
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def _max_logit_diff(ours, theirs, seq_length=16):
    """(the largest logit difference between transformers' model and ours, the derived fp32 tolerance for it)."""
    input_ids = torch.randint(0, 256, (2, seq_length), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(input_ids).logits  # [b, s, v]
        got = ours(input_ids).transpose(0, 1)  # [b, s, v]
    return (got - expected).abs().max().item(), model_tolerance(ours.config, torch.float32, expected)


def test_rotary_matches_transformers_gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    # GPT-NeoX's fused QKV is also per head [heads, 3, hn]; sequential residual, tanh GeLU, tied head.
    neox = _perturbed(GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        hidden_act="gelu_new", use_parallel_residual=False, tie_word_embeddings=True, attention_dropout=0.0,
        hidden_dropout=0.0, layer_norm_eps=1e-5, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0})))
    state = {}
    for name, tensor in neox.state_dict().items():
        if name == "lm_head.weight":
            continue
        name = name.replace("gpt_neox.embed_in", "embedding.word_embeddings")
        name = name.replace("gpt_neox.final_layer_norm", "final_layernorm").replace("gpt_neox.layers", "layers")
        state[name.replace(".attention.", ".self_attention.")] = tensor
    ours = GPTModel(tiny_config(position_embedding_type="rotary", rotary_base=10000.0)).eval()
    ours.load_state_dict(state)
    diff, tolerance = _max_logit_diff(ours, neox)
    assert diff <= tolerance, (diff, tolerance)


def _gpt2_block_state(block, prefix: str, heads: int = 4, hn: int = 16) -> dict:
    """One GPT-2 block's weights under our names (GPT-2's Conv1D stores [in, out])."""
    h = heads * hn
    # GPT-2's fused output columns are [q heads | k heads | v heads]; our rows are per head [heads, 3, hn].
    qkv_weight = block.attn.c_attn.weight.t().reshape(3, heads, hn, h).transpose(0, 1).reshape(3 * h, h)
    qkv_bias = block.attn.c_attn.bias.reshape(3, heads, hn).transpose(0, 1).reshape(3 * h)
    pairs = {
        "input_layernorm.weight": block.ln_1.weight, "input_layernorm.bias": block.ln_1.bias,
        "self_attention.query_key_value.weight": qkv_weight, "self_attention.query_key_value.bias": qkv_bias,
        "self_attention.dense.weight": block.attn.c_proj.weight.t(), "self_attention.dense.bias": block.attn.c_proj.bias,
        "post_attention_layernorm.weight": block.ln_2.weight, "post_attention_layernorm.bias": block.ln_2.bias,
        "mlp.dense_h_to_4h.weight": block.mlp.c_fc.weight.t(), "mlp.dense_h_to_4h.bias": block.mlp.c_fc.bias,
        "mlp.dense_4h_to_h.weight": block.mlp.c_proj.weight.t(), "mlp.dense_4h_to_h.bias": block.mlp.c_proj.bias,
    }
    return {prefix + name: tensor for name, tensor in pairs.items()}


def test_learned_positions_match_transformers_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = _perturbed(GPT2LMHeadModel(GPT2Config(
        vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, layer_norm_epsilon=1e-5, activation_function="gelu_new")))
    transformer = gpt2.transformer
    state = {"embedding.word_embeddings.weight": transformer.wte.weight,
             "embedding.position_embeddings.weight": transformer.wpe.weight,
             "final_layernorm.weight": transformer.ln_f.weight, "final_layernorm.bias": transformer.ln_f.bias}
    for i, block in enumerate(transformer.h):
        state.update(_gpt2_block_state(block, f"layers.{i}."))
    ours = GPTModel(tiny_config(position_embedding_type="absolute", max_position_embeddings=32)).eval()
    ours.load_state_dict(state)
    diff, tolerance = _max_logit_diff(ours, gpt2)
    assert diff <= tolerance, (diff, tolerance)
