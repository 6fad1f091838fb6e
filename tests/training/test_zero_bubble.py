"""ZB-H1 (--enable-zbh1-pipeline --enable-zbh1-exact-semantics) trains as 1F1B does, end to end.

fp32, no dropout, 10 iterations, 4 micro-batches per step: PP=4 and TP=2 x PP=2 give the losses and grad norms of
1F1B on the same layout within ``run_tolerance`` (megatron/testing/tolerance.py) (measured identical on AVX2), PP=2 x DP=2
with recomputed activations 1F1B's at PP=4 within it; bf16 equals bf16 1F1B within bf16's and tracks fp32; a 1F1B
checkpoint resumes under ZB-H1 and a ZB-H1 checkpoint under 1F1B, loss for loss. The engine's executed
instruction streams are the schedule generator's, and their idle slots are ZB-H1's analytic bubble. One 4-process
launch trains every run in turn.
"""

import pytest
import torch

from megatron.config.schedules import ZERO_BUBBLE_COSTS, analytic_idle_slots, idle_slots
from megatron.engine.schedules.streams import schedule_streams
from megatron.engine.schedules.zero_bubble import ZeroBubbleH1Schedule
from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import assert_continues, assert_same_run, layout, train

ITERS, HALF = 10, 5
LAYERS = 4  # one per stage at PP=4
ZBH1 = ("--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics")


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    argv = tiny_argv(tiny_corpus, train_iters=ITERS, num_layers=LAYERS)  # 8 sequences of 2: 4 micro-batches
    one_f_one_b, zero_bubble = (str(tmp_path_factory.mktemp(name)) for name in ("1f1b", "zbh1"))
    half = ("--save-interval", 100, "--exit-interval", HALF)
    layouts = {
        "1f1b pp4": layout(argv, pp=4),
        "zbh1 pp4": layout(argv, *ZBH1, pp=4),
        "1f1b tp2 pp2": layout(argv, tp=2, pp=2),
        "zbh1 tp2 pp2": layout(argv, *ZBH1, tp=2, pp=2),
        "1f1b pp4 bf16": layout(argv, "--bf16", pp=4),
        "zbh1 pp4 bf16": layout(argv, *ZBH1, "--bf16", pp=4),
        "zbh1 pp2 dp2 recompute": layout(argv, *ZBH1, "--checkpoint-activations", pp=2),
        "1f1b first half": layout(argv, "--save", one_f_one_b, *half, pp=4),
        "zbh1 first half": layout(argv, *ZBH1, "--save", zero_bubble, *half, pp=4),
        "zbh1 from 1f1b": layout(argv, *ZBH1, "--load", one_f_one_b, pp=4),
        "1f1b from zbh1": layout(argv, "--load", zero_bubble, pp=4),
    }
    results = run_distributed(train, world_size=4, args=(list(layouts.values()),), timeout=900)
    return {rank: dict(zip(layouts, per_rank)) for rank, per_rank in enumerate(results)}


@pytest.mark.multiprocess
def test_zbh1_trains_as_1f1b_at_pp4_and_tp2_pp2(runs):
    for rank, results in runs.items():
        for reference, label in (("1f1b pp4", "zbh1 pp4"), ("1f1b tp2 pp2", "zbh1 tp2 pp2")):
            assert results[label]["engine"] == "ZeroBubblePipelineEngine", (rank, label)
            assert results[reference]["engine"] == "PipelineEngine", (rank, reference)
            assert_same_run(results[reference], results[label], f"rank {rank}: {label}", num_layers=LAYERS)
        assert results["1f1b pp4"]["losses"][-1] < results["1f1b pp4"]["losses"][0] - 0.05  # it learns


@pytest.mark.multiprocess
def test_zbh1_with_data_parallelism_and_recomputation_trains_as_1f1b(runs):
    """PP=2 x DP=2 (2 micro-batches per rank) recomputing activations: the deferred products of the recomputed
    forward, then the DP all-reduce; the same run as 1F1B at PP=4 (another layout: ``run_tolerance``)."""
    for rank, results in runs.items():
        assert_same_run(results["1f1b pp4"], results["zbh1 pp2 dp2 recompute"], f"rank {rank}: zbh1 pp2 dp2", num_layers=LAYERS)


@pytest.mark.multiprocess
def test_zbh1_bf16_tracks_fp32(runs):
    for rank, results in runs.items():
        run = results["zbh1 pp4 bf16"]
        assert run["optimizer"] == "BF16_Optimizer", (rank, run["optimizer"])
        assert_same_run(results["1f1b pp4"], run, f"rank {rank}: zbh1 bf16", dtype=torch.bfloat16, num_layers=LAYERS)
        # against 1F1B in bf16: the same products, added to BF16_Optimizer's fp32 gradients a W pass later
        # (measured identical on the 2-core EPYC, as in fp32)
        assert_same_run(results["1f1b pp4 bf16"], run, f"rank {rank}: zbh1 bf16 vs 1f1b bf16",
                        dtype=torch.bfloat16, num_layers=LAYERS)


@pytest.mark.multiprocess
def test_checkpoints_switch_between_1f1b_and_zbh1(runs):
    for rank, results in runs.items():
        straight = results["1f1b pp4"]["losses"]
        for label in ("1f1b first half", "zbh1 first half"):
            assert results[label]["iteration"] == HALF, (rank, label)
        for label in ("zbh1 from 1f1b", "1f1b from zbh1"):
            run = results[label]
            assert run["iterations"] == list(range(HALF + 1, ITERS + 1)), (rank, label, run["iterations"])
            assert_continues(straight, run["losses"], f"rank {rank}: {label}", dtype=torch.float32, num_layers=LAYERS)


@pytest.mark.multiprocess
def test_executed_streams_are_the_schedule_and_its_bubble(runs):
    """The engines ran the generator's instructions; replayed, their idle slots are (p - 1) per stage."""
    streams = {}
    for rank, results in runs.items():
        run = results["zbh1 pp4"]
        steps = run["executed_steps"]
        streams[run["stage"]] = [name for step in steps for name in step]
        assert streams[run["stage"]] == schedule_streams(ZeroBubbleH1Schedule, 4, 4)[run["stage"]], rank
        assert results["1f1b pp4"]["executed_steps"] is None  # DeepSpeed's own engine
    executed = [streams[stage] for stage in range(4)]
    assert idle_slots(executed, ZERO_BUBBLE_COSTS) == [analytic_idle_slots("zbh1", 4, 4)] * 4
