"""The planner's sequence parallelism (Megatron SP) and DeepSpeed-Ulysses: activation bytes by hand,
communication by hand, the search's divisibility rules, and the longest sequence that fits."""

import dataclasses

import pytest
import torch

from megatron.planner import BLOOM_SIZES, CLUSTERS, GPUS, LLAMA_SIZES, ModelShape, estimate_step, plan_layouts
from megatron.planner.candidate import Layout
from megatron.planner.memory import estimate_memory, layer_activation_bytes, static_bytes
from megatron.planner.performance import _allgather_s, _allreduce_s, _alltoall_s
from megatron.planner.search import SEQUENCE_STEP, candidate_layouts, longest_sequence, longest_sequences
from megatron.testing.tolerance import tolerance

# The planner's formulas and the ones written out here are both Python float64 arithmetic of a dozen or so
# operations, in other orders: within 16 roundings in sequence of float64, nothing summed wider
# (megatron.testing.tolerance), relative. Python's float arithmetic is the same on every CPU.
F64 = tolerance(torch.float64, 16, 1)

TINY = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256)  # GELU MLP of 4h


def _layout(**kw):
    return Layout(**{"tp": 2, "pp": 1, "dp": 1, "micro_batch_size": 2, **kw})


def test_layer_activations_by_hand_sp_divides_the_34_and_ulysses_divides_everything():
    # s b h = 32 x 2 x 64 = 4096 elements; 5as/(ht) = 5 * 4 * 32 / (64 * 2) = 5
    s = 32
    assert layer_activation_bytes(TINY, _layout(), s) == 4096 * (10 + 24 / 2 + 5) == 110592
    assert layer_activation_bytes(TINY, _layout(sequence_parallel=True), s) == 4096 * (34 / 2 + 5) == 90112
    assert layer_activation_bytes(TINY, _layout(ulysses=2), s) == 2048 * (10 + 12 + 5) == 55296   # s/u tokens
    assert layer_activation_bytes(TINY, _layout(sequence_parallel=True, ulysses=2), s) == 2048 * 22 == 45056
    # the scores are [a/(t u), s, s] per rank: at u = 4 the 5as/(ht) term keeps the full s
    assert layer_activation_bytes(TINY, _layout(tp=1, ulysses=4), s) == 1024 * (34 + 10) == 45056
    # a fused kernel keeps no scores; SP at t = 1 changes nothing
    assert layer_activation_bytes(TINY, _layout(store_attention_scores=False), s) == 4096 * 22
    # ... but its output, beside the all-to-all's context that the dense projection keeps under Ulysses: 2 / t more
    assert layer_activation_bytes(TINY, _layout(store_attention_scores=False, ulysses=2), s) == 2048 * (22 + 1)
    assert layer_activation_bytes(TINY, _layout(tp=1, sequence_parallel=True), s) == \
        layer_activation_bytes(TINY, _layout(tp=1), s) == 4096 * (34 + 10)
    # fp32: 4 x 4 + 2 outside TP, (2 + 2) x 4 + 2 x 4 x 4 inside, (2 x 4 + 1) as/h scores
    assert layer_activation_bytes(TINY, _layout(tp=1), s, 4) == 4096 * (18 + 48 + 9 * 4 * 32 / 64)
    # an SP that keeps the all-gathered QKV and MLP inputs: those 2 x 2 bytes stay whole
    assert layer_activation_bytes(TINY, _layout(sequence_parallel=True), s, sp_saves_gathered_inputs=True) == \
        4096 * (4 + 6 / 2 + 12 + 5)


def test_gqa_and_swiglu_shapes_under_sp_and_ulysses():
    llama = LLAMA_SIZES["llama-3-8b"]      # 8 key / value heads of 32, SwiGLU f = 14336
    s, h = 8192, 4096
    tp_region = 4 + 4 * 1024 / h + 8 * 14336 / h
    both = Layout(tp=2, pp=1, dp=1, micro_batch_size=1, sequence_parallel=True, ulysses=4)
    assert layer_activation_bytes(llama, both, s) == pytest.approx(
        s / 4 * h * ((10 + tp_region) / 2 + 5 * 32 * s / (h * 2)), rel=F64, abs=0)


