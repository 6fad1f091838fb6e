"""The planner against published runs (BLOOM-176B, GPT-3 175B) and DeepSpeed's own partitioning."""

import pytest
import torch

from megatron.planner import BLOOM_SIZES, CLUSTERS, GPUS, ModelShape, estimate_memory, estimate_step, plan_layouts
from megatron.planner.candidate import Layout, layers_per_stage
from megatron.planner.memory import static_bytes
from megatron.planner.specs import GiB
from megatron.testing.tolerance import tolerance

# The planner's formulas and the ones written out here are both Python float64 arithmetic of a dozen or so
# operations, in other orders: within 16 roundings in sequence of float64, nothing summed wider
# (megatron.testing.tolerance), relative. Python's float arithmetic is the same on every CPU.
F64 = tolerance(torch.float64, 16, 1)

BLOOM = Layout(tp=4, pp=12, dp=8, micro_batch_size=2, recompute=True, zero_stage=1,
               partition_method="type:transformer|embedding")
BLOOM_MEASURED_TFLOPS = 150.0   # BLOOM-176B on Jean Zay, Megatron-DeepSpeed's log (counts the recompute)
GPT3_MEASURED_TFLOPS = 138.0    # Narayanan et al. 2021, GPT-3 175B on 1024 A100s (from memory; see docs)


def _bloom_plans(**kwargs):
    return plan_layouts(BLOOM_SIZES["176B"], GPUS["A100-80GB"], CLUSTERS["jean-zay-a100"], 384, 2048, 2048,
                        partition_method="type:transformer|embedding", **kwargs)


def _key(layout):
    return (layout.tp, layout.pp, layout.dp, layout.micro_batch_size, layout.recompute)


def test_bloom_layout_ranks_first_among_checkpointed_layouts():
    plans = _bloom_plans(recompute=(True,))
    top = [_key(p.layout) for p in plans[:3]]
    assert _key(BLOOM) in top, f"BLOOM's layout is not in the top three: {top}"
    assert _key(plans[0].layout) == _key(BLOOM), top


def test_bloom_layout_rank_without_constraints():
    # Unconstrained, three no-recompute TP=8 layouts predicted at 59-64 GiB rank above BLOOM's
    # (docs/performance.md discusses it); BLOOM's must stay the fastest checkpointed one.
    plans = _bloom_plans()
    keys = [_key(p.layout) for p in plans]
    rank = keys.index(_key(BLOOM))
    assert rank < 5, keys[:6]
    assert all(not p.layout.recompute for p in plans[:rank]), keys[:rank]
    # With the ZeRO stage our bf16 path allows (1; the CLI's default) it is in the top three.
    keys = [_key(p.layout) for p in _bloom_plans(zero_stages=(1,))]
    assert keys.index(_key(BLOOM)) < 3, keys[:4]


def test_bloom_memory_fits_80gb_and_throughput_within_20_percent():
    model = BLOOM_SIZES["176B"]
    memory = estimate_memory(model, BLOOM, 2048, 2048)
    assert 30 * GiB < memory.peak < 0.9 * 80 * GiB, memory.totals
    assert memory.peak_stage == 0  # the first stage holds PP micro-batches in flight
    step = estimate_step(model, BLOOM, GPUS["A100-80GB"], CLUSTERS["jean-zay-a100"], 2048, 2048)
    assert abs(step.hardware_tflops_per_gpu / BLOOM_MEASURED_TFLOPS - 1) < 0.20, step.hardware_tflops_per_gpu
    assert step.model_tflops_per_gpu == pytest.approx(step.hardware_tflops_per_gpu * 3 / 4, rel=F64, abs=0)
    # Megatron's own iteration-time arithmetic: ~105 s per 2048 x 2048 tokens at 150 TFLOPs
    assert 80 < step.step_s < 120, step.step_s


def test_gpt3_175b_second_data_point_not_fitted():
    gpt3 = ModelShape(96, 12288, 96, 51200, embed_layernorm=False, learned_positions=2048)
    layout = Layout(tp=8, pp=8, dp=16, micro_batch_size=1, recompute=True, zero_stage=1)
    step = estimate_step(gpt3, layout, GPUS["A100-80GB"], CLUSTERS["dgx-a100"], 2048, 1536)
    assert abs(step.hardware_tflops_per_gpu / GPT3_MEASURED_TFLOPS - 1) < 0.20, step.hardware_tflops_per_gpu


