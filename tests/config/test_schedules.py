"""The registry of pipeline schedules (megatron.config.schedules): one entry per schedule, one chooser, no torch."""

import subprocess
import sys
import types

import pytest

from megatron.config.schedules import REGISTRY, SCHEDULES, check_layout, get, schedule_name, virtual_stages_of


def _rc(v=1, zbh1=False):
    return types.SimpleNamespace(parallel=types.SimpleNamespace(num_virtual_stages_per_pipeline_rank=v,
                                                                enable_zbh1_pipeline=zbh1))


def test_one_entry_per_schedule_with_its_flags_and_rules():
    assert SCHEDULES == ("1f1b", "zbh1", "interleaved")
    assert REGISTRY["zbh1"].flags[0] == "--enable-zbh1-pipeline"
    assert REGISTRY["interleaved"].flags == ("--num-virtual-stages-per-pipeline-rank",)
    assert all(s.name == name and s.label for name, s in REGISTRY.items())
    with pytest.raises(ValueError, match="unknown pipeline schedule 'gpipe'"):
        get("gpipe")


def test_the_chooser_reads_the_flags():
    assert (schedule_name(_rc()), virtual_stages_of(_rc())) == ("1f1b", 1)
    assert (schedule_name(_rc(zbh1=True)), virtual_stages_of(_rc(zbh1=True))) == ("zbh1", 1)
    assert (schedule_name(_rc(v=4)), virtual_stages_of(_rc(v=4))) == ("interleaved", 4)


@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (4, 8, 2), (4, 16, 3), (8, 8, 2)])
def test_formulas(pp, m, v):
    one, zb, inter = (REGISTRY[name] for name in SCHEDULES)
    for r in range(pp):
        assert one.warmup_forwards(pp, m, r) == zb.warmup_forwards(pp, m, r) == min(pp - r - 1, m)
        assert one.in_flight(pp, m, r) == min(pp - r, m)
        assert inter.warmup_forwards(pp, m, r, v) == min(2 * (pp - r - 1) + (v - 1) * pp, m * v)
        assert zb.deferred_weight_passes(m, r) == min(r + 1, m) and one.deferred_weight_passes(m, r) == 0
    assert one.bubble_slots(pp) == pp - 1 and inter.bubble_slots(pp, v) == pytest.approx((pp - 1) / v)
    assert zb.bubble_slots(pp) == pytest.approx((pp - 1) / 3)
    assert (one.p2p_factor(v), zb.p2p_factor(v), inter.p2p_factor(v)) == (1, 1, v)


def test_rules_refuse_with_the_fix():
    with pytest.raises(ValueError, match="at least 4 micro-batches"):
        check_layout("zbh1", 4, 2, 8)
    with pytest.raises(ValueError, match="multiple of 8"):
        check_layout("interleaved", 4, 8, 12, 2)
    check_layout("1f1b", 4, 2, 7)


def test_the_registry_imports_no_torch():
    code = "import sys, megatron.config.schedules; assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
