"""megatron.engine.deepspeed_compat: each workaround refuses to run on a DeepSpeed it was not written for,
naming both versions and what to re-check; and the universal loaders' optimizer mending does what it says."""

import pathlib
import re

import deepspeed
import pytest
import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

from megatron.engine import deepspeed_compat
from megatron.engine.schedules import zero_bubble
from tests.helpers.paths import REPO_ROOT


def test_the_pin_is_the_makefiles_and_the_installed_version():
    pin = re.search(r"^DEEPSPEED_VERSION\s*:=\s*(\S+)", pathlib.Path(REPO_ROOT / "Makefile").read_text(), re.M)
    assert pin and pin.group(1) == deepspeed_compat.PINNED_VERSION == deepspeed_compat.installed_version()


def _two_groups():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}])
    return optimizer, a, b


WORKAROUNDS = {
    "universal_optimizer": lambda: deepspeed_compat.mend_universal_optimizer(_two_groups()[0], [{}, {}]),
    "unsafe_torch_load": lambda: deepspeed_compat.safe_loading(),
    "hpz_group": lambda: deepspeed_compat.set_zero_param_intra_group(None),
    "renamed_collectives": deepspeed_compat.silence_renamed_collectives,
    "universal_tp_restore": lambda: deepspeed_compat.universal_tp_restore([], 2, None).__enter__(),
    "bf16_stage_0": lambda: deepspeed_compat.check_bf16_stage_0(0, True),
    "zero3_ulysses_average": lambda: deepspeed_compat.check_zero3_ulysses(3, 2),
    "expert_parallel": lambda: deepspeed_compat.moe_marker(4, "megatron_ep_size_2"),
    "moe_checkpoint": lambda: deepspeed_compat.plain_checkpoint_files(None).__enter__(),
    "universal_expert_slicing": lambda: deepspeed_compat.universal_expert_slicing(None).__enter__(),
    "expert_tp_grad_norm": lambda: deepspeed_compat.count_expert_grads_once(object.__new__(BF16_Optimizer), 1),
    "pipeline_schedule": lambda: zero_bubble.ZeroBubblePipelineEngine(),
    "pipeline_engine_class": lambda: deepspeed_compat.pipeline_engine_class(object).__enter__(),
    "muon_import": deepspeed_compat.skip_unused_muon_import,
    "zero3_module_outputs": lambda: deepspeed_compat.zero3_leaf_modules(torch.nn.Linear(1, 1), [torch.nn.Linear]),
}


@pytest.mark.parametrize("name", sorted(WORKAROUNDS))
def test_a_workaround_on_another_deepspeed_fails_naming_both_versions(monkeypatch, name):
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with pytest.raises(RuntimeError) as error:
        WORKAROUNDS[name]()
    message = str(error.value)
    assert "deepspeed 0.20.1 is installed" in message and f"deepspeed {deepspeed_compat.PINNED_VERSION}" in message
    assert repr(name) in message and deepspeed_compat.WORKAROUNDS[name] in message


def test_every_workaround_is_exercised_here_or_named_for_its_test():
    assert set(WORKAROUNDS) | {"zero3_init_dtype", "shm_comm_build"} == set(deepspeed_compat.WORKAROUNDS)


def _overridden(cls, base):
    """The private methods and class attributes of DeepSpeed's ``base`` that ``cls`` defines anew."""
    return {name for name in vars(cls) if name.startswith("_") and not name.startswith("__") and hasattr(base, name)}


def test_the_schedule_engines_override_only_listed_private_methods_and_require_the_version(monkeypatch):
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.module import PipelineModule

    from megatron.engine.schedules import ENGINE_CLASSES
    from megatron.engine.schedules.interleaved import InterleavedPipelineModule

    listed = deepspeed_compat.PIPELINE_SCHEDULE_OVERRIDES
    engines = [entry.engine_class for entry in ENGINE_CLASSES.values() if entry.engine_class is not None]
    overridden = set().union(*(_overridden(engine, PipelineEngine) for engine in engines))
    assert overridden == set(listed["PipelineEngine"])
    assert _overridden(InterleavedPipelineModule, PipelineModule) == set(listed["PipelineModule"])
    for name in listed["PipelineEngine"] + listed["PipelineModule"]:
        assert name in deepspeed_compat.WORKAROUNDS["pipeline_schedule"], name
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    for cls in engines + [InterleavedPipelineModule]:
        with pytest.raises(RuntimeError, match="'pipeline_schedule'"):
            cls(num_virtual_stages=2) if cls is InterleavedPipelineModule else cls()


