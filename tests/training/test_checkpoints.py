"""Checkpoints: exact resume, reshaping through universal checkpoints, crash safety, pruning,
architecture checks.

Launches are the expensive part here, so each launch trains several runs in turn. Losses are
compared with a run of 20 iterations straight on (2, 2, 2) (equal to (1, 1, 1) within 1e-5, see
test_equivalence.py).
"""

import json
import os
import subprocess
import sys

import pytest

from megatron.testing import DistributedTestError, run_distributed, tiny_argv
from tests.conftest import REPO_ROOT
from tests.training.helpers import run_single

ITERS = 20
LAYOUT_222 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
LAYOUT_124 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]


def _argv(corpus, *extra, **flags):
    # ZeRO-1 in fp32 and in bf16: the optimizer state is partitioned, as universal conversion expects.
    return tiny_argv(corpus, *extra, **dict(dict(train_iters=ITERS, lr_warmup_iters=2, zero_stage=1), **flags))


def _losses(run):
    return [loss for _, loss, *_ in run["history"]]


def _iterations(run):
    return [it for it, *_ in run["history"]]


def _assert_continues(reference, tail, rel, label):
    expected = reference[-len(tail):]
    for i, (a, b) in enumerate(zip(expected, tail)):
        assert abs(a - b) <= rel * abs(a), f"{label}: iteration {ITERS - len(tail) + i + 1}: loss {b} vs {a} straight"


def _to_universal(ckpt, tag):
    out = os.path.join(ckpt, f"{tag}_universal")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools/convert_checkpoint/ds_to_universal.py"),
                           "--input_folder", os.path.join(ckpt, tag), "--output_folder", out],
                          capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert os.path.isfile(os.path.join(out, "complete"))


@pytest.fixture(scope="module")
def trained(tiny_corpus, tmp_path_factory):
    """On (2,2,2): 20 iterations straight (fp32 and bf16); 10 then save (fp32 and bf16); 10 more by resuming."""
    root = tmp_path_factory.mktemp("ckpt")
    fp32, bf16 = str(root / "fp32_222"), str(root / "bf16_222")
    runs = [
        _argv(tiny_corpus) + LAYOUT_222,
        _argv(tiny_corpus, save=fp32, save_interval=100, exit_interval=10) + LAYOUT_222,
        _argv(tiny_corpus, save=fp32, save_interval=100, load=fp32) + LAYOUT_222,
        _argv(tiny_corpus, "--bf16") + LAYOUT_222,
        _argv(tiny_corpus, "--bf16", save=bf16, save_interval=100, exit_interval=10) + LAYOUT_222,
    ]
    results = run_distributed(run_single, world_size=8, args=(runs,), timeout=900)
    straight, first, resumed, bf16_straight, _ = results[-1]  # the last rank holds the losses
    return {"straight": _losses(straight), "first": first, "resumed": resumed, "bf16_straight": _losses(bf16_straight),
            "fp32_dir": fp32, "bf16_dir": bf16, "root": root}


@pytest.mark.multiprocess
def test_resume_continues_loss_for_loss(trained):
    first, resumed = trained["first"], trained["resumed"]
    assert _iterations(first) == list(range(1, 11)) and first["reason"] == "exit-interval"
    assert _iterations(resumed) == list(range(11, 21))
    assert _losses(first) + _losses(resumed) == trained["straight"]  # bit for bit


