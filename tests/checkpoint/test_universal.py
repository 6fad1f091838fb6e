"""The universal-checkpoint info: its pattern lists, made from the layout, match exactly the
parameters the modules' tags say, under the names a pipeline module gives them."""

import re

import pytest

from megatron.model import GPTModel
from tests.helpers.model import POSITION_TYPES, tiny_config

pytest.importorskip("deepspeed")
from deepspeed.checkpoint import constants as C  # noqa: E402

from megatron.checkpoint.universal.patterns import universal_checkpoint_info  # noqa: E402


def _matches(name, patterns):
    return any(re.match(p, name) for p in patterns)


@pytest.mark.parametrize("position_type", POSITION_TYPES)
def test_patterns_agree_with_tensor_parallel_tags(position_type):
    config = tiny_config(num_layers=3, position_embedding_type=position_type, embed_layernorm=True)
    model = GPTModel(config)
    info = universal_checkpoint_info(config)
    # The names a pipeline module gives the parameters, written out by hand: layer index first, the
    # tied embedding under tied_modules, the final LayerNorm bare under its index.
    named = {f"{i + 3}.{n}": p for i, layer in enumerate(model.layers) for n, p in layer.named_parameters()}
    named.update({f"7.{n}": p for n, p in model.final_layernorm.named_parameters()})  # L + 4, BLOOM's index
    named.update({f"tied_modules.embed.{n}": p for n, p in model.embedding.named_parameters()})
    assert len(named) == len(list(model.parameters()))
    for name, param in named.items():
        sharded = getattr(param, "tensor_model_parallel", False)
        assert _matches(name, info[C.TP_REPLICATED_PARAMETER_PATTERNS]) == (not sharded), name
        assert _matches(name, info[C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS]) == (sharded and param.partition_dim == 1)
        words = param is model.embedding.word_embeddings.weight
        assert _matches(name, info[C.VOCABULARY_PARAMETER_PATTERNS]) == words, name
        assert _matches(name, info[C.PIPELINE_REPLICATED_PARAMETER_PATTERNS]) == words, name
    # DeepSpeed's converter refuses a pattern that matches nothing.
    for key in (C.TP_REPLICATED_PARAMETER_PATTERNS, C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                C.VOCABULARY_PARAMETER_PATTERNS):
        for pattern in info[key]:
            assert any(re.match(pattern, name) for name in named), pattern
    assert info[C.ORIGINAL_VOCAB_SIZE] == info[C.PADDED_VOCAB_SIZE] == config.padded_vocab_size
