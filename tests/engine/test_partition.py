"""The pipeline partition rule (megatron.parallel.pipeline_partition) is DeepSpeed's: the stages of --dry-run
(stage_bounds) and of the planner (layers_per_stage) are the ones DeepSpeed's own
PipelineModule._partition_layers picks for our layer specs (run here on a stand-in module: the method reads
only the spec list), for every --pp-partition-method."""

import random

import pytest
from deepspeed.runtime.utils import partition_balanced, partition_uniform

from megatron.config import PARTITION_METHODS, ModelConfig
from megatron.engine.partition import spec_class_name, stage_bounds
from megatron.engine.pipeline import layer_specs
from megatron.parallel import pipeline_partition
from megatron.parallel.state import ParallelState
from megatron.planner.candidate import layers_per_stage, pipeline_item_names, pipeline_item_params
from megatron.planner.specs import model_shape_of
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


@pytest.mark.parametrize("seed", range(6))
def test_the_pure_partition_functions_are_deepspeeds(seed):
    rng = random.Random(seed)
    for _ in range(20):
        n, parts = rng.randint(1, 14), rng.randint(1, 6)
        weights = [rng.choice([0, 1, 1, 3, 7, 100]) for _ in range(n)]
        assert pipeline_partition.partition_uniform(n, parts) == [int(p) for p in partition_uniform(n, parts)]
        theirs = [int(p) for p in partition_balanced(weights, parts)]
        assert pipeline_partition.partition_balanced(weights, parts) == theirs, weights


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("method", ["uniform", "parameters", "type:transformer"])
@pytest.mark.parametrize("num_layers, num_stages", [(7, 3), (6, 4), (2, 2), (13, 5), (4, 1)])
def test_the_planner_partitions_as_deepspeed(tied, method, num_layers, num_stages):
    """The planner's layers per stage, from its model shape alone, are those of DeepSpeed's own partitioning
    of the engine's layer specs (the 'parameters' counts: DeepSpeed builds every layer to count them)."""
    config = ModelConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4, padded_vocab_size=96,
                         seq_length=16, position_embedding_type="alibi", embed_layernorm=True,
                         untie_embeddings_and_output_weights=not tied).validate()
    specs = layer_specs(config, ParallelState.single(), None)
    shape = model_shape_of(config)
    assert pipeline_item_names(shape) == [spec_class_name(spec) for spec in specs]
    deepspeed = DeepSpeedPartition(specs, num_stages)
    deepspeed._partition_layers(method)
    if method == "parameters":
        assert pipeline_item_params(shape) == deepspeed._count_layer_params()
    parts = [int(p) for p in deepspeed.parts]
    expected = [sum(spec_class_name(s) == "TransformerLayer" for s in specs[a:b]) for a, b in zip(parts, parts[1:])]
    if min(expected) < 1:
        with pytest.raises(ValueError, match="cannot fill"):
            layers_per_stage(shape, num_stages, method)
    else:
        assert layers_per_stage(shape, num_stages, method) == expected
