"""Megatron-LM's --calculate-per-token-loss with a loss mask (--eod-mask-loss): a step's loss is the sum of its
counted tokens' losses over the whole global batch divided by their number (megatron.training.token_count), not
the mean of the micro-batches' masked means."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.engine.pipeline import GPTLossFn
from megatron.model.gpt import GPTModel
from megatron.testing import run_distributed
from megatron.testing.tiny_corpus import tiny_argv
from megatron.training.token_count import StepTokenCount
from tests.helpers.model import tiny_config
from tests.helpers.training import assert_same_run, layout, train


def _micro_batches(masked_per_batch):
    """Micro-batches ((ids, positions), (labels, loss_mask)) of 2 x 16 tokens, the first n tokens of each masked."""
    generator = torch.Generator().manual_seed(11)
    out = []
    for n in masked_per_batch:
        ids = torch.randint(0, 256, (2, 17), generator=generator)
        mask = torch.ones(2, 16)
        mask[:, :n] = 0
        out.append(((ids[:, :-1], None), (ids[:, 1:], mask)))
    return out


def test_step_loss_is_the_global_batch_per_token_mean():
    """Four micro-batches counting 32, 20, 8 and 30 tokens: DeepSpeed's mean of the four micro-batch losses (what
    the pipeline engine reports and differentiates) equals plain torch's cross-entropy summed over every counted
    token divided by their number; the mean of masked means does not."""
    torch.manual_seed(0)
    model = GPTModel(tiny_config()).eval()
    batches = _micro_batches([0, 6, 12, 1])
    loss_fn = GPTLossFn(tp_group=None)
    counter = StepTokenCount(loss_fn)
    with torch.no_grad():
        step = list(counter.step_iterator(iter(batches), 4))
        assert loss_fn.tokens_per_micro_batch == (32 + 20 + 8 + 30) / 4
        ours = sum(loss_fn(model(ids), labels) for (ids, _), labels in step) / 4
        counter.end_step()
        means = sum(loss_fn(model(ids), labels) for (ids, _), labels in step) / 4
        logits = [model(ids).float() for (ids, _), _ in step]  # [s, b, v]
    token_losses = torch.cat([F.cross_entropy(lg.permute(1, 2, 0), lab, reduction="none").flatten()
                              for lg, (_, (lab, _)) in zip(logits, step)])
    masks = torch.cat([mask.flatten() for _, (_, mask) in step])
    reference = (token_losses * masks).sum() / masks.sum()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=0)
    assert abs(float(means - reference)) > 1e-3 * float(reference)  # the flag changes the number


def _count_over_ranks(rank, world_size):
    loss_fn = GPTLossFn(tp_group=None)
    batches = _micro_batches([4, 10] if rank == 0 else [0, 16])  # 24 + 12 counted tokens, then 32 + 0
    StepTokenCount(loss_fn, None, world_size).step_iterator(iter(batches), 2)
    return loss_fn.tokens_per_micro_batch


@pytest.mark.multiprocess
def test_count_is_summed_over_data_parallel_ranks_and_runs_end_to_end(tiny_corpus):
    """Each data-parallel rank divides by the global batch's count (its own differs); and a run with the flag
    trains the same at DP = 2 (the count summed over ranks) as at TP = 2 (one rank counts the global batch)."""
    assert run_distributed(_count_over_ranks, world_size=2, timeout=120) == [(36 + 32) / 4] * 2
    base = tiny_argv(tiny_corpus, "--eod-mask-loss", "--calculate-per-token-loss", train_iters=4)
    means = [a for a in base if a != "--calculate-per-token-loss"]
    dp2, tp2, dp2_means = run_distributed(train, world_size=2, args=([base, layout(base, tp=2), means],),
                                          timeout=600)[0]
    assert not dp2["reason"] and dp2["iteration"] == 4
    assert_same_run(dp2, tp2, "per-token loss: TP=2 (one data-parallel rank) vs DP=2")
    assert dp2["losses"][0] != dp2_means["losses"][0]  # the count was used: the same weights, another mean
