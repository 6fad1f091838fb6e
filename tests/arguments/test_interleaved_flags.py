"""Megatron-LM's interleaved-pipeline flags: either spelling gives the virtual stages; layouts the schedule
cannot run are refused before any process starts, naming the fix."""

import pytest

from tests.helpers.arguments import parse

PP2 = dict(pipeline_model_parallel_size=2, num_layers=4)


def test_both_spellings_give_the_virtual_stages(files):
    assert parse(files, **PP2).parallel.num_virtual_stages_per_pipeline_rank == 1
    assert parse(files, **PP2, num_virtual_stages_per_pipeline_rank=2).parallel.num_virtual_stages_per_pipeline_rank == 2
    assert parse(files, **PP2, num_layers_per_virtual_pipeline_stage=1).parallel.num_virtual_stages_per_pipeline_rank == 2
    assert parse(files, **PP2, num_virtual_stages_per_pipeline_rank=2, num_experts=4).model.moe.num_experts == 4
    # with context parallelism too (trained as one process: tests/training/test_document_masks.py)
    cp = parse(files, **dict(PP2, world_size=4), num_virtual_stages_per_pipeline_rank=2, context_parallel_size=2)
    assert (cp.parallel.num_virtual_stages_per_pipeline_rank, cp.parallel.context_parallel_size) == (2, 2)


@pytest.mark.parametrize("overrides,message", [
    (dict(num_layers=6, num_virtual_stages_per_pipeline_rank=2), "--num-layers 6 does not divide into"),
    (dict(num_layers_per_virtual_pipeline_stage=3), "--num-layers-per-virtual-pipeline-stage 3 does not divide"),
    (dict(num_virtual_stages_per_pipeline_rank=4, num_layers_per_virtual_pipeline_stage=1), "disagree"),
    (dict(num_virtual_stages_per_pipeline_rank=2, global_batch_size=6), "make it a multiple of 2"),
    (dict(num_virtual_stages_per_pipeline_rank=2, pp_partition_method="uniform"), "type:transformer"),
    (dict(num_virtual_stages_per_pipeline_rank=2, pipeline_model_parallel_size=1), "no bubble to fill"),
    (dict(num_virtual_stages_per_pipeline_rank=2, zero_stage=2), "--zero-stage 2 does not combine with --pipeline"),
    (dict(num_virtual_stages_per_pipeline_rank=2, enable_zbh1_pipeline=True, enable_zbh1_exact_semantics=True),
     "does not support --enable-zbh1-pipeline"),
    (dict(num_virtual_stages_per_pipeline_rank=2, train_iters=None, train_samples=800, rampup_batch_size=[4, 4, 64]),
     "does not support --rampup-batch-size"),
])
def test_layouts_refused_with_the_fix(files, overrides, message):
    with pytest.raises(ValueError, match=message):
        parse(files, **dict(PP2, **overrides))
