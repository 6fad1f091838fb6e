"""Checkpoints: exact resume, reshaping through universal checkpoints, crash safety, pruning,
architecture checks.

Launches are the expensive part here, so each launch trains several runs in turn. Losses are
compared with a run of 20 iterations straight on (2, 2, 2) (equal to (1, 1, 1) within the tolerance of two
layouts, ``run_tolerance``: see test_equivalence.py).
"""

import json
import os
import shutil

import pytest
import torch

from megatron.checkpoint.integrity import record_checksums
from megatron.testing import DistributedTestError, run_distributed, tiny_argv
from tests.helpers.training import assert_continues, convert_to_universal, pretrain_error, to_universal, train

ITERS = 20
LAYOUT_222 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
LAYOUT_124 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]


def _argv(corpus, *extra, **flags):
    # ZeRO-1 in fp32 and in bf16: the optimizer state is partitioned, as universal conversion expects.
    return tiny_argv(corpus, *extra, **dict(dict(train_iters=ITERS, lr_warmup_iters=2, zero_stage=1), **flags))


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
    results = run_distributed(train, world_size=8, args=(runs,), timeout=900)
    straight, first, resumed, bf16_straight, _ = results[-1]  # the last rank holds the losses
    return {"straight": straight["losses"], "first": first, "resumed": resumed,
            "bf16_straight": bf16_straight["losses"], "fp32_dir": fp32, "bf16_dir": bf16, "root": root}


@pytest.mark.multiprocess
def test_resume_continues_loss_for_loss(trained):
    first, resumed = trained["first"], trained["resumed"]
    assert first["iterations"] == list(range(1, 11)) and first["reason"] == "exit-interval"
    assert resumed["iterations"] == list(range(11, 21))
    assert first["losses"] + resumed["losses"] == trained["straight"]  # bit for bit


@pytest.mark.multiprocess
def test_reshape_through_universal_checkpoints(trained, tiny_corpus):
    fp32, bf16, root = trained["fp32_dir"], trained["bf16_dir"], trained["root"]
    to_universal(os.path.join(fp32, "global_step10"))
    to_universal(os.path.join(bf16, "global_step10"))
    one = str(root / "fp32_111")
    # (2,2,2) -> (1,1,1) in fp32 and bf16; then, to show the flag is not sticky, the (1,1,1) run saves at
    # iteration 15 in its own layout and a plain --load continues from there.
    runs = [
        _argv(tiny_corpus, load=fp32, universal_checkpoint=True, save=one, save_interval=5, exit_interval=15),
        _argv(tiny_corpus, load=one, save=one, save_interval=100),
        _argv(tiny_corpus, "--bf16", load=bf16, universal_checkpoint=True),
        _argv(tiny_corpus, save=str(root / "fp32_111_first"), save_interval=100, exit_interval=10),
    ]
    to_111, plain, bf16_111, first_111 = run_distributed(train, world_size=1, args=(runs,), timeout=600)[0]
    assert to_111["iterations"] == list(range(11, 16)) and plain["iterations"] == list(range(16, 21))
    assert_continues(trained["straight"], to_111["losses"] + plain["losses"], "(2,2,2) -> (1,1,1) fp32",
                     dtype=torch.float32)
    assert_continues(trained["bf16_straight"], bf16_111["losses"], "(2,2,2) -> (1,1,1) bf16", dtype=torch.bfloat16)

    # (1,1,1) -> (2,2,2) and (2,2,2) -> (1,2,4).
    to_universal(os.path.join(str(root / "fp32_111_first"), "global_step10"))
    runs = [_argv(tiny_corpus, load=str(root / "fp32_111_first"), universal_checkpoint=True) + LAYOUT_222,
            _argv(tiny_corpus, load=fp32, universal_checkpoint=True) + LAYOUT_124]
    to_222, to_124 = run_distributed(train, world_size=8, args=(runs,), timeout=900)[-1]
    assert_continues(trained["straight"], to_222["losses"], "(1,1,1) -> (2,2,2) fp32", dtype=torch.float32)
    assert_continues(trained["straight"], to_124["losses"], "(2,2,2) -> (1,2,4) fp32", dtype=torch.float32)


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
    return train(rank, world_size, [argv])


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
    resumed = run_distributed(train, world_size=2, args=([argv + ["--load", save]],), timeout=300)[-1][0]
    assert resumed["iterations"] == [4, 5, 6, 7, 8, 9]
    assert open(os.path.join(save, "latest")).read().strip() == "global_step9"


