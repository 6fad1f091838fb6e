"""The dry run's inputs to the planner: the parameter counts DeepSpeed's 'parameters' partition would
count, and a planner layout that is the job's own."""

import pytest

from megatron.dry_run.estimate import hardware, item_param_counts, planner_layout
from megatron.engine.pipeline import layer_specs
from megatron.parallel.state import ParallelState
from tests.helpers.arguments import parse
from tests.helpers.engine import DeepSpeedPartition


@pytest.mark.parametrize("position_embedding_type", ["absolute", "alibi"])
def test_item_param_counts_are_the_ones_deepspeed_counts(files, position_embedding_type):
    """At TP = 1 DeepSpeed builds each spec whole and counts its parameters; the dry run computes them."""
    rc = parse(files, num_layers=3, position_embedding_type=position_embedding_type, embed_layernorm=True)
    rc = rc.with_vocab_size(90, 128)
    specs = layer_specs(rc.model, ParallelState.single(), None)
    assert item_param_counts(rc) == DeepSpeedPartition(specs, 1)._count_layer_params()


def test_planner_layout_is_the_jobs(files):
    rc = parse(files, world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, bf16=True,
               zero_stage=0, checkpoint_activations=True, global_batch_size=16)
    layout = planner_layout(rc, [1, 1])
    assert (layout.tp, layout.pp, layout.dp, layout.micro_batch_size) == (2, 2, 2, 2)
    # bf16 with ZeRO 0 runs DeepSpeed's BF16_Optimizer, whose memory is the planner's ZeRO-1
    assert (layout.precision, layout.zero_stage, layout.recompute, layout.stage_layers) == ("bf16", 1, True, (1, 1))


def test_an_unknown_gpu_or_fabric_lists_the_known_ones():
    assert hardware(None, None)[0].name == "A100-80GB"
    with pytest.raises(ValueError, match="pick one of A100-40GB, A100-80GB, H100-80GB, H200-141GB"):
        hardware("V100-32GB", None)
    with pytest.raises(ValueError, match="dgx-a100, dgx-h100, jean-zay-a100"):
        hardware("H100-80GB", "slingshot")


def test_planner_layout_reads_sequence_parallelism_and_the_attention_kernel(files):
    """The SP / Ulysses settings reach the planner's layout; the attention scores count only for an explicit
    sdpa without selective recomputation."""
    import dataclasses
    import types

    rc = parse(files, world_size=8, tensor_model_parallel_size=2, bf16=True, global_batch_size=16)
    plain = planner_layout(rc, [rc.model.num_layers])
    assert (plain.sequence_parallel, plain.ulysses, plain.store_attention_scores) == (False, 1, False)
    parallel = types.SimpleNamespace(**{**dataclasses.asdict(rc.parallel), "sequence_parallel": True,
                                        "ds_sequence_parallel_size": 2, "expert_tp": rc.parallel.expert_tp})
    fake = types.SimpleNamespace(parallel=parallel, batch=rc.batch, training=rc.training, model=rc.model, optimizer=rc.optimizer,
                                 deepspeed_zero_stage=rc.deepspeed_zero_stage)
    layout = planner_layout(fake, [rc.model.num_layers])
    assert (layout.sequence_parallel, layout.ulysses, layout.sequence_label) == (True, 2, "SP+U2")
    sdpa = dataclasses.replace(rc, model=dataclasses.replace(rc.model, attention_backend="sdpa"))
    assert planner_layout(sdpa, [rc.model.num_layers]).store_attention_scores
    with_flag = parse(files, world_size=8, tensor_model_parallel_size=2, bf16=True, global_batch_size=16,
                      sequence_parallel=True)
    assert planner_layout(with_flag, [rc.model.num_layers]).sequence_parallel  # --sequence-parallel reaches it


def test_the_layout_section_counts_the_ulysses_ranks(files):
    from megatron.dry_run.plan import layout_section
    from megatron.dry_run.text import _layout

    rc = parse(files, world_size=8, tensor_model_parallel_size=2, ds_sequence_parallel_size=2, global_batch_size=16)
    section = layout_section(rc)
    assert (section["data_parallel_size"], section["ds_sequence_parallel_size"]) == (2, 2)
    assert section["stages"][0]["ranks"] == [0, 7]  # one stage over all 8 ranks, not the first 4
    assert "TP 2 x PP 1 x DP 2 x Ulysses SP 2 = 8 ranks" in _layout(section)[1]


def test_the_layout_section_counts_the_context_parallel_ranks(files):
    from megatron.dry_run.plan import layout_section
    from megatron.dry_run.text import _layout

    rc = parse(files, world_size=8, pipeline_model_parallel_size=2, context_parallel_size=2, global_batch_size=16,
               attention_dropout=0.0)
    section = layout_section(rc)
    assert (section["data_parallel_size"], section["context_parallel_size"]) == (2, 2)
    assert [stage["ranks"] for stage in section["stages"]] == [[0, 3], [4, 7]]  # rank = (pp * dp + d) * cp + c
    assert "TP 1 x PP 2 x DP 2 x CP 2 (ring attention) = 8 ranks" in _layout(section)[1]


def test_planner_layout_reads_context_parallelism(files):
    """--context-parallel-size reaches the planner's layout (ZeRO over dp x cp), and the ring kernel keeps no
    [np, s, s] scores even where an explicit sdpa would."""
    import dataclasses

    rc = parse(files, world_size=8, pipeline_model_parallel_size=2, context_parallel_size=2, global_batch_size=16,
               attention_dropout=0.0, attention_backend="sdpa")
    layout = planner_layout(rc, [1, 1])
    assert (layout.cp, layout.dp, layout.weight_replicas, layout.world_size) == (2, 2, 4, 8)
    assert not layout.store_attention_scores and layout.sequence_label == "CP2"
    plain = dataclasses.replace(rc, parallel=dataclasses.replace(rc.parallel, context_parallel_size=1))
    assert planner_layout(plain, [1, 1]).store_attention_scores
