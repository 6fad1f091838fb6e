"""--dry-run's pipeline schedule: BLOOM-176B's own flags under 1F1B and with --enable-zbh1-pipeline, and the
interleaved schedule read from ``num_virtual_stages_per_pipeline_rank`` (the field the interleaved branch adds)."""

import copy
import dataclasses

import pytest

from megatron.arguments import run_config_from_argv
from megatron.dry_run import build_report
from megatron.dry_run.estimate import hardware, model_shape, planner_layout, schedule_section
from megatron.dry_run.text import render
from megatron.planner.memory import activation_terms
from megatron.planner.specs import GiB
from tests.helpers.arguments import bloom_setup

ZBH1 = ["--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"]
STAGES = [5] + [6] * 10 + [5]  # 'type:transformer|embedding' on 12 stages


@pytest.fixture(scope="module")
def bloom(tmp_path_factory):
    argv, _ = bloom_setup(tmp_path_factory.mktemp("bloom"))
    dry = ["--dry-run", "--world-size", "384"]
    return argv, {name: build_report(argv + extra + dry) for name, extra in (("1f1b", []), ("zbh1", ZBH1))}


def test_the_report_gives_the_runs_schedule_beside_1f1b(bloom):
    argv, reports = bloom
    one, zbh1 = reports["1f1b"]["schedule"], reports["zbh1"]["schedule"]
    assert (one["label"], zbh1["label"], one["num_micro_batches"]) == ("1F1B", "ZB-H1", 128)
    assert one["bubble_fraction"] == one["bubble_fraction_1f1b"] == reports["1f1b"]["step"]["bubble_fraction"]
    assert zbh1["bubble_fraction"] == reports["zbh1"]["step"]["bubble_fraction"] < one["bubble_fraction"] / 1.5
    assert one["in_flight_micro_batches"] == zbh1["in_flight_micro_batches"] == list(range(12, 0, -1))
    assert zbh1["deferred_weight_passes"] == list(range(1, 13)) and one["deferred_weight_passes"] == [0] * 12
    assert zbh1["activation_gib_1f1b"] == one["activation_gib"] and one["p2p_gib_per_rank"] == zbh1["p2p_gib_per_rank"]
    # the memory section is the same schedule's: recomputing, ZB-H1's waiting W passes outgrow 1F1B's activations
    # the same bytes, the report rounding them to 2 decimals there and 3 here: within 0.005 + 0.0005 GiB
    for name in ("1f1b", "zbh1"):
        memory = reports[name]["memory"]["per_stage_gib"]
        assert [stage["activations"] for stage in memory] == pytest.approx(reports[name]["schedule"]["activation_gib"],
                                                                          abs=0.0055)
    assert zbh1["activation_gib"][-1] > 10 * one["activation_gib"][-1] and not reports["zbh1"]["memory"]["fits"]
    assert "schedule     ZB-H1, 128 micro-batches per step" in render(reports["zbh1"])
    assert any("or 1F1B: ZB-H1 holds" in line for line in reports["zbh1"]["warnings"])
    rc = run_config_from_argv(argv + ZBH1, world_size=384, with_vocab=False)
    terms = activation_terms(model_shape(rc), planner_layout(rc, STAGES), 2048, 2048)
    assert zbh1["activation_gib"] == [round(sum(t.values()) / GiB, 3) for t in terms]


def _with_virtual_stages(rc, v: int):
    """``rc`` with ``v`` virtual stages per pipeline rank, set without RunConfig's own validation (which refuses the
    layouts the test hands the planner's checks)."""
    parallel, out = copy.copy(rc.parallel), copy.copy(rc)
    object.__setattr__(parallel, "num_virtual_stages_per_pipeline_rank", v)
    object.__setattr__(out, "parallel", parallel)
    return out


def test_interleaved_is_read_from_the_virtual_stages_and_refused_where_layers_do_not_split(bloom):
    argv, _ = bloom
    rc = run_config_from_argv(argv, world_size=384, with_vocab=False)
    gpu, cluster = hardware(None, None)
    layout = planner_layout(_with_virtual_stages(rc, 2), STAGES)
    assert (layout.schedule, layout.virtual_stages) == ("interleaved", 2)
    with pytest.raises(ValueError, match="70 layers do not split into PP 12 x 2 virtual stages"):
        schedule_section(_with_virtual_stages(rc, 2), STAGES, gpu, cluster)
    with pytest.raises(ValueError, match=r"micro-batches per step \(128\) to be a multiple of 12"):
        schedule_section(_with_virtual_stages(dataclasses.replace(rc, model=dataclasses.replace(
            rc.model, num_layers=72)), 2), [6] * 12, gpu, cluster)
    # 72 layers (3 a chunk) and 1920 sequences a step (120 micro-batches, 10 per stage)
    rc = dataclasses.replace(rc, model=dataclasses.replace(rc.model, num_layers=72),
                             batch=dataclasses.replace(rc.batch, global_batch_size=1920))
    one, two = (schedule_section(_with_virtual_stages(rc, v), [6] * 12, gpu, cluster) for v in (1, 2))
    assert (one["label"], two["label"]) == ("1F1B", "interleaved 1F1B v=2")
    assert two["in_flight_micro_batches"][0] == 12 + 11 / 2 and two["in_flight_micro_batches"][-1] == 12 - 11 / 2
    assert two["bubble_fraction"] < two["bubble_fraction_1f1b"] == one["bubble_fraction"]
    # twice the bytes, each figure rounded to 3 decimals: within 0.0005 + 2 x 0.0005 GiB
    assert two["p2p_gib_per_rank"] == pytest.approx(2 * one["p2p_gib_per_rank"], abs=0.0015)