@pytest.mark.multiprocess
def test_keep_last_n_and_architecture_mismatch(tiny_corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    keep = _argv(tiny_corpus, train_iters=8, save=save, save_interval=2, keep_last_n_checkpoints=2)
    wider = _argv(tiny_corpus, train_iters=8, load=save, hidden_size=96, num_attention_heads=4)
    (kept,), = run_distributed(train, world_size=1, args=([keep],), timeout=300)
    assert sorted(d for d in os.listdir(save) if d.startswith("global_step")) == ["global_step6", "global_step8"]
    with open(os.path.join(save, "global_step8", "run_state.json")) as f:
        assert json.load(f)["progress"]["iteration"] == 8
    with pytest.raises(DistributedTestError, match="hidden_size = 64 but this run has 96"):
        run_distributed(train, world_size=1, args=([wider],), timeout=300)


class _Payload:
    """Unpickling this runs its ``__reduce__`` callable: it would create ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant(path, marker):
    """A crafted file: ``path``'s tensors plus a payload, with checksums that match (as a crafted checkpoint's would)."""
    state = torch.load(path, weights_only=False)
    assert isinstance(state, dict), type(state)
    torch.save(dict(state, extra=_Payload(str(marker))), path)  # still loads as before, by an unsafe loader
    tag_dir = path.split("/zero/")[0] if "/zero/" in path else os.path.dirname(path)
    record_checksums(tag_dir, distributed=False)


def _flip_byte(path, offset=-100):
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0xFF
    open(path, "wb").write(bytes(data))


@pytest.mark.multiprocess
def test_universal_conversion_and_loading_refuse_crafted_and_damaged_files(trained, tiny_corpus, tmp_path):
    """DeepSpeed's converter and universal loader call torch.load(weights_only=False) themselves; ours run
    them with every torch.load made safe and checksums verified on the way in and recorded on the way out."""
    source = os.path.join(trained["fp32_dir"], "global_step10")
    marker = tmp_path / "payload_ran"

    crafted = tmp_path / "crafted"
    shutil.copytree(source, crafted / "global_step10")
    optim = str(crafted / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _plant(optim, marker)
    out = os.path.join(str(crafted), "global_step10_universal")
    proc = convert_to_universal(os.path.join(str(crafted), "global_step10"), out)
    assert proc.returncode != 0 and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in proc.stderr, proc.stderr[-3000:]
    assert "weights_only=True" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists() and not os.path.exists(os.path.join(out, "complete"))

    damaged = tmp_path / "damaged"
    shutil.copytree(source, damaged / "global_step10")
    _flip_byte(str(damaged / "global_step10" / "layer_03-model_00-model_states.pt"))
    out = os.path.join(str(damaged), "global_step10_universal")
    proc = convert_to_universal(os.path.join(str(damaged), "global_step10"), out)
    assert proc.returncode != 0 and "layer_03-model_00-model_states.pt does not match its SHA-256" in proc.stderr
    assert not os.path.exists(out)

    # An intact conversion records a checksum for every file it writes, the per-parameter folders too.
    good = tmp_path / "good"
    shutil.copytree(source, good / "global_step10")
    to_universal(os.path.join(str(good), "global_step10"))
    universal = good / "global_step10_universal"
    with open(universal / "checksums.json") as f:
        recorded = json.load(f)
    written = {os.path.relpath(os.path.join(d, n), universal) for d, _, names in os.walk(universal) for n in names}
    assert set(recorded) == written - {"checksums.json", "complete", "run_state.json"}
    fragments = sorted(name for name in recorded if name.startswith("zero/") and name.endswith("/fp32.pt"))
    assert fragments, sorted(recorded)[:10]

    # Loading it: a crafted fragment (with matching checksums) is refused by name, its payload never runs;
    # a damaged one is named by its checksum.
    crafted_universal = tmp_path / "crafted_universal"
    shutil.copytree(good, crafted_universal)
    _plant(str(crafted_universal / "global_step10_universal" / fragments[0]), marker)
    _flip_byte(str(universal / fragments[-1]))
    runs = [_argv(tiny_corpus, load=str(folder), universal_checkpoint=True, exit_interval=11)
            for folder in (crafted_universal, good)]
    crafted_error, damaged_error = (run_distributed(pretrain_error, world_size=1, args=(argv,), timeout=300)[0]
                                    for argv in runs)
    assert crafted_error and fragments[0] in crafted_error and "weights_only=True" in crafted_error, crafted_error
    assert not marker.exists()
    assert damaged_error and f"{fragments[-1]} does not match its SHA-256" in damaged_error, damaged_error
    assert "ds_to_universal" in damaged_error
