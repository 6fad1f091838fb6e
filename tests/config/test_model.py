"""ModelConfig.validate: the architecture's rules, with the tensor-parallel size it is split over."""

import pytest

from megatron.config import ModelConfig
from tests.helpers.config import tiny_model


def test_the_tiny_model_is_valid_and_derives_its_sizes():
    m = tiny_model().validate(tensor_model_parallel_size=4)
    assert (m.ffn_size, m.max_positions, m.head_dim) == (256, 32, 16)
    assert tiny_model(ffn_hidden_size=96, max_position_embeddings=64).validate(2).ffn_size == 96


@pytest.mark.parametrize("overrides,tp,words", [
    (dict(), 8, "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"),
    (dict(hidden_size=66), 1, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
    (dict(max_position_embeddings=16), 1, "--seq-length 32 is longer than --max-position-embeddings 16"),
    (dict(ffn_hidden_size=90), 4, "ffn hidden size 90 is not divisible by --tensor-model-parallel-size 4"),
    (dict(padded_vocab_size=130), 4, "padded vocabulary size 130 is not divisible by --tensor-model-parallel-size 4"),
    (dict(num_layers=0), 1, "--num-layers must be a positive integer, got 0"),
    (dict(position_embedding_type="learned"), 1, "--position-embedding-type 'learned' is not one of"),
    (dict(hidden_size=12, num_attention_heads=4, position_embedding_type="rotary"), 1,
     "rotary positions need an even head dimension, got 3"),
    (dict(kv_channels=0), 1, "--kv-channels must be a positive integer, got 0"),
    (dict(kv_channels=7, position_embedding_type="rotary"), 1,
     "rotary positions need an even head dimension, got 7 (--kv-channels)"),
    (dict(params_dtype="fp8"), 1, "params_dtype 'fp8' is not one of fp32, bf16, fp16"),
    (dict(hidden_dropout=1.0), 1, "--hidden-dropout must be in [0, 1), got 1.0"),
    (dict(original_vocab_size=129), 1, "original vocabulary size 129 is larger than the padded size 128"),
])
def test_impossible_models_are_rejected(overrides, tp, words):
    with pytest.raises(ValueError) as info:
        tiny_model(**overrides).validate(tp)
    assert words in str(info.value)


def test_kv_channels_is_the_head_size_whatever_the_hidden_size():
    """--kv-channels (Megatron-LM's head size): heads x kv_channels need not be the hidden size, nor hidden a multiple
    of the heads; None is hidden / heads."""
    assert (tiny_model().head_dim, tiny_model().query_hidden_size) == (16, 64)
    m = tiny_model(kv_channels=32, position_embedding_type="rotary").validate(4)
    assert (m.head_dim, m.query_hidden_size, m.hidden_size) == (32, 128, 64)
    assert tiny_model(hidden_size=66, kv_channels=16).validate().query_hidden_size == 64
    # Megatron's FLOPs: the query and output projections and the attention are heads x kv_channels wide
    one = ModelConfig(num_layers=1, hidden_size=6, num_attention_heads=1, padded_vocab_size=96, seq_length=36,
                      kv_channels=12)
    # c B s (L (2 (h (q + 2 kv) + q h + 2 f h) + 4 s q) + 1.5 V h), q = kv = 12, f = 24; exact in float64
    assert one.flops_per_iteration(1, recompute=False) == \
        3 * 36 * (2 * (6 * 36 + 12 * 6 + 2 * 24 * 6) + 4 * 36 * 12 + 1.5 * 96 * 6)


def test_positions_beyond_the_sequence_need_learned_positions_only():
    # alibi and rotary have no learned positions: a shorter max_position_embeddings is not checked
    assert tiny_model(position_embedding_type="alibi", max_position_embeddings=16).validate()
    assert tiny_model(position_embedding_type="rotary", max_position_embeddings=16).validate()


def test_flops_per_iteration_reads_the_padded_vocabulary():
    m = ModelConfig(num_layers=1, hidden_size=6, num_attention_heads=1, padded_vocab_size=96, seq_length=36)
    # 24 c B s L h^2 (1 + s / (6h) + V / (16 L h)) = 24 * 3 * 1 * 36 * 36 * (1 + 1 + 1)
    # Exact: integer products and sums (and 1.5 times an even integer) far below 2^53 round nowhere in float64.
    assert m.flops_per_iteration(1, recompute=False) == 24 * 3 * 36 * 36 * 3
    assert m.flops_per_iteration(1, recompute=True) == 24 * 4 * 36 * 36 * 3
