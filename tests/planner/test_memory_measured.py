"""The planner's static-memory formula against the bytes a real engine holds after a step.

One 2-process launch trains a tiny BLOOM-style model as (TP, PP, DP) = (1, 1, 2) in bf16
(BF16_Optimizer: masters and Adam states sharded over the 2 DP ranks) and in fp32; the measured
weights, gradients, fp32 masters and Adam states of each rank must match the formula within 10%
(they match to the DP padding of the flat buffers).
"""

import pytest

from megatron.testing import run_distributed, tiny_argv


def _run(rank, world_size, runs):
    from megatron.planner.measure import run_recorded

    return [run_recorded(argv, world_size) for argv in runs]


@pytest.mark.multiprocess
def test_static_memory_matches_engine_within_10_percent(tiny_corpus):
    from megatron.planner.measure import measured_resident_bytes, predicted_static_bytes

    base = tiny_argv(tiny_corpus, train_iters=2, lr_warmup_iters=1)
    runs = [base + ["--bf16"], base]
    results = run_distributed(_run, world_size=2, args=(runs,), timeout=600)
    for rank, per_rank in enumerate(results):
        bf16, fp32 = per_rank
        assert bf16["optimizer"] == "BF16_Optimizer" and fp32["optimizer"] != "BF16_Optimizer"
        for label, run in (("bf16", bf16), ("fp32", fp32)):
            predicted, measured = predicted_static_bytes(run), measured_resident_bytes(run)
            for part, value in predicted.items():
                assert abs(measured[part] - value) <= 0.10 * max(value, 1), \
                    f"rank {rank} {label} {part}: measured {measured[part]} B, predicted {value:.0f} B"
            total_p, total_m = sum(predicted.values()), sum(measured.values())
            assert abs(total_m / total_p - 1) < 0.02, f"rank {rank} {label}: {total_m} vs {total_p:.0f}"
        # ZeRO-1: each DP rank holds half of the fp32 masters
        assert bf16["static_bytes"]["master"] * 2 == pytest.approx(4 * sum(bf16["group_numels"]), rel=0.01)
