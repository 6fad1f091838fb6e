"""The same model, seed and data give the same training run on any (TP, PP, DP) layout.

fp32, no dropout, gloo on CPU: per-iteration losses and grad norms agree within ``run_tolerance`` (megatron/testing/tolerance.py)
with (1,1,1) for (2,1,1), (1,2,1), (1,1,2) and (2,2,2). Launches are expensive here, so
one 2-process launch trains the three 2-rank layouts one after the other, and the 8-process launch
also runs the bf16 (BLOOM) configuration.
"""

import pytest

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import assert_same_run, layout, train

ITERS = 10


@pytest.fixture(scope="module")
def reference_run(tiny_corpus):
    argv = tiny_argv(tiny_corpus, train_iters=ITERS)
    (result,) = run_distributed(train, world_size=1, args=([layout(argv, tp=1, pp=1)],))[0]
    assert len(result["losses"]) == ITERS, result["iterations"]
    # The run must actually learn something, or equal losses would prove little.
    assert result["losses"][-1] < result["losses"][0] - 0.05, result["losses"]
    return argv, result


@pytest.mark.multiprocess
def test_two_rank_layouts_match_single_process(reference_run):
    argv, reference = reference_run
    runs = [layout(argv, tp=2, pp=1), layout(argv, tp=1, pp=2), layout(argv, tp=1, pp=1)]  # the last one is DP=2
    results = run_distributed(train, world_size=2, args=(runs,), timeout=600)
    for rank, per_rank in enumerate(results):
        for (tp, pp, dp), run in zip([(2, 1, 1), (1, 2, 1), (1, 1, 2)], per_rank):
            assert_same_run(reference, run, f"rank {rank} of (tp, pp, dp) = ({tp}, {pp}, {dp})")


@pytest.mark.multiprocess
def test_3d_layout_matches_and_bf16_uses_partitioned_bf16_optimizer(reference_run):
    argv, reference = reference_run
    bf16 = [a for a in argv] + ["--bf16", "--train-iters", "30", "--lr", "3e-3", "--lr-warmup-iters", "3"]
    runs = [layout(argv, tp=2, pp=2), layout(bf16, tp=2, pp=2)]
    results = run_distributed(train, world_size=8, args=(runs,), timeout=900)
    for rank, (fp32_run, bf16_run) in enumerate(results):
        assert_same_run(reference, fp32_run, f"rank {rank} of (2, 2, 2) fp32")
        assert fp32_run["optimizer"] == "GradNormClippingOptimizer"
        assert bf16_run["optimizer"] == "BF16_Optimizer", f"rank {rank}: {bf16_run['optimizer']}"
        # ZeRO-1: each of the 2 DP ranks keeps about half of its stage's fp32 master weights.
        share = bf16_run["master_numel"] / bf16_run["held_numel"]
        assert abs(share - 0.5) < 0.02, f"rank {rank}: holds {share:.3f} of its stage's master weights"
        losses = bf16_run["losses"]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, f"rank {rank}: bf16 loss did not fall: {losses}"
