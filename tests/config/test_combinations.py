"""The one table of refused feature combinations (megatron/config/combinations.py): every entry refused by
check_combinations on a run that has both features, every feature alone accepted, exactly the pairs the table
names refused (through the features each one brings along), and the docs' section rendered from it."""

import dataclasses
import itertools

import pytest

from megatron.config.combinations import (
    FEATURES,
    REFUSED,
    check_combinations,
    feature,
    refused_present,
    render_markdown,
)
from megatron.config.fp8 import FP8Config
from megatron.config.mla import MLAConfig
from megatron.config.moe import MoEConfig
from tests.helpers.config import run_config, tiny_model
from tests.helpers.paths import REPO_ROOT


def _parallel(rc, **fields):
    return dataclasses.replace(rc, parallel=dataclasses.replace(rc.parallel, **fields))


def _model(rc, **fields):
    return dataclasses.replace(rc, model=dataclasses.replace(rc.model, **fields))


def _training(rc, **fields):
    return dataclasses.replace(rc, training=dataclasses.replace(rc.training, **fields))


def _zero(stage):
    return lambda rc: dataclasses.replace(rc, precision=dataclasses.replace(rc.precision, zero_stage=stage))


# how each feature is switched on, on top of whatever else a run has
ENABLE = {
    "pipeline parallelism": lambda rc: _parallel(rc, pipeline_model_parallel_size=2),
    "interleaved": lambda rc: _parallel(rc, pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2),
    "ZB-H1": lambda rc: _parallel(rc, pipeline_model_parallel_size=2, enable_zbh1_pipeline=True,
                                  enable_zbh1_exact_semantics=True),
    "context parallelism": lambda rc: _parallel(rc, context_parallel_size=2),
    "Ulysses": lambda rc: _parallel(rc, ds_sequence_parallel_size=2),
    "sequence parallelism": lambda rc: _model(_parallel(rc, tensor_model_parallel_size=2), sequence_parallel=True),
    "MoE": lambda rc: _model(rc, moe=MoEConfig(num_experts=4, layer_pattern=(True, True))),
    "expert parallelism": lambda rc: _parallel(ENABLE["MoE"](rc), expert_model_parallel_size=2),
    "MLA": lambda rc: _model(rc, mla=MLAConfig()),
    "torch.compile": lambda rc: _training(rc, torch_compile=True),
    "fp16": lambda rc: _model(rc, params_dtype="fp16"),
    "ZeRO-2/3": _zero(2),
    "ZeRO-3": _zero(3),
    "model engine": _zero(2),
    "ZeRO++ hpZ": lambda rc: _parallel(rc, zero_hpz_partition_size=2),
    "attention dropout": lambda rc: _model(rc, attention_dropout=0.1),
    "attention backend other than auto / sdpa": lambda rc: _model(rc, attention_backend="flex"),
    "flash attention backend": lambda rc: _model(rc, attention_backend="flash"),
    "selective recomputation": lambda rc: _model(rc, recompute_core_attention=True),
    "live evaluation harness": lambda rc: _training(rc, eval_harness_tasks=("tiny_choice",), eval_harness_interval=2),
    "universal checkpoint": lambda rc: dataclasses.replace(rc, checkpoint=dataclasses.replace(
        rc.checkpoint, load="/tmp/checkpoints", universal_checkpoint=True)),
    "batch-size rampup": lambda rc: dataclasses.replace(rc, batch=dataclasses.replace(rc.batch,
                                                                                    rampup_batch_size=(4, 4, 64))),
    "partition method other than type:transformer": lambda rc: _parallel(rc, pp_partition_method="uniform"),
    "DeepSpeed activation checkpointing": lambda rc: _training(rc, checkpoint_activations=True,
                                                               deepspeed_activation_checkpointing=True),
    "sync TP-duplicated parameters": lambda rc: _training(rc, sync_tp_duplicated_parameters=True),
    "Muon": lambda rc: dataclasses.replace(rc, optimizer=dataclasses.replace(rc.optimizer, optimizer="muon")),
    "FP8": lambda rc: _model(rc, fp8=FP8Config(fp8_format="hybrid")),
    "MTP": lambda rc: _model(rc, mtp_num_layers=1),
    "document attention mask": lambda rc: dataclasses.replace(rc, data=dataclasses.replace(
        rc.data, reset_attention_mask=True)),
}
NAMES = [f.name for f in FEATURES]


def _plain():
    """bf16, ZeRO-1, DP 2, no attention dropout (ModelConfig's default is Megatron's 0.1): none of the features."""
    return run_config(model=tiny_model(params_dtype="bf16", attention_dropout=0.0))


def _with(*names):
    rc = _plain()
    for name in names:
        rc = ENABLE[name](rc)
    return rc


def _present(rc) -> set[str]:
    return {f.name for f in FEATURES if f.present(rc)}


