"""Tiny models and checkpoints shared by the checkpoint and inference tests."""

import dataclasses

import torch

from megatron.config import ModelConfig

# Model kinds for tiny_model_config (by their positions), for tests that run every kind.
POSITIONS = {"alibi": {}, "absolute": dict(position_embedding_type="absolute", embed_layernorm=False,
                                           max_position_embeddings=64),
             "rotary": dict(position_embedding_type="rotary", embed_layernorm=False),
             # Llama-style: rotary, RMSNorm, SwiGLU, grouped-query attention, untied head, no biases
             "llama": dict(position_embedding_type="rotary", embed_layernorm=False, normalization="rmsnorm",
                           swiglu=True, num_key_value_heads=2, add_bias_linear=False,
                           untie_embeddings_and_output_weights=True),
             # rotary with YaRN (an original context of 8, 4x extended; the attention factor 0.1 ln 4 + 1)
             "yarn": dict(position_embedding_type="rotary", embed_layernorm=False, yarn_rotary_scaling_factor=4.0,
                          yarn_original_max_position_embeddings=8)}


def tokenizer_record(tiny_corpus: dict) -> dict:
    return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": tiny_corpus["vocab_file"],
            "merge_file": tiny_corpus["merge_file"], "tokenizer_model": None, "tokenizer_name_or_path": None}


def tiny_model_config(**overrides) -> ModelConfig:
    """A BLOOM-like 2-layer model on the tiny corpus's 400-token vocabulary, padded to 512."""
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=512, seq_length=32,
                  position_embedding_type="alibi", embed_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
                  original_vocab_size=400, seed=1234)
    fields.update(overrides)
    return ModelConfig(**fields).validate()


def random_state_dict(config: ModelConfig, seed: int = 0, scale: float = 0.3) -> dict:
    """GPTModel weights with every tensor perturbed (LayerNorms and biases too), so that misplacing
    one shows, and large enough that greedy continuations vary instead of repeating one token."""
    from megatron.model import GPTModel

    model = GPTModel(dataclasses.replace(config, init_method_std=scale / 3))
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        state[name] = tensor + scale * torch.randn(tensor.shape, generator=generator)
    return state


def write_random_checkpoint(out_dir, tiny_corpus, tp: int = 1, pp: int = 1, **config_overrides):
    """A training checkpoint of a random tiny model at (tp, pp); returns (config, full state dict)."""
    from megatron.checkpoint.run_state import converted_run_state
    from megatron.checkpoint.single_process import save_as_training_checkpoint

    config = tiny_model_config(**config_overrides)
    state = random_state_dict(config)
    record = converted_run_state(config, tp, pp, tokenizer=tokenizer_record(tiny_corpus))
    save_as_training_checkpoint(config, state, str(out_dir), tp, pp, run_state=record)
    return config, state