def test_layers_per_stage_matches_deepspeed_partition_balanced():
    model = BLOOM_SIZES["176B"]
    assert layers_per_stage(model, 12, "type:transformer") == [6] * 10 + [5, 5]
    assert layers_per_stage(model, 12, "type:transformer|embedding") == [5] + [6] * 10 + [5]
    assert layers_per_stage(BLOOM_SIZES["1B3"], 5) == [5, 5, 5, 5, 4]
    with pytest.raises(ValueError):
        layers_per_stage(BLOOM_SIZES["1B3"], 25)


def test_parameter_counts_of_named_sizes():
    # bloom-560m and bloom (176B) parameter counts as published: 559,214,592 and 176,247,271,424
    assert BLOOM_SIZES["350M"].total_params() == 559_214_592
    assert BLOOM_SIZES["176B"].total_params() == 176_247_271_424


def test_more_memory_per_gpu_never_removes_a_layout_and_h200_is_faster():
    model = BLOOM_SIZES["7B1"]
    a100 = plan_layouts(model, GPUS["A100-40GB"], CLUSTERS["dgx-a100"], 16, 2048, 512)
    a100_80 = plan_layouts(model, GPUS["A100-80GB"], CLUSTERS["dgx-a100"], 16, 2048, 512)
    assert {p.layout for p in a100} <= {p.layout for p in a100_80}
    h200 = plan_layouts(model, GPUS["H200-141GB"], CLUSTERS["dgx-h100"], 16, 2048, 512)
    assert h200[0].step.step_s < a100_80[0].step.step_s / 2


def test_fp16_with_zero_0_is_20_bytes_per_parameter_at_the_peak_and_zero_1_is_not_modelled():
    fp16 = Layout(tp=1, pp=1, dp=4, micro_batch_size=1, zero_stage=0, precision="fp16")
    assert sum(static_bytes(1000, fp16).values()) == 20 * 1000  # FP16_UnfusedOptimizer: nothing sharded over DP
    with pytest.raises(ValueError, match="fp16' with ZeRO stage 1 is not modelled"):
        static_bytes(1000, Layout(tp=1, pp=1, dp=4, micro_batch_size=1, zero_stage=1, precision="fp16"))


def test_given_stage_layers_replace_the_partition_rule():
    model = BLOOM_SIZES["1B3"]
    even, uneven = (Layout(tp=1, pp=2, dp=1, micro_batch_size=1, stage_layers=layers) for layers in (None, (20, 4)))
    weights = [[stage["weights"] for stage in estimate_memory(model, lay, 2048, 8).per_stage] for lay in (even, uneven)]
    assert [b - a for a, b in zip(*weights)] == [2 * 8 * model.layer_params(), -2 * 8 * model.layer_params()]
    with pytest.raises(ValueError, match="must give 2 stages holding 24 layers"):
        estimate_memory(model, Layout(tp=1, pp=2, dp=1, micro_batch_size=1, stage_layers=(20, 3)), 2048, 8)


