"""The planner's pipeline schedules (megatron.planner.schedule_costs) against the schedules themselves.

1F1B and ZB-H1: the engine's instruction streams (DeepSpeed's TrainSchedule, our ZeroBubbleH1Schedule) replayed,
counting the micro-batches in flight and the W passes waiting after every instruction; the planner's peak per
stage must be the streams' at any ratio of a W pass's bytes to a micro-batch's activations, and its bubble the
idle slots the registry's timeline (``megatron.config.schedules.idle_slots``) counts. Interleaved: Megatron-LM's
order (warm-up, then one forward and one backward) replayed for the in-flight peak. Then the refusals, the step
estimate and the search.
"""

import dataclasses

import pytest
import torch

from megatron.config.schedules import REGISTRY, idle_slots
from megatron.engine.schedules import ENGINE_CLASSES
from megatron.engine.schedules.streams import schedule_streams
from megatron.planner import (
    BLOOM_SIZES,
    CLUSTERS,
    GPUS,
    LLAMA_SIZES,
    Layout,
    ModelShape,
    estimate_memory,
    estimate_step,
    plan_layouts,
)
from megatron.planner.memory import activation_terms, head_weight_pass_bytes, weight_pass_bytes
from megatron.planner.schedule_costs import (
    bubble_fraction,
    bubble_slots,
    check_schedule,
    first_chunk_in_flight,
    in_flight,
    p2p_bytes_per_step,
    peak_units,
    warmup_chunk_forwards,
)
from megatron.testing.tolerance import tolerance

# The planner's formulas and the ones written out here are both Python float64 arithmetic of a dozen or so
# operations, in other orders: within 16 roundings in sequence of float64, nothing summed wider
# (megatron.testing.tolerance), relative. Python's float arithmetic is the same on every CPU.
F64 = tolerance(torch.float64, 16, 1)

LAYOUTS = [(2, 2), (2, 8), (3, 5), (4, 4), (4, 16), (8, 8), (8, 24), (12, 48)]  # (stages, micro-batches)


def _stream_peak(stream, activations: float, weight_pass: float) -> float:
    held = waiting = peak = 0
    for name in stream:
        held += (name == "ForwardPass") - (name == "BackwardPass")
        waiting += (name == "BackwardPass") * ("WeightPass" in stream) - (name == "WeightPass")
        peak = max(peak, held * activations + waiting * weight_pass)
    return peak


@pytest.mark.parametrize("stages, micro_batches", LAYOUTS)
@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_peak_and_bubble_are_the_engine_schedules(schedule, stages, micro_batches):
    schedule_class, costs = ENGINE_CLASSES[schedule].schedule_class, REGISTRY[schedule].unit_costs
    streams = schedule_streams(schedule_class, stages, micro_batches)
    for ratio in (0.3, 1.0, 2.5):  # W bytes / activation bytes: recomputation makes it large
        for stage, stream in enumerate(streams):
            assert peak_units(schedule, stages, micro_batches, stage, 1.0, ratio) == \
                pytest.approx(_stream_peak(stream, 1.0, ratio), rel=F64, abs=0), (schedule, stage, ratio)
    idle = idle_slots(streams, costs)[0] / 3  # in slots of F + B + W
    assert bubble_slots(schedule, stages) == pytest.approx(idle, rel=F64, abs=0)
    assert bubble_fraction(schedule, stages, micro_batches) == pytest.approx(idle / (micro_batches + idle), rel=F64, abs=0)


