"""megatron.model.layout against the modules themselves: names, TP splits, pipeline indices."""

import pytest

from megatron.model import GPTModel
from megatron.model.layout import (
    EMBEDDING,
    FINAL_NORM,
    HEAD,
    LEGACY_LAYOUT,
    PASS_THROUGH,
    TRANSFORMER,
    model_name,
    parameter_layout,
    pipeline_item,
    pipeline_items,
    pipeline_name,
)
from tests.helpers.model import POSITION_TYPES, tiny_config


@pytest.mark.parametrize("embed_layernorm", [False, True])
@pytest.mark.parametrize("position_type", POSITION_TYPES)
def test_layout_lists_every_parameter_with_the_models_own_tags(position_type, embed_layernorm):
    config = tiny_config(num_layers=3, position_embedding_type=position_type, embed_layernorm=embed_layernorm)
    model = GPTModel(config)
    layout = parameter_layout(config)
    params = dict(model.named_parameters())
    assert list(layout) == list(params)  # the same names, in named_parameters order
    for name, param in params.items():
        entry = layout[name]
        split = getattr(param, "tensor_model_parallel", False)
        assert entry.partition_dim == (param.partition_dim if split else None), name
        assert entry.vocab_parallel == (param is model.embedding.word_embeddings.weight), name
        assert entry.tied_to_head == entry.vocab_parallel, name
    # Row-parallel weights are exactly the two output projections of each layer.
    rows = sorted(n for n, e in layout.items() if e.partition_dim == 1)
    assert rows == sorted(f"layers.{i}.{m}.weight" for i in range(3) for m in ("self_attention.dense", "mlp.dense_4h_to_h"))


def test_pipeline_items_follow_blooms_numbering():
    """bigscience's GPTModelPipe: 0 fp16 cast, 1 embedding, 2 transpose, 3..L+2 blocks, L+3 transpose,
    L+4 final LayerNorm, L+5 tied head (the file numbers transformers' BLOOM converter expects)."""
    config = tiny_config(num_layers=3, embed_layernorm=True)
    items = pipeline_items(config)
    assert [i.kind for i in items] == [PASS_THROUGH, EMBEDDING, PASS_THROUGH, TRANSFORMER, TRANSFORMER, TRANSFORMER,
                                       PASS_THROUGH, FINAL_NORM, HEAD]
    assert [i.index for i in items] == list(range(9))
    assert [i.layer_number for i in items if i.kind == TRANSFORMER] == [0, 1, 2]
    layout = parameter_layout(config)
    assert layout["layers.2.mlp.dense_h_to_4h.weight"].pipeline_index == 5
    assert layout["final_layernorm.bias"].pipeline_index == 7 and layout["final_layernorm.bias"].local_name == "bias"
    assert layout["embedding.embed_layernorm.weight"].file_key == "word_embeddings.norm.weight"  # BLOOM's key
    assert layout["layers.0.input_layernorm.weight"].file_key == "input_layernorm.weight"
    for name, entry in layout.items():
        assert model_name(pipeline_name(entry), config) == name
    assert model_name("tied_modules.embed.word_embeddings.norm.bias", config) == "embedding.embed_layernorm.bias"
    assert pipeline_name(layout["embedding.word_embeddings.weight"]) == "tied_modules.embed.word_embeddings.weight"
    assert pipeline_name(layout["final_layernorm.weight"]) == "7.weight"
    with pytest.raises(ValueError, match="pipeline layer index 9 does not exist"):
        pipeline_item(9, config)
    with pytest.raises(ValueError, match="pipeline layer 8 \\(head\\) owns no parameters"):
        model_name("8.word_embeddings.weight", config)
    with pytest.raises(ValueError, match="pipeline layer 2 \\(pass_through\\) owns no parameters"):
        model_name("2.weight", config)


def test_the_legacy_numbering_is_still_described():
    config = tiny_config(num_layers=3, embed_layernorm=True)
    legacy = parameter_layout(config, LEGACY_LAYOUT)
    assert legacy["embedding.word_embeddings.weight"].pipeline_index == 0
    assert legacy["layers.2.mlp.dense_h_to_4h.weight"].pipeline_index == 3
    assert legacy["final_layernorm.weight"].pipeline_index == 4
    assert legacy["embedding.embed_layernorm.weight"].file_key == "embed_layernorm.weight"
    assert [i.kind for i in pipeline_items(config, LEGACY_LAYOUT)] == [EMBEDDING] + [TRANSFORMER] * 3 + [FINAL_NORM, HEAD]
    with pytest.raises(ValueError, match="checkpoint layout 'v9' is not one of"):
        pipeline_items(config, "v9")


def test_layout_of_a_large_model_is_cheap_and_complete():
    # BLOOM-176B's shape: the layout never builds the real modules.
    config = tiny_config(num_layers=70, hidden_size=14336, num_attention_heads=112, padded_vocab_size=250880,
                         seq_length=2048, position_embedding_type="alibi", embed_layernorm=True)
    layout = parameter_layout(config)
    assert len(layout) == 3 + 70 * 12 + 2
    assert layout["layers.69.self_attention.query_key_value.weight"].pipeline_index == 72
