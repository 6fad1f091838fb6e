"""Interleaved virtual pipeline stages (--num-virtual-stages-per-pipeline-rank) train as 1F1B does.

fp32, no dropout, gloo on CPU, PP = 2 with 4 layers: v = 2 puts layers 0 and 2 on rank 0, 1 and 3 on rank 1.
One 2-process launch trains, in turn: 1F1B for 10 iterations; the same interleaved; each for 5 and a save.
The layer files are BLOOM's either way, but a rank's ZeRO optimizer shard holds the layers of its chunks, so
a regular checkpoint resumes only under its own schedule (refused by name otherwise) and switches schedule
through a universal checkpoint: a second launch resumes each saved run under the other schedule. Losses and
grad norms agree with 1F1B's within 1e-6 (relative) over the 10 iterations and through both resumes.
"""

import os

import pytest

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import assert_same_run, to_universal, train

ITERS = 10
VIRTUAL = ["--num-virtual-stages-per-pipeline-rank", "2"]


def _argv(corpus, *extra, **flags):
    return tiny_argv(corpus, "--pipeline-model-parallel-size", "2", *extra,
                     **dict(dict(num_layers=4, train_iters=ITERS, zero_stage=1), **flags))


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """1F1B and interleaved for 10 iterations; each for 5 and a save, resumed under the other schedule."""
    root = tmp_path_factory.mktemp("interleaved")
    saved_1f1b, saved_interleaved = str(root / "1f1b"), str(root / "interleaved")
    argvs = [
        _argv(tiny_corpus),
        _argv(tiny_corpus, *VIRTUAL),
        _argv(tiny_corpus, save=saved_1f1b, save_interval=100, exit_interval=5),
        _argv(tiny_corpus, *VIRTUAL, save=saved_interleaved, save_interval=100, exit_interval=5),
    ]
    names = ["1f1b", "interleaved", "1f1b_first", "interleaved_first"]
    out = dict(zip(names, run_distributed(train, world_size=2, args=(argvs,), timeout=600)[-1]))  # last stage
    out["refusals"] = [_regular_load_refusal(_argv(tiny_corpus, *VIRTUAL, load=saved_1f1b)),
                       _regular_load_refusal(_argv(tiny_corpus, load=saved_interleaved))]
    for saved in (saved_1f1b, saved_interleaved):
        to_universal(os.path.join(saved, "global_step5"))
    argvs = [_argv(tiny_corpus, *VIRTUAL, load=saved_1f1b, universal_checkpoint=True),
             _argv(tiny_corpus, load=saved_interleaved, universal_checkpoint=True)]
    resumed = run_distributed(train, world_size=2, args=(argvs,), timeout=600)[-1]
    return out | dict(zip(["interleaved_resumed", "1f1b_resumed"], resumed))


def _regular_load_refusal(argv) -> str:
    """The ValueError resuming a regular checkpoint under the other schedule gives, before any launch."""
    from megatron.arguments import run_config_from_argv
    from megatron.checkpoint.resume import resume_point

    with pytest.raises(ValueError) as refused:
        resume_point(run_config_from_argv(argv, world_size=2))
    return str(refused.value)


def _between(run, first, last):
    """``run``'s iterations ``first`` .. ``last`` with their losses and grad norms."""
    keep = [i for i, it in enumerate(run["iterations"]) if first <= it <= last]
    return {key: [run[key][i] for i in keep] for key in ("iterations", "losses", "grad_norms")}


@pytest.mark.multiprocess
def test_interleaved_trains_as_1f1b(runs):
    reference, interleaved = runs["1f1b"], runs["interleaved"]
    assert reference["iterations"] == list(range(1, ITERS + 1))
    assert reference["losses"][-1] < reference["losses"][0] - 0.05, reference["losses"]  # it learns
    assert interleaved["engine"] == "InterleavedPipelineEngine" and reference["engine"] == "PipelineEngine"
    assert_same_run(reference, interleaved, "interleaved v=2 vs 1F1B", rel_loss=1e-6, rel_norm=1e-6)


@pytest.mark.multiprocess
def test_checkpoints_switch_schedules_on_resume(runs):
    reference = runs["1f1b"]
    for first, resumed in (("1f1b_first", "interleaved_resumed"), ("interleaved_first", "1f1b_resumed")):
        assert runs[first]["iterations"] == list(range(1, 6)), first
        assert runs[resumed]["iterations"] == list(range(6, ITERS + 1)), resumed
        assert_same_run(_between(reference, 1, 5), runs[first], first, rel_loss=1e-6, rel_norm=1e-6)
        assert_same_run(_between(reference, 6, ITERS), runs[resumed], f"{resumed} from {first}", rel_loss=1e-6,
                        rel_norm=1e-6)
    for refusal in runs["refusals"]:  # a regular checkpoint's optimizer shards are per rank: convert it once
        assert "--num-virtual-stages-per-pipeline-rank" in refusal and "ds_to_universal.py" in refusal, refusal
