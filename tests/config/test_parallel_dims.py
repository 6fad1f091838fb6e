"""The one list of parallel dimensions: every reader agrees with it, and its rules are the run's."""

import dataclasses

import pytest

from megatron.arguments.flags import build_parser
from megatron.config import ParallelConfig, parallel_dims
from megatron.config.parallel_dims import DIMENSIONS, divide_world, recorded_sizes, resume_mismatches
from megatron.parallel.state import group_layout
from megatron.planner.candidate import Layout


def test_every_dimension_is_a_parallel_config_field_and_its_flag_is_a_flag():
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    options = {opt for action in build_parser()._actions for opt in action.option_strings}
    for d in DIMENSIONS:
        assert d.field in fields, d
        assert d.flag is None or d.flag in options, d
    assert [d.name for d in parallel_dims.WORLD] == ["tp", "pp", "dp", "sp", "cp"]
    assert [d.name for d in parallel_dims.ZERO_SHARDED] == ["dp", "sp", "cp"]


@pytest.mark.parametrize("sizes", [dict(tp=2, pp=3, dp=4), dict(tp=2, pp=1, dp=3, sp=2), dict(tp=1, pp=2, dp=2, cp=3),
                                   dict(tp=2, pp=2, dp=4, ep=2)])
def test_the_world_is_the_product_of_its_factors_for_every_reader(sizes):
    tp, pp, dp, sp, cp, ep = (sizes.get(n, 1) for n in ("tp", "pp", "dp", "sp", "cp", "ep"))
    expected = tp * pp * dp * sp * cp  # EP is carved from DP: not a factor
    config = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
                            ds_sequence_parallel_size=sp, context_parallel_size=cp, expert_model_parallel_size=ep)
    assert config.world_size == expected
    assert group_layout(tp, pp, dp, sp=sp, ep=ep, cp=cp).world_size == expected
    assert Layout(tp, pp, dp, 1, ulysses=sp, cp=cp, ep=ep).world_size == expected
    assert Layout(tp, pp, dp, 1, ulysses=sp, cp=cp, ep=ep).weight_replicas == dp * sp * cp
    assert divide_world(expected, {n: v for n, v in sizes.items() if n != "dp"}) == dp


def test_divide_world_names_every_flag_of_the_split_and_the_fix():
    with pytest.raises(ValueError, match=r"world size 10 is not a multiple of --tensor-model-parallel-size 2 x "
                                         r"--pipeline-model-parallel-size 1 x --context-parallel-size 3 = 6; launch a "
                                         r"multiple of 6 processes or change TP/PP/CP"):
        divide_world(10, dict(tp=2, pp=1, cp=3))
    with pytest.raises(ValueError, match="must be positive"):
        divide_world(4, dict(tp=0))


def test_the_record_holds_tp_pp_dp_always_and_the_others_above_one():
    sizes = ParallelConfig(tensor_model_parallel_size=2, data_parallel_size=2, context_parallel_size=2).sizes()
    assert recorded_sizes(sizes) == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                                     "data_parallel_size": 2, "context_parallel_size": 2}


def test_resume_compares_tp_pp_always_and_the_zero_shards_with_the_optimizer():
    saved = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "data_parallel_size": 4}
    now = dict(tp=2, pp=1, dp=2, cp=2, sp=1, ep=1, vp=1)
    pairs = resume_mismatches(saved, now, loads_optimizer=True)
    # the weights do not depend on CP; dp x cp ZeRO shards agree (4 x 1 == 2 x 2)
    assert pairs["data-parallel x context-parallel size (ZeRO shards)"] == (4, 4)
    assert "data-parallel size" not in pairs and "--context-parallel-size" not in pairs
    assert resume_mismatches(saved, dict(now, cp=1), loads_optimizer=True)["data-parallel size"] == (4, 2)
    weights_only = resume_mismatches(saved, dict(now, tp=1), loads_optimizer=False)
    assert weights_only["--tensor-model-parallel-size"] == (2, 1)
    assert not any("data-parallel" in name for name in weights_only)
    # a record without dp (Megatron-DeepSpeed's) cannot be compared on it
    older = resume_mismatches({"tensor_model_parallel_size": 2}, now, loads_optimizer=True)
    assert older["data-parallel size"][0] is None and older["--pipeline-model-parallel-size"] == (None, 1)
