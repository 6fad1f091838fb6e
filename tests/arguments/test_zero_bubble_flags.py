"""--enable-zbh1-pipeline / --enable-zbh1-exact-semantics: accepted where ZB-H1 runs, refused before launch
(naming the values and the fix) where it cannot."""

import pytest

from tests.helpers.arguments import parse

ZBH1 = dict(enable_zbh1_pipeline=True, enable_zbh1_exact_semantics=True)


def test_zbh1_flags_reach_the_parallel_config(files):
    rc = parse(files, world_size=4, pipeline_model_parallel_size=4, num_layers=4, **ZBH1)  # 8 / 2 = 4 micro-batches
    assert rc.parallel.enable_zbh1_pipeline and rc.parallel.enable_zbh1_exact_semantics
    assert parse(files, world_size=2, pipeline_model_parallel_size=2, bf16=True, **ZBH1).deepspeed_zero_stage == 1
    assert not parse(files, world_size=2, pipeline_model_parallel_size=2).parallel.enable_zbh1_pipeline
    # with context parallelism too (trained as one process: tests/training/test_document_masks.py)
    cp = parse(files, world_size=4, pipeline_model_parallel_size=2, context_parallel_size=2, **ZBH1)
    assert cp.parallel.enable_zbh1_pipeline and cp.parallel.context_parallel_size == 2


@pytest.mark.parametrize("world, flags, words", [
    (2, dict(pipeline_model_parallel_size=2, enable_zbh1_pipeline=True), "Add --enable-zbh1-exact-semantics"),
    (2, dict(pipeline_model_parallel_size=2, enable_zbh1_exact_semantics=True), "has no effect without"),
    (8, dict(pipeline_model_parallel_size=8, num_layers=8, **ZBH1), "at least 8 micro-batches per step, got 4"),
    (4, dict(pipeline_model_parallel_size=2, global_batch_size=4, **ZBH1), "--global-batch-size"),
    (2, dict(zero_stage=2, **ZBH1), "model engine"),
    (2, dict(pipeline_model_parallel_size=2, zero_stage=1, **ZBH1), "--zero-stage 0"),
    (2, dict(pipeline_model_parallel_size=2, torch_compile=True, **ZBH1), "--torch-compile"),
])
def test_layouts_zbh1_cannot_run_are_refused(files, world, flags, words):
    with pytest.raises(ValueError, match=words):
        parse(files, world_size=world, **flags)
