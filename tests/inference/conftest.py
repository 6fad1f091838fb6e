"""Fixtures for the inference tests: the tiny corpus's tokenizer and checkpoints of random tiny models."""

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig
from megatron.testing.corpus import make_tiny_corpus


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models on a shared 2-core machine: extra intra-op threads only contend (10x slower under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return make_tiny_corpus(str(tmp_path_factory.mktemp("inference_corpus")))


def tokenizer_record(corpus: dict) -> dict:
    return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": corpus["vocab_file"],
            "merge_file": corpus["merge_file"], "tokenizer_model": None, "tokenizer_name_or_path": None}


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


def write_random_checkpoint(out_dir, corpus, tp: int = 1, pp: int = 1, **config_overrides):
    """A training checkpoint of a random tiny model at (tp, pp); returns (config, full state dict)."""
    from megatron.inference.checkpoint import converted_run_state, save_as_training_checkpoint

    config = tiny_model_config(**config_overrides)
    state = random_state_dict(config)
    record = converted_run_state(config, tp, pp, tokenizer=tokenizer_record(corpus))
    save_as_training_checkpoint(config, state, str(out_dir), tp, pp, run_state=record)
    return config, state