def test_memory_splits_layer_inputs_logits_and_zero_shards_over_dp_times_ulysses():
    model, s = BLOOM_SIZES["1B3"], 4096
    plain = Layout(tp=2, pp=1, dp=4, micro_batch_size=1, recompute=True, zero_stage=3)
    uly = dataclasses.replace(plain, dp=1, ulysses=4)
    assert uly.world_size == plain.world_size == 8 and uly.weight_replicas == 4
    assert static_bytes(1000, uly) == static_bytes(1000, plain)  # ZeRO-3 over the 4 ranks either way
    a, b = (estimate_memory(model, lay, s, 8).per_stage[0]["activations"] for lay in (plain, uly))
    # every term is for s/4 tokens: checkpointed inputs, two full layers, embedding mask, logits
    assert b == pytest.approx(a / 4, rel=F64, abs=0)
    sp = dataclasses.replace(plain, sequence_parallel=True)
    h, L = model.hidden_size, model.num_layers
    checkpointed = L * 2 * s * h + s * h  # layer inputs (2 bytes) and the embedding mask (1 byte)
    saved = estimate_memory(model, plain, s, 8).per_stage[0]["activations"] - \
        estimate_memory(model, sp, s, 8).per_stage[0]["activations"]
    full = 2 * (layer_activation_bytes(model, plain, s) - layer_activation_bytes(model, sp, s))
    assert saved == pytest.approx(checkpointed / 2 + full, rel=F64, abs=0)  # SP halves (t = 2) the inputs and mask


def test_sp_moves_the_same_tp_bytes_and_ulysses_adds_all_to_alls_by_hand():
    gpu, model, s = GPUS["A100-80GB"], TINY, 4096
    cluster = dataclasses.replace(CLUSTERS["dgx-a100"], collective_latency_us=0.0)
    bw, L, B = gpu.nvlink_busbw_gbps * 1e9, model.num_layers, 2 * s * 2 * 64   # one [s, b, h] bf16 tensor
    plain = Layout(tp=4, pp=1, dp=2, micro_batch_size=2, recompute=False, zero_stage=1)
    sp = dataclasses.replace(plain, sequence_parallel=True)
    tp_plain = estimate_step(model, plain, gpu, cluster, s, 8).components_s["tp_comm"]
    tp_sp = estimate_step(model, sp, gpu, cluster, s, 8).components_s["tp_comm"]
    m, calls = 2, L * 4 + 2
    assert tp_plain == pytest.approx(m * calls * 2 * 3 / 4 * B / bw, rel=F64, abs=0)
    # reduce-scatter + all-gather per all-reduce (the same bytes), and 2 re-gathers per layer in backward
    assert tp_sp == pytest.approx(tp_plain + m * 2 * L * 3 / 4 * B / bw, rel=F64, abs=0)
    assert _allreduce_s(B, 4, 100, 0) == pytest.approx(2 * _allgather_s(B, 4, 100, 0), rel=F64, abs=0)
    # Ulysses u = 4 at t = 1: q, k, v, context of s/4 tokens, 3/4 of each crosses, forward + backward
    uly = Layout(tp=1, pp=1, dp=2, micro_batch_size=2, recompute=False, zero_stage=1, ulysses=4)
    step = estimate_step(model, uly, gpu, cluster, s, 8)
    assert step.components_s["ulysses_comm"] == pytest.approx(m * L * 2 * 4 * 3 / 4 * (B / 4) / bw, rel=F64, abs=0)
    assert step.num_gpus == 8
    # with GQA k and v are narrower; recomputation replays the forward's 4
    gqa = dataclasses.replace(model, num_key_value_heads=1)
    one = _alltoall_s(B / 4, 4, gpu.nvlink_busbw_gbps, 0)
    rec = dataclasses.replace(uly, recompute=True)
    assert estimate_step(gqa, rec, gpu, cluster, s, 8).components_s["ulysses_comm"] == pytest.approx(
        m * L * 3 * (2 * one + 2 * one / 4), rel=F64, abs=0)
    # the gradients are averaged over DP x Ulysses: as a plain layout of DP 8
    dp8 = Layout(tp=1, pp=1, dp=8, micro_batch_size=1, recompute=False, zero_stage=1)
    assert step.components_s["dp_comm"] == pytest.approx(estimate_step(model, dp8, gpu, cluster, s, 8)
                                                         .components_s["dp_comm"], rel=F64, abs=0)