def test_every_feature_has_a_switch_and_the_tiny_run_has_none():
    assert sorted(ENABLE) == sorted(NAMES) and len(set(NAMES)) == len(NAMES)
    assert _present(_plain()) == set()
    assert all(r.a in NAMES and r.b in NAMES and r.a != r.b for r in REFUSED)
    assert all(r.reason.strip() and r.fix.strip() for r in REFUSED)
    pairs = [frozenset((r.a, r.b)) for r in REFUSED]
    assert len(set(pairs)) == len(pairs), "a pair listed twice"


@pytest.mark.parametrize("name", NAMES)
def test_each_feature_alone_is_not_refused(name):
    rc = _with(name)
    assert name in _present(rc)
    assert refused_present(rc) == []
    check_combinations(rc)


@pytest.mark.parametrize("entry", REFUSED, ids=[f"{r.a} + {r.b}" for r in REFUSED])
def test_every_refused_pair_is_refused_with_its_reason_or_fix(entry):
    for order in ((entry.a, entry.b), (entry.b, entry.a)):
        rc = _with(*order)
        assert entry in refused_present(rc)
        with pytest.raises(ValueError) as info:
            check_combinations(rc)
        with pytest.raises(ValueError) as own:
            check_combinations(rc, entry.a)  # the owner's check reports it
        assert entry.reason in str(own.value) or entry.fix in str(own.value), str(own.value)
        assert str(info.value)


def test_the_grouped_message_names_every_partner_present():
    rc = _with("context parallelism", "Ulysses", "attention backend other than auto / sdpa")
    with pytest.raises(ValueError) as info:
        check_combinations(rc, "context parallelism")
    message = str(info.value)
    assert message.startswith("--context-parallel-size 2 does not work yet with --ds-sequence-parallel-size 2 "
                              "(DeepSpeed-Ulysses) (both split the sequence); --attention-backend flex (")
    assert message.endswith("drop --ds-sequence-parallel-size, use --attention-backend auto, or train with "
                            "--context-parallel-size 1")


def test_exactly_the_pairs_of_the_table_are_refused():
    """Over all n choose 2 pairs of features: a pair is refused exactly when the table names two of the features
    the pair brings along (ZeRO-3 brings ZeRO-2/3 and the model engine, Ulysses the latter, ZB-H1 and
    interleaved the pipeline)."""
    refused, expected = set(), set()
    table = {frozenset((r.a, r.b)) for r in REFUSED}
    for x, y in itertools.combinations(NAMES, 2):
        rc = _with(x, y)
        try:
            check_combinations(rc)
        except ValueError:
            refused.add(frozenset((x, y)))
        brought = _present(rc)
        if any(pair <= brought for pair in table):
            expected.add(frozenset((x, y)))
    assert refused == expected
    assert table <= refused
    n = len(NAMES)
    assert (n, n * (n - 1) // 2, len(REFUSED)) == (29, 406, 23)
    assert len(refused) == 40  # the table's 23, and 17 more through the features a pair brings along


def test_docs_flags_md_has_the_section_rendered_from_the_table():
    text = (REPO_ROOT / "docs" / "flags.md").read_text()
    section = "\n".join(render_markdown())
    assert section in text
    n = len(FEATURES)
    assert f"{len(REFUSED)} of the {n * (n - 1) // 2} pairs of its {n} features are refused" in section
    rows = [line for line in text.split("## Feature combinations refused", 1)[1].splitlines()
            if line.count(" | ") == 3 and not line.startswith(("| feature |", "| --- |"))]
    assert len(rows) == len(REFUSED)
    for r in REFUSED:
        assert any(row.startswith(f"| {r.a} | {r.b} | ") for row in rows), (r.a, r.b)


def test_the_message_names_the_partner_as_given():
    rc = _with("context parallelism", "Ulysses")
    with pytest.raises(ValueError, match=r"--context-parallel-size 2 does not work yet with --ds-sequence-parallel-"
                                         r"size 2 \(DeepSpeed-Ulysses\) \(both split the sequence\)"):
        check_combinations(rc)
    assert feature("Ulysses").given(rc) == "--ds-sequence-parallel-size 2 (DeepSpeed-Ulysses)"


def test_the_module_needs_no_torch():
    import ast

    tree = ast.parse((REPO_ROOT / "megatron" / "config" / "combinations.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module}
    assert imported <= {"__future__", "dataclasses", "typing"}, imported


def test_zero3_is_refused_with_expert_parallelism_only():
    """MoE at EP = 1 is plain parameters to ZeRO-3; DeepSpeed's engine refuses our expert-parallel layers (EP > 1)."""
    check_combinations(_with("MoE", "ZeRO-3"))
    with pytest.raises(ValueError, match=r"MoE \(--num-experts 4\) with --expert-model-parallel-size 2 does not work "
                                         r"with --zero-stage 3: DeepSpeed's ZeRO-3 takes expert-parallel layers only"):
        check_combinations(_with("expert parallelism", "ZeRO-3"))
