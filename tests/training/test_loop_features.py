"""Loop behaviours on short single-process runs: batch-size rampup, skipped iteration ranges, and
stopping after consecutive non-finite losses."""

import math

import pytest

from megatron.testing import DistributedTestError, run_distributed, tiny_argv
from tests.helpers.training import assert_same_run, train


def _train_with_engine_batch(rank, world_size, argv):
    """Like train, but also record the batch size DeepSpeed was told at each iteration."""
    import megatron.training.loop as loop

    seen = []
    real_step = loop.Trainer.train_step

    def step(self):
        record = real_step(self)
        seen.append(self.engine.train_batch_size())
        return record

    loop.Trainer.train_step = step
    (result,) = train(rank, world_size, [argv])
    result["engine_batch"] = seen
    return result


@pytest.mark.multiprocess
def test_rampup_grows_the_batch_and_tells_deepspeed(tiny_corpus):
    # Start at 4, +2 every 16 / ((8 - 4) / 2) = 8 samples, full size 8 after 16 samples.
    argv = tiny_argv(tiny_corpus, "--rampup-batch-size", "4", "2", "16", train_iters=None, train_samples=64,
                     global_batch_size=8, lr_warmup_iters=None, lr_warmup_samples=8, micro_batch_size=2)
    (result,) = run_distributed(_train_with_engine_batch, world_size=1, args=(argv,))
    batches = [h[4] for h in result["history"]]
    # consumed: 0 -> 4 (bs 4), 4 -> 8 (bs 4), 8 -> 14 (bs 6), 14 -> 20 (bs 6), then 8 until 64.
    assert batches[:5] == [4, 4, 6, 6, 8], batches
    # Training stops at the first step that reaches --train-samples (60 + 8 >= 64), as in Megatron.
    assert sum(batches) == 68 and set(batches[4:]) == {8}
    assert result["engine_batch"] == batches


@pytest.mark.multiprocess
def test_skip_range_and_nonfinite_stop(tiny_corpus):
    skip = tiny_argv(tiny_corpus, "--skip-train-iteration-range", "3-4", train_iters=6)
    (skipped,), = run_distributed(train, world_size=1, args=([skip],))
    history = skipped["history"]
    assert [h[0] for h in history] == [1, 2, 3, 4, 5, 6]
    assert [math.isnan(h[1]) for h in history] == [False, False, True, True, False, False]
    # NaN gradients in iterations 3, 4 and 5 (injected: tests/helpers/faults.py; DeepSpeed skips each step): with
    # --max-nonfinite-steps 3 the first two are let through, the third in a row stops the run.
    blow_up = tiny_argv(tiny_corpus, train_iters=8, max_nonfinite_steps=3)
    with pytest.raises(DistributedTestError, match="iteration 5: 3 consecutive iterations with a non-finite loss"):
        run_distributed(_train_poisoned, world_size=1, args=(blow_up, {3, 4, 5}))


def _train_poisoned(rank, world_size, argv, iterations):
    """``train([argv])`` on this rank with the gradients of ``iterations`` made NaN."""
    from tests.helpers.faults import poison_gradients

    poison_gradients(iterations, math.nan)
    return train(rank, world_size, [argv])


@pytest.mark.multiprocess
def test_activation_checkpointing_replays_dropout_exactly(tiny_corpus):
    # With dropout on and TP=2 (dropout inside the TP region draws from the tracker), recomputing the
    # activations in the backward pass must reproduce the forward's masks: same losses, same grad norms.
    common = dict(train_iters=5, hidden_dropout=0.1, attention_dropout=0.1, tensor_model_parallel_size=2)
    plain = tiny_argv(tiny_corpus, **common)
    recomputed = tiny_argv(tiny_corpus, "--checkpoint-activations", "--checkpoint-num-layers", "1", **common)
    no_dropout = tiny_argv(tiny_corpus, **dict(common, hidden_dropout=0.0, attention_dropout=0.0))
    (a, b, c), _ = run_distributed(train, world_size=2, args=([plain, recomputed, no_dropout],))
    assert [h[1] for h in a["history"]] == [h[1] for h in b["history"]]
    # the forward is replayed op for op (the same losses); the backward runs on recomputed tensors: within tolerance
    assert_same_run({"losses": [h[1] for h in a["history"]], "grad_norms": [h[2] for h in a["history"]]},
                    {"losses": [h[1] for h in b["history"]], "grad_norms": [h[2] for h in b["history"]]},
                    "recomputed activations with dropout")
    assert [h[1] for h in a["history"]] != [h[1] for h in c["history"]]  # dropout was really on
