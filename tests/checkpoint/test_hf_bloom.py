"""Our model holding transformers' Bloom weights computes Bloom's logits; the mapping round-trips."""

import dataclasses

import pytest
import torch

from megatron.checkpoint.hf.bloom import (
    bloom_config_kwargs,
    bloom_state_dict_to_ours,
    model_config_from_bloom,
    ours_to_bloom_state_dict,
)
from megatron.model import GPTModel
from megatron.testing.tolerance import model_tolerance


def _random_bloom(num_heads: int, hidden_size: int, seed: int = 0):
    from transformers import BloomConfig, BloomForCausalLM

    bloom_config = BloomConfig(vocab_size=256, hidden_size=hidden_size, n_layer=2, n_head=num_heads,
                               hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(seed)
    bloom = BloomForCausalLM(bloom_config).eval()
    # Bloom initializes LayerNorms to (1, 0) and biases to 0: perturb everything so that a
    # misplaced LayerNorm or bias would show in the logits.
    with torch.no_grad():
        for param in bloom.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return bloom_config, bloom


@pytest.mark.parametrize("num_heads,hidden_size", [(4, 64), (6, 48)])
def test_logits_match_transformers_bloom(num_heads, hidden_size):
    bloom_config, bloom = _random_bloom(num_heads, hidden_size)
    config = model_config_from_bloom(bloom_config, seq_length=24, padded_vocab_size=256)
    model = GPTModel(config).eval()
    model.load_state_dict(bloom_state_dict_to_ours(bloom.state_dict(), config))
    input_ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = bloom(input_ids).logits  # [b, s, v]
        logits = model(input_ids).transpose(0, 1)  # [b, s, v]
    assert logits.shape == expected.shape == (3, 24, 256)
    max_diff = (logits - expected).abs().max().item()
    tolerance = model_tolerance(config, torch.float32, expected)
    assert max_diff <= tolerance, f"max |ours - Bloom| = {max_diff:.3g} (logits up to {expected.abs().max():.3g})"


def test_state_dict_round_trip_and_vocab_padding():
    bloom_config, bloom = _random_bloom(4, 64)
    config = model_config_from_bloom(bloom_config, seq_length=16, padded_vocab_size=320, original_vocab_size=256)
    ours = bloom_state_dict_to_ours(bloom.state_dict(), config)
    model = GPTModel(config)
    model.load_state_dict(ours)  # strict: every name and shape matches
    words = model.embedding.word_embeddings.weight
    assert words.shape == (320, 64) and words[256:].abs().max().item() == 0.0
    back = ours_to_bloom_state_dict(model.state_dict(), config, vocab_size=256)
    original = bloom.state_dict()
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_config_round_trip():
    from transformers import BloomConfig

    bloom_config, _ = _random_bloom(4, 64)
    config = model_config_from_bloom(bloom_config, seq_length=16)
    again = BloomConfig(**bloom_config_kwargs(config))
    for field in ("vocab_size", "hidden_size", "n_layer", "n_head", "layer_norm_epsilon"):
        assert getattr(again, field) == getattr(bloom_config, field), field


def test_mapping_rejects_what_bloom_cannot_hold():
    bloom_config, bloom = _random_bloom(4, 64)
    config = model_config_from_bloom(bloom_config, seq_length=16)
    state = bloom.state_dict()
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        bloom_state_dict_to_ours(state, config)
    absolute = GPTModel(dataclasses.replace(config, position_embedding_type="absolute"))
    with pytest.raises(ValueError, match="no learned positions"):
        ours_to_bloom_state_dict(absolute.state_dict(), absolute.config)
    with pytest.raises(ValueError, match="config num_layers 3"):
        bloom_state_dict_to_ours(bloom.state_dict(), dataclasses.replace(config, num_layers=3))
