"""Tiny model configurations shared by the model tests."""

from megatron.config import ModelConfig

POSITION_TYPES = ("absolute", "rotary", "alibi")


def tiny_config(**overrides) -> ModelConfig:
    """2 layers, hidden 64, 4 heads, vocab 256, seq 16, no dropout unless overridden."""
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=256,
                  seq_length=16, hidden_dropout=0.0, attention_dropout=0.0, seed=1234)
    fields.update(overrides)
    return ModelConfig(**fields).validate()