def test_a_local_build_suffix_is_the_same_release(monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", deepspeed_compat.PINNED_VERSION + "+cpu")
    deepspeed_compat.require("hpz_group")  # no error
    deepspeed_compat.check_bf16_stage_0(1, True)  # not the workaround's case: nothing to check
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    deepspeed_compat.check_zero3_ulysses(2, 2)  # only ZeRO-3 with Ulysses relies on it


def test_mending_gives_each_group_its_hyperparameters_and_a_step_of_its_own():
    optimizer, a, b = _two_groups()
    own = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    shared = torch.tensor(5.0)
    optimizer.state[a]["step"], optimizer.state[b]["step"] = shared, shared  # as ZeRO-3's universal loader leaves it
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.1  # every group given the first group's
    deepspeed_compat.mend_universal_optimizer(optimizer, own)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    steps = optimizer.state[a]["step"], optimizer.state[b]["step"]
    assert steps[0] is not steps[1] and [float(s) for s in steps] == [5.0, 5.0]
    steps[0].add_(1)  # Adam counting one group's step leaves the other's
    assert float(steps[1]) == 5.0


def test_deepspeed_reads_the_expert_groups_marks_and_marker_as_its_own_moe():
    """What expert parallelism relies on (workaround ``expert_parallel``), read back through DeepSpeed's own
    accessors: the registered groups, the parameter mark, the marker's type. That the engine then turns on its MoE
    paths is checked by ``check_moe_engine`` in every EP run (tests/training/test_moe.py)."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    ep_group, expert_data_group, name = object(), object(), "megatron_ep_size_test"
    deepspeed_compat.register_expert_groups(name, ep_group, expert_data_group)
    try:
        assert groups._get_expert_parallel_group(name) is ep_group
        assert groups._get_expert_data_parallel_group(name) is expert_data_group
        assert groups._get_expert_data_parallel_group_dict()[name] is expert_data_group
    finally:
        del groups._EXPERT_PARALLEL_GROUP[name], groups._EXPERT_DATA_PARALLEL_GROUP[name]
    param, plain = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    deepspeed_compat.mark_moe_parameter(param, name)
    assert deepspeed_compat.is_moe_parameter(param) and not deepspeed_compat.is_moe_parameter(plain)
    assert param.group_name == name
    marker = deepspeed_compat.moe_marker(4, name)
    assert isinstance(marker, MoE) and not list(marker.parameters()) and not list(marker.buffers())
    assert (marker.num_experts, marker.expert_group_name) == (4, name)


def test_an_engine_without_the_moe_paths_is_refused_naming_what_to_recheck():
    from deepspeed.utils import groups

    name = "megatron_ep_size_test"
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = object()
    try:
        engine = type("Engine", (), {"has_moe_layers": False, "expert_data_parallel_group": {}})()
        with pytest.raises(RuntimeError, match="has_moe_layers"):
            deepspeed_compat.check_moe_engine(engine, name)
    finally:
        del groups._EXPERT_DATA_PARALLEL_GROUP[name]


def test_deepspeeds_muon_modules_are_stand_ins_that_refuse_to_run(monkeypatch):
    """What DeepSpeed's ZeRO stages and BF16_Optimizer import of its Muon (an isinstance check and ``muon_update``,
    imported on every gradient partitioning step) resolves to the stand-ins, plain modules that import nothing (the
    real modules' @torch.compile decorators do: 1.6-3 s per rank) and fail loudly if this engine ever called them."""
    import sys

    names = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    deepspeed_compat.skip_unused_muon_import()
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # noqa: PLC0415 (what DeepSpeed imports)
    from deepspeed.runtime.zero.muon.original_muon import muon_update  # noqa: PLC0415 (what DeepSpeed imports)

    assert all("stand-in" in sys.modules[name].__doc__ for name in names)
    assert not isinstance(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]), MuonWithAuxAdam)
    for call in (lambda: muon_update(torch.ones(2, 2), torch.ones(2, 2), 0.9), MuonWithAuxAdam):
        with pytest.raises(RuntimeError, match="use --optimizer muon"):
            call()
    before = {name: sys.modules[name] for name in names}
    deepspeed_compat.skip_unused_muon_import()  # a second call keeps what is there
    assert {name: sys.modules[name] for name in names} == before
