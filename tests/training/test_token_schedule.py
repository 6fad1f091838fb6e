"""Megatron-DeepSpeed's token-based schedule in a training run: the learning rate logged at each iteration is its
formula's at the tokens consumed by then, and --train-tokens ends the run."""

from __future__ import annotations

import math

import pytest

from megatron.testing import run_distributed
from megatron.testing.tiny_corpus import tiny_argv
from tests.helpers.training import train


def _mds_lr(tokens, *, max_lr=1e-3, min_lr=1e-4, warmup=600, decay=1300):
    """Megatron-DeepSpeed's OptimizerParamScheduler.get_lr with lr_warmup_tokens / lr_decay_tokens, cosine."""
    if tokens <= warmup:
        return max_lr * tokens / warmup
    if tokens > decay:
        return min_lr
    ratio = (tokens - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


@pytest.mark.multiprocess
def test_run_follows_the_token_schedule_and_stops_on_its_token_budget(tiny_corpus):
    """8 samples of 32 tokens per iteration (256 tokens): the warm-up (600 tokens) and the decay (1300) end inside
    iterations; --train-tokens 1500 stops the run after 6 iterations (1536 tokens), before --train-iters 10."""
    argv = tiny_argv(tiny_corpus, "--lr-warmup-tokens", "600", "--lr-decay-tokens", "1300", "--train-tokens", "1500",
                     lr_warmup_iters=None)
    (run,) = run_distributed(train, world_size=1, args=([argv],), timeout=300)[0]
    assert run["iteration"] == 6 and run["iterations"] == [1, 2, 3, 4, 5, 6]
    assert run["lrs"] == pytest.approx([_mds_lr(256 * i) for i in range(1, 7)], rel=1e-12, abs=0)