def test_search_refuses_heads_not_divisible_by_tp_times_ulysses():
    model = ModelShape(4, 768, 12, 50304)   # 12 heads
    layouts = candidate_layouts(model, 16, 8, 64, ulysses_sizes=(1, 2, 4, 8), sequence_parallel=(False, True))
    pairs = {(lay.tp, lay.ulysses) for lay in layouts}
    assert pairs == {(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)}  # 12 divisible by t*u, t*u <= 8
    gqa = dataclasses.replace(model, num_key_value_heads=2)  # the key / value heads too
    assert {(lay.tp, lay.ulysses) for lay in candidate_layouts(gqa, 16, 8, 64, ulysses_sizes=(1, 2, 4, 8))} == \
        {(1, 1), (2, 1), (1, 2)}  # 2 key / value heads: t*u <= 2
    assert all(lay.pp == 1 for lay in layouts if lay.ulysses > 1)
    assert all(lay.tp > 1 for lay in layouts if lay.sequence_parallel)
    assert {lay.sequence_parallel for lay in layouts if lay.tp > 1} == {False, True}
    assert all(lay.world_size == 16 for lay in layouts)
    across = candidate_layouts(ModelShape(4, 1024, 16, 50304), 16, 8, 64, ulysses_sizes=(16,),
                               ulysses_across_nodes=True)
    assert {(lay.tp, lay.ulysses) for lay in across} == {(1, 16)}
    assert not candidate_layouts(ModelShape(4, 1024, 16, 50304), 16, 8, 64, ulysses_sizes=(16,))
    # a sequence the split does not divide is not planned
    plans = plan_layouts(model, GPUS["A100-80GB"], CLUSTERS["dgx-a100"], 8, 1000, 64, ulysses_sizes=(1, 2, 4),
                         sequence_parallel=(False, True))
    assert plans and all(1000 % lay.sequence_split == 0 for lay in (p.layout for p in plans))
    assert {p.layout.sequence_split for p in plans} == {1, 2, 4}


@pytest.mark.parametrize("name", ["7B1", "llama-2-7b"])
def test_longest_sequence_grows_with_sp_ulysses_and_checkpointing_and_is_the_largest(name):
    model, gpu, cluster = {"7B1": BLOOM_SIZES, "llama-2-7b": LLAMA_SIZES}[name][name], GPUS["A100-80GB"], \
        CLUSTERS["dgx-a100"]
    results = {(r.family, r.recompute): r for r in longest_sequences(model, gpu, cluster, 8, 8)}
    for rc in (False, True):
        plain, sp, uly, both = (results[(f, rc)].seq_length for f in ("3D/ZeRO", "+SP", "+Ulysses", "+SP+Ulysses"))
        assert 0 < plain < sp <= both and plain < uly <= both, (rc, plain, sp, uly, both)
    for family in ("3D/ZeRO", "+SP", "+Ulysses", "+SP+Ulysses"):
        assert results[(family, False)].seq_length < results[(family, True)].seq_length
    for r in results.values():
        sp = (False, True) if "SP" in r.family else (False,)
        sizes = (1, 2, 4, 8) if "Ulysses" in r.family else (1,)
        kw = dict(micro_batch_sizes=(1,), recompute=(r.recompute,), sequence_parallel=sp, ulysses_sizes=sizes,
                  zero_stages=(0, 1, 2, 3), store_attention_scores=False)
        assert r.seq_length % SEQUENCE_STEP == 0 and r.plan.fits and r.plan.layout.recompute == r.recompute
        assert any(p.fits for p in plan_layouts(model, gpu, cluster, 8, r.seq_length, 8, **kw))
        assert not any(p.fits for p in plan_layouts(model, gpu, cluster, 8, r.seq_length + SEQUENCE_STEP, 8, **kw))


def test_longest_sequence_is_zero_when_nothing_fits():
    result = longest_sequence(BLOOM_SIZES["176B"], GPUS["A100-40GB"], CLUSTERS["dgx-a100"], 8, 8)
    assert result.seq_length == 0 and result.plan is None
