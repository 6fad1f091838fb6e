"""A pipeline run with a tied embedding on two stages warns nothing about autograd: DeepSpeed's copy of the
tied weight (at construction and after loading a checkpoint) runs without grad (engine/pipeline.py). Before
that fix every backward on both ranks warned "c10d::broadcast_: an autograd kernel was not registered"."""

import pytest

from megatron.testing import run_distributed
from megatron.testing.tiny_corpus import tiny_argv

AUTOGRAD_FALLBACK_WARNING = "an autograd kernel was not registered"


def _train_then_resume_recording_warnings(rank, world_size, first, resumed):
    import warnings

    from megatron.arguments import run_config_from_argv
    from megatron.training.pretrain import pretrain

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every occurrence, not once per location
        losses = []
        for argv in (first, resumed):
            result = pretrain(run_config_from_argv(argv, world_size=world_size))
            losses.append([r.loss for r in result.history])
    return losses, [str(w.message) for w in caught if AUTOGRAD_FALLBACK_WARNING in str(w.message)]


@pytest.mark.multiprocess
def test_a_two_stage_run_and_its_resume_print_no_autograd_fallback_warning(tiny_corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    flags = dict(pipeline_model_parallel_size=2, global_batch_size=4, lr_warmup_iters=1, save=save, save_interval=2)
    first = tiny_argv(tiny_corpus, train_iters=2, **flags)
    resumed = tiny_argv(tiny_corpus, "--override-lr-scheduler", train_iters=3, load=save, **flags)
    results = run_distributed(_train_then_resume_recording_warnings, world_size=2, args=(first, resumed),
                              timeout=300)
    for rank, (losses, fallback_warnings) in enumerate(results):
        assert [len(run) for run in losses] == [2, 1], f"rank {rank}: {losses}"  # the second run resumed
        assert fallback_warnings == [], f"rank {rank}: {fallback_warnings[:1]}"