def _interleaved_peak(pp: int, v: int, m: int, rank: int) -> tuple[int, int]:
    """Megatron-LM's interleaved order on ``rank``: (most chunk micro-batches in flight, most in chunk 0)."""
    warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, m * v)
    chunk_of = [(k // pp) % v for k in range(m * v)]  # forward k's chunk; backward k's is v - 1 - that
    order = [("F", k) for k in range(warmup)]
    for k in range(m * v - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(m * v - warmup, m * v)]
    held, peak = set(), (0, 0)
    for kind, k in order:
        if kind == "F":
            held.add((chunk_of[k], k))
        else:  # backward k undoes the k-th forward of chunk v - 1 - chunk_of[k], oldest first
            chunk = v - 1 - chunk_of[k]
            held.remove(min(item for item in held if item[0] == chunk))
        peak = (max(peak[0], len(held)), max(peak[1], sum(1 for c, _ in held if c == 0)))
    return peak


@pytest.mark.parametrize("pp, v, m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (4, 2, 4), (8, 3, 16), (12, 2, 24)])
def test_interleaved_in_flight_is_megatrons_order(pp, v, m):
    for rank in range(pp):
        most, _ = _interleaved_peak(pp, v, m, rank)
        assert in_flight("interleaved", pp, m, rank, v) * v == pytest.approx(most, rel=F64, abs=0), rank
        assert most == min(warmup_chunk_forwards(pp, v, m, rank) + 1, m * v)
    if m * v > warmup_chunk_forwards(pp, v, m, 0):  # enough micro-batches that the warm-up is not all of them:
        # rank 0 holds p + (p - 1) / v micro-batches of its layers (1F1B: p), the last p - (p - 1) / v (1F1B: 1)
        assert in_flight("interleaved", pp, m, 0, v) == pytest.approx(pp + (pp - 1) / v, rel=F64, abs=0)
        assert in_flight("interleaved", pp, m, pp - 1, v) == pytest.approx(pp - (pp - 1) / v, rel=F64, abs=0)
    assert first_chunk_in_flight(pp, m, v) == _interleaved_peak(pp, v, m, 0)[1]


def test_interleaved_bubble_and_p2p():
    assert bubble_fraction("interleaved", 12, 48, 2) == pytest.approx(11 / (2 * 48 + 11), rel=F64, abs=0)
    assert bubble_slots("interleaved", 12, 2) == pytest.approx(bubble_slots("1f1b", 12) / 2, rel=F64, abs=0)
    one, two = (p2p_bytes_per_step(name, 4, 8, 100.0, v, tp=2) for name, v in (("1f1b", 1), ("interleaved", 2)))
    assert (one["per_rank"], two["per_rank"]) == (2 * 8 * 100 / 2, 2 * 2 * 8 * 100 / 2)
    assert (one["pipeline"], two["pipeline"]) == (2 * 8 * 3 * 100, 2 * 8 * 7 * 100)


@pytest.mark.parametrize("args, match", [
    (("zbh1", 4, 2, 8), "at least 4 micro-batches"),
    (("zbh1", 2, 4, 8, 1, "fp32", 1), "needs ZeRO stage 0"),
    (("interleaved", 4, 8, 70, 2), "70 layers do not split into PP 4 x 2"),
    (("interleaved", 4, 6, 8, 2), r"\(6\) to be a multiple of 4"),
])
def test_layouts_a_schedule_cannot_run_are_refused_naming_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        check_schedule(*args)
    with pytest.raises(ValueError, match="interleaved runs v >= 2"):
        Layout(1, 2, 1, 1, schedule="interleaved")


def test_step_estimate_uses_each_schedules_bubble():
    model = LLAMA_SIZES["llama-3-70b"]
    base = Layout(8, 4, 2, 1, recompute=False)
    gpu, cluster = GPUS["H100-80GB"], CLUSTERS["dgx-h100"]
    steps = {(name, v): estimate_step(model, dataclasses.replace(base, schedule=name, virtual_stages=v), gpu,
                                      cluster, 4096, 64) for name, v in (("1f1b", 1), ("zbh1", 1), ("interleaved", 2))}
    one, zbh1, inter = steps.values()
    assert one.bubble_s == pytest.approx(3 * one.slot_s, rel=F64, abs=0)
    assert inter.bubble_s == pytest.approx(1.5 * inter.slot_s, rel=F64, abs=0) and inter.slot_s > one.slot_s  # 2x the p2p sends
    # (p - 1)(F + B - W): a third of 1F1B's at F = B = W; more here, where the slot's communication, attention and
    # elementwise passes are not weight GEMMs that W could take (W < F)
    assert one.slot_s == zbh1.slot_s and one.bubble_s / 3 < zbh1.bubble_s < one.bubble_s
    assert zbh1.step_s < one.step_s and inter.step_s < one.step_s


def test_zbh1_holds_its_waiting_w_passes_and_the_heads_logits_gradient():
    model = ModelShape(8, 64, 4, 512)
    one, zbh1 = (Layout(1, 4, 1, 2, recompute=False, precision="fp32", zero_stage=0, schedule=name)
                 for name in ("1f1b", "zbh1"))
    a, b = (activation_terms(model, lay, 32, 16) for lay in (one, zbh1))
    w = 2 * weight_pass_bytes(model, zbh1, 32, 4)
    assert b[0]["saved"] == a[0]["saved"]  # stage 0: 4 micro-batches in flight, then 1 W
    # last stage: its one micro-batch (1F1B's figure) beside 3 W passes (2 layers and the head each), or 4 W
    # passes once that micro-batch is back-propagated
    w += head_weight_pass_bytes(model, zbh1, 32, 4)
    assert b[3]["saved"] == pytest.approx(max(a[3]["saved"] + 3 * w, 4 * w), rel=F64, abs=0)
    assert b[3]["saved"] > 3 * a[3]["saved"]
    assert [t["logits"] for t in a] == [t["logits"] for t in b]


def test_the_search_chooses_among_the_schedules_where_they_run():
    model, gpu, cluster = LLAMA_SIZES["llama-3-70b"], GPUS["H100-80GB"], CLUSTERS["dgx-h100"]
    kwargs = dict(micro_batch_sizes=(1,), recompute=(True,), zero_stages=(1,))
    every = plan_layouts(model, gpu, cluster, 64, 4096, 128, schedules=("1f1b", "zbh1", "interleaved"),
                         virtual_stages=(2, 4), **kwargs)
    plain = plan_layouts(model, gpu, cluster, 64, 4096, 128, **kwargs)
    assert {p.layout.schedule for p in plain} == {"1f1b"}
    assert {(p.layout.schedule, p.layout.virtual_stages) for p in every} >= {("zbh1", 1), ("interleaved", 2),
                                                                             ("interleaved", 4)}
    for plan in every:
        lay, m = plan.layout, plan.num_micro_batches
        if lay.schedule == "zbh1":
            assert m >= lay.pp
        if lay.schedule == "interleaved":
            assert model.num_layers % (lay.pp * lay.virtual_stages) == 0 and m % lay.pp == 0
    fitting = [p for p in every if p.fits]
    assert fitting[0].step.step_s <= [p for p in plain if p.fits][0].step.step_s
    pipelined = [p for p in fitting if p.layout.pp > 1]
    assert pipelined[0].layout.schedule != "1f1b"  # with a pipeline, a schedule with less bubble wins
    with pytest.raises(ValueError, match="not plannable"):
        plan_layouts(model, gpu, cluster, 64, 4096, 128, schedules=("gpipe",))


def _figures(model, base, gpu, cluster, seq, gbs, schedule, v=1, recompute=True):
    """(bubble slots, % of the step, busiest stage's activations in GiB, peak GiB per GPU) as the docs give them."""
    lay = dataclasses.replace(base, schedule=schedule, virtual_stages=v, recompute=recompute)
    step = estimate_step(model, lay, GPUS[gpu], CLUSTERS[cluster], seq, gbs)
    acts = max(sum(t.values()) for t in activation_terms(model, lay, seq, gbs)) / 2 ** 30
    memory = estimate_memory(model, lay, seq, gbs).peak / 2 ** 30
    return round(step.bubble_s / step.slot_s, 2), round(100 * step.bubble_s / step.step_s, 1), round(acts, 1), round(memory, 1)


def test_the_docs_schedule_tables():
    """docs/parallelism.md, "Choosing a pipeline schedule": BLOOM-176B's and Llama-3-70B's rows."""
    bloom = Layout(4, 12, 8, 2, True, 1, "bf16", "type:transformer|embedding", store_attention_scores=False)
    args = (BLOOM_SIZES["176B"], bloom, "A100-80GB", "jean-zay-a100", 2048, 2048)
    assert _figures(*args, "1f1b") == (11.0, 7.7, 9.0, 47.2)
    assert _figures(*args, "zbh1") == (5.96, 4.3, 57.1, 95.4)
    llama = Layout(8, 4, 2, 1, True, 1, "bf16", store_attention_scores=False)
    args = (LLAMA_SIZES["llama-3-70b"], llama, "H100-80GB", "dgx-h100", 4096, 256)
    assert _figures(*args, "1f1b") == (3.0, 2.3, 6.0, 38.6)
    assert _figures(*args, "zbh1") == (2.09, 1.6, 30.2, 62.8)
    assert _figures(*args, "interleaved", 2) == (1.5, 1.1, 8.0, 40.6)
    assert _figures(*args, "interleaved", 4) == (0.75, 0.6, 7.1, 39.7)
    assert _figures(*args, "1f1b", recompute=False) == (3.0, 2.3, 35.7, 68.3)
    assert _figures(*args, "zbh1", recompute=False) == (1.83, 1.4, 35.7, 68.3)
    plans = plan_layouts(LLAMA_SIZES["llama-3-70b"], GPUS["H100-80GB"], CLUSTERS["dgx-h100"], 64, 4096, 512,
                         micro_batch_sizes=(1, 2), recompute=(True,), zero_stages=(1,),
                         schedules=("1f1b", "zbh1", "interleaved"), virtual_stages=(2, 4))
    best = next(p.layout for p in plans if p.fits and p.layout.pp > 1)
    assert best.short() == "TP=4 PP=4 DP=4 MBS=2 recompute ZeRO-1 bf16 interleaved 1F1B v=4"