def test_zero2_and_zero3_bytes_and_communication_by_hand():
    """ZeRO-2 / ZeRO-3 (no pipeline): the static bytes per rank and the data-parallel traffic, by hand."""
    from megatron.planner.memory import static_bytes
    from megatron.planner.performance import _allgather_s, _allreduce_s, _bandwidths, estimate_step
    from megatron.planner.search import candidate_layouts
    from megatron.planner.specs import CLUSTERS, GPUS

    n, d = 1_000_000, 8
    assert static_bytes(n, Layout(1, 1, d, 1, zero_stage=2, precision="bf16")) == {
        "weights": 2 * n, "grad_buffer": 0.0, "master": 4 * n / d, "adam": 8 * n / d, "grads": 4 * n / d}
    assert static_bytes(n, Layout(1, 1, d, 1, zero_stage=3, precision="bf16")) == {
        "weights": 2 * n / d, "grad_buffer": 2 * n / d, "master": 4 * n / d, "adam": 8 * n / d, "grads": 0.0}
    assert static_bytes(n, Layout(1, 1, d, 1, zero_stage=3, precision="fp32"))["weights"] == 4 * n / d

    model = ModelShape(4, 1024, 16, 50304, embed_layernorm=False, learned_positions=0)
    gpu, cluster = GPUS["A100-80GB"], CLUSTERS["dgx-a100"]
    layout = Layout(1, 1, 8, 2, zero_stage=3, precision="bf16")
    step = estimate_step(model, layout, gpu, cluster, 1024, 64)  # 4 micro-batches
    params = model.total_params()
    _, dp_bw, _ = _bandwidths(layout, gpu, cluster)
    one = _allgather_s(2 * params, 8, dp_bw, cluster.collective_latency_us)
    assert step.components_s["dp_comm"] == pytest.approx(4 * 3 * one, rel=F64, abs=0)  # 2 gathers + 1 reduce-scatter each
    # ZeRO-2: each micro-batch all-reduces its gradients whole (measured, megatron.planner.comm_zero), one gather
    zero2 = estimate_step(model, Layout(1, 1, 8, 2, zero_stage=2, precision="bf16"), gpu, cluster, 1024, 64)
    assert zero2.components_s["dp_comm"] == pytest.approx(
        4 * _allreduce_s(2 * params, 8, dp_bw, cluster.collective_latency_us) + one, rel=F64, abs=0)
    # hpZ (groups of 4 DP ranks in one node): a secondary shard of the weights, and the backward gathers in the group
    hpz = Layout(1, 1, 8, 2, zero_stage=3, precision="bf16", hpz=4)
    assert static_bytes(n, hpz)["weights"] == 2 * n / d + 2 * n / 4
    in_group = _allgather_s(2 * params, 4, gpu.nvlink_busbw_gbps, cluster.collective_latency_us)
    assert estimate_step(model, hpz, gpu, cluster, 1024, 64).components_s["dp_comm"] == pytest.approx(
        4 * (2 * one + in_group), rel=F64, abs=0)
    # ZeRO-2/3 are candidates only without the pipeline, and never at DP 1; hpZ one group per node
    layouts = candidate_layouts(model, 16, 8, 64)
    assert {(lay.pp, lay.zero_stage) for lay in layouts if lay.zero_stage >= 2} == {(1, 2), (1, 3)}
    assert all(lay.dp > 1 for lay in layouts if lay.zero_stage >= 1)
    assert {(lay.tp, lay.dp, lay.hpz) for lay in layouts if lay.hpz > 1} == {(1, 16, 8), (2, 8, 4), (4, 4, 2)}
    # with Ulysses the groups are cut from dp x u ranks (megatron.engine.model_engine.hpz_group_ranks)
    ulysses = candidate_layouts(model, 16, 8, 64, ulysses_sizes=(2,))
    zero3 = {(lay.tp, lay.dp, lay.ulysses) for lay in ulysses if lay.zero_stage == 3 and lay.hpz == 1}
    assert {(lay.tp, lay.dp, lay.ulysses, lay.hpz) for lay in ulysses if lay.hpz > 1} == \
        {(t, d, u, 8 // t) for t, d, u in zero3 if 1 < 8 // t < d * u and d * u % (8 // t) == 0} != set()


def test_pipeline_sends_cross_nodes_at_the_activations_width_by_hand():
    """PP across nodes (4 GPUs a node, TP=2 x DP=2 a stage): each micro-batch's activation and gradient, 1/t of
    [s, b, h] per rank at 4 bytes in fp32 and 2 in bf16, over the per-GPU inter-node bandwidth, plus the TP
    all-gathers, charged in every slot of the 1F1B pipeline (m + p - 1 of them); the tied embedding's fp32 gradient
    all-reduced between the first and the last stage (benchmarks/bench_multinode.py measures this layout)."""
    from megatron.planner.performance import _allgather_s, _allreduce_s
    from megatron.planner.specs import ClusterSpec

    model = ModelShape(2, 64, 4, 512)
    gpu, cluster = GPUS["A100-80GB"], ClusterSpec("two-nodes", 4, 0.01)
    s, b, t, m = 32, 2, 2, 4
    for precision, width in (("fp32", 4), ("bf16", 2)):
        step = estimate_step(model, Layout(t, 2, 2, b, recompute=False, zero_stage=0, precision=precision), gpu,
                             cluster, s, 16)
        activation = width * s * b * 64
        slot = 2 * (activation / t / (cluster.inter_node_gbps * 1e9) + cluster.p2p_latency_us * 1e-6)
        slot += 3 * _allgather_s(activation, t, gpu.nvlink_busbw_gbps, cluster.collective_latency_us)
        assert step.components_s["pp_comm"] == pytest.approx((m + 1) * slot, rel=F64, abs=0), precision
        tied = _allreduce_s(4 * 512 * 64 / t, 2, cluster.inter_node_gbps, cluster.collective_latency_us)
        assert step.components_s["tied_embedding"] == pytest.approx(tied, rel=F64, abs=0), precision
