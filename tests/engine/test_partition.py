"""stage_bounds: the stages of --dry-run are the ones DeepSpeed's own PipelineModule._partition_layers
picks for our layer specs (run here on a stand-in module: the method reads only the spec list), for
every --pp-partition-method."""

import pytest

from megatron.config import PARTITION_METHODS, ModelConfig
from megatron.engine.partition import stage_bounds
from megatron.engine.pipeline import layer_specs
from megatron.parallel.state import ParallelState
from tests.helpers.engine import DeepSpeedPartition


def _config(num_layers, position_embedding_type):
    return ModelConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4, padded_vocab_size=96,
                       seq_length=16, position_embedding_type=position_embedding_type, embed_layernorm=True).validate()


@pytest.mark.parametrize("method", PARTITION_METHODS)
@pytest.mark.parametrize("num_layers, num_stages", [(7, 3), (6, 4), (2, 2), (13, 5)])
def test_stage_bounds_are_deepspeeds(method, num_layers, num_stages):
    config = _config(num_layers, "alibi")
    deepspeed = DeepSpeedPartition(layer_specs(config, ParallelState.single(), None), num_stages)
    deepspeed._partition_layers(method)
    counts = deepspeed._count_layer_params() if method == "parameters" else None
    assert stage_bounds(config, num_stages, method, counts) == [int(p) for p in deepspeed.parts]


def test_an_unknown_method_names_the_known_ones():
    with pytest.raises(ValueError, match="type:transformer, type:transformer\\|embedding, parameters, uniform"):
        stage_bounds(_config(4, "alibi"), 2, "profile")