@pytest.mark.multiprocess
def test_reshape_through_universal_checkpoints(trained, tiny_corpus):
    fp32, bf16, root = trained["fp32_dir"], trained["bf16_dir"], trained["root"]
    _to_universal(fp32, "global_step10")
    _to_universal(bf16, "global_step10")
    one = str(root / "fp32_111")
    # (2,2,2) -> (1,1,1) in fp32 and bf16; then, to show the flag is not sticky, the (1,1,1) run saves at
    # iteration 15 in its own layout and a plain --load continues from there.
    runs = [
        _argv(tiny_corpus, load=fp32, universal_checkpoint=True, save=one, save_interval=5, exit_interval=15),
        _argv(tiny_corpus, load=one, save=one, save_interval=100),
        _argv(tiny_corpus, "--bf16", load=bf16, universal_checkpoint=True),
        _argv(tiny_corpus, save=str(root / "fp32_111_first"), save_interval=100, exit_interval=10),
    ]
    to_111, plain, bf16_111, first_111 = run_distributed(run_single, world_size=1, args=(runs,), timeout=600)[0]
    assert _iterations(to_111) == list(range(11, 16)) and _iterations(plain) == list(range(16, 21))
    _assert_continues(trained["straight"], _losses(to_111) + _losses(plain), 1e-5, "(2,2,2) -> (1,1,1) fp32")
    _assert_continues(trained["bf16_straight"], _losses(bf16_111), 2e-2, "(2,2,2) -> (1,1,1) bf16")

    # (1,1,1) -> (2,2,2) and (2,2,2) -> (1,2,4).
    _to_universal(str(root / "fp32_111_first"), "global_step10")
    runs = [_argv(tiny_corpus, load=str(root / "fp32_111_first"), universal_checkpoint=True) + LAYOUT_222,
            _argv(tiny_corpus, load=fp32, universal_checkpoint=True) + LAYOUT_124]
    to_222, to_124 = run_distributed(run_single, world_size=8, args=(runs,), timeout=900)[-1]
    _assert_continues(trained["straight"], _losses(to_222), 1e-5, "(1,1,1) -> (2,2,2) fp32")
    _assert_continues(trained["straight"], _losses(to_124), 1e-5, "(2,2,2) -> (1,2,4) fp32")


def _crash_during_second_save(rank, world_size, argv):
    """Train with saves every 3 iterations; rank 1 dies inside the second save, after DeepSpeed wrote
    its files and before the checkpoint was declared complete."""
    import megatron.checkpoint.training_io as ckpt
    from megatron.checkpoint.tags import tag_for

    real_save = ckpt.save_checkpoint
    calls = {"n": 0}

    def dying_save(engine, save_dir, iteration, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            engine.save_checkpoint(save_dir, tag=tag_for(iteration), client_state={}, save_latest=False)
            if rank == 1:
                os._exit(17)
        return real_save(engine, save_dir, iteration, *args, **kwargs)

    ckpt.save_checkpoint = dying_save
    return run_single(rank, world_size, [argv])


@pytest.mark.multiprocess
def test_kill_during_save_resumes_from_previous_good_checkpoint(tiny_corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    argv = _argv(tiny_corpus, train_iters=9, save=save, save_interval=3, keep_last_n_checkpoints=5) + \
        ["--pipeline-model-parallel-size", "2"]
    with pytest.raises(DistributedTestError, match="rank 1"):
        run_distributed(_crash_during_second_save, world_size=2, args=(argv,), timeout=120)
    assert open(os.path.join(save, "latest")).read().strip() == "global_step3"
    assert os.path.isdir(os.path.join(save, "global_step6"))  # written, never declared complete
    assert not os.path.exists(os.path.join(save, "global_step6", "complete"))

    # A user pointing 'latest' at the broken tag gets the newest complete one instead, with a warning.
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("global_step6")
    resumed = run_distributed(run_single, world_size=2, args=([argv + ["--load", save]],), timeout=300)[-1][0]
    assert _iterations(resumed) == [4, 5, 6, 7, 8, 9]
    assert open(os.path.join(save, "latest")).read().strip() == "global_step9"


@pytest.mark.multiprocess
def test_keep_last_n_and_architecture_mismatch(tiny_corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    keep = _argv(tiny_corpus, train_iters=8, save=save, save_interval=2, keep_last_n_checkpoints=2)
    wider = _argv(tiny_corpus, train_iters=8, load=save, hidden_size=96, num_attention_heads=4)
    (kept,), = run_distributed(run_single, world_size=1, args=([keep],), timeout=300)
    assert sorted(d for d in os.listdir(save) if d.startswith("global_step")) == ["global_step6", "global_step8"]
    with open(os.path.join(save, "global_step8", "run_state.json")) as f:
        assert json.load(f)["progress"]["iteration"] == 8
    with pytest.raises(DistributedTestError, match="hidden_size = 64 but this run has 96"):
        run_distributed(run_single, world_size=1, args=([wider],), timeout=300)
