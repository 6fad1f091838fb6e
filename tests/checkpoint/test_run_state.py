"""The run record says how its checkpoint was written: the saving engine and the files that hold the weights."""

import pytest

from megatron.arguments import run_config_from_argv
from megatron.checkpoint.run_state import WEIGHT_FILE_KINDS, build_run_state, reader_for, weight_files
from megatron.checkpoint.tags import CheckpointFormatError
from megatron.testing.tiny_corpus import tiny_argv

PROGRESS = {"iteration": 1, "consumed_samples": 8, "consumed_tokens": 256}


@pytest.mark.parametrize("world_size, flags, engine, files", [
    (8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, zero_stage=1), "pipeline", "layer_files"),
    (1, dict(zero_stage=0), "pipeline", "layer_files"),
    (2, dict(zero_stage=2), "model", "zero_partitions"),
    (4, dict(zero_stage=3, tensor_model_parallel_size=2), "model", "zero_partitions"),
    (2, dict(zero_stage=0, ds_sequence_parallel_size=2), "model", "module_states"),
    (2, dict(zero_stage=1, ds_sequence_parallel_size=2), "model", "module_states"),
])
def test_the_record_names_the_engine_and_the_weight_files(tiny_corpus, world_size, flags, engine, files):
    rc = run_config_from_argv(tiny_argv(tiny_corpus, **flags), world_size=world_size)
    record = build_run_state(rc, PROGRESS)
    assert (record["saving_engine"], record["weight_files"]) == (engine, files) == (rc.deepspeed_engine, files)
    assert files in WEIGHT_FILE_KINDS
    # A record written before these fields existed is read by the same rule.
    older = {k: v for k, v in record.items() if k not in ("saving_engine", "weight_files")}
    assert (reader_for(older), weight_files(older)) == (engine, files)


@pytest.mark.parametrize("record, regular, universal", [
    ({"saving_engine": "model", "universal_engine": "pipeline"}, "model", "pipeline"),
    ({"saving_engine": "pipeline"}, "pipeline", "pipeline"),  # converted before the target was recorded
    ({"parallel": {"zero_stage": 3}}, "model", "model"),  # saved before the engine was recorded
    ({"parallel": {"zero_stage": 1, "ds_sequence_parallel_size": 2}}, "model", "model"),
    ({"parallel": {"zero_stage": 1}}, "pipeline", "pipeline"),
])
def test_reader_for_a_regular_and_a_universal_checkpoint(record, regular, universal):
    assert (reader_for(record), reader_for(record, universal=True)) == (regular, universal)


def test_weight_files_of_another_version_are_refused_by_name():
    with pytest.raises(CheckpointFormatError, match="weight files 'torch_dcp'.*does not read"):
        weight_files({"saving_engine": "model", "weight_files": "torch_dcp"})


def test_a_checkpoint_of_another_head_size_is_refused_and_one_written_before_kv_channels_loads():
    import dataclasses

    from megatron.checkpoint.run_state import check_model_config
    from tests.helpers.config import tiny_model

    default, explicit, wider = (dataclasses.asdict(tiny_model(kv_channels=k)) for k in (None, 16, 32))
    check_model_config(default, explicit)  # None is hidden / heads = 16: the same model
    check_model_config(explicit, default)
    with pytest.raises(ValueError, match="kv_channels = 32 but this run has None"):
        check_model_config(wider, default)
    before = {k: v for k, v in default.items() if k != "kv_channels"}  # a checkpoint written before the field
    check_model_config(before, explicit)
    with pytest.raises(ValueError, match="kv_channels = None but this run has 32"):
        check_model_config(before, wider)


def test_a_change_of_yarn_is_a_note_not_an_error():
    """A long-context phase resumes a checkpoint trained without YaRN (DeepSeek-V3's, Qwen3's): the architecture
    check passes, and the resume says what changed; a checkpoint written before the fields is plain rotary."""
    import dataclasses

    from megatron.checkpoint.run_state import YARN_FIELDS, check_model_config, rotary_scaling_change
    from tests.helpers.config import tiny_model

    plain = dataclasses.asdict(tiny_model(position_embedding_type="rotary"))
    yarn = dataclasses.asdict(tiny_model(position_embedding_type="rotary", yarn_rotary_scaling_factor=4.0,
                                         yarn_original_max_position_embeddings=16))
    check_model_config(plain, yarn)
    assert rotary_scaling_change(plain, yarn).startswith(
        "note: the checkpoint was trained with plain rotary positions, this run uses YaRN x4 of 16 positions (beta "
        "32 / 1, mscale 1 / 0)")
    assert rotary_scaling_change(yarn, plain).startswith("note: the checkpoint was trained with YaRN x4 of 16")
    assert rotary_scaling_change(yarn, yarn) is None and rotary_scaling_change(plain, plain) is None
    before = {k: v for k, v in plain.items() if k not in YARN_FIELDS}  # written before the fields
    assert rotary_scaling_change(before, plain) is None
    assert rotary_scaling_change(yarn, dict(yarn, yarn_beta_fast=16.0)) is not None
