"""Refactors that do not change the math reproduce the recorded losses bit for bit (on each machine
kind they were recorded on; within ``run_tolerance`` elsewhere), and a checkpoint written by the tree of
2026-12-01 before the structure refactor still resumes exactly once converted to BLOOM's numbering
(and is refused, naming the converter, without it). See tests/helpers/reference_losses.py."""

import json

import pytest
import torch

from megatron.testing.tiny_corpus import tiny_argv
from tests.helpers.reference_losses import (
    CHECKPOINT_DIR,
    GOLDEN_FILE,
    compare,
    measure,
    record_for,
    upgraded_checkpoint,
)
from tests.helpers.training import pretrain_error


@pytest.mark.multiprocess
def test_recorded_losses_and_an_old_checkpoint_are_reproduced(tiny_corpus, tmp_path):
    recorded, exact = record_for(json.loads(GOLDEN_FILE.read_text()))
    measured = measure(tiny_corpus, resume_from=upgraded_checkpoint(str(tmp_path / "upgraded")))
    assert len(measured["222_bf16_resumed"]["losses"]) == 10  # it resumed at iteration 10, not from scratch
    problems = compare(recorded["runs"], measured, exact)
    assert not problems, f"{'bit-exact' if exact else 'tolerance'} comparison failed:\n" + "\n".join(problems)


@pytest.mark.multiprocess
def test_a_legacy_checkpoint_is_refused_with_the_conversion_command(tiny_corpus, tmp_path):
    from megatron.testing import run_distributed

    argv = tiny_argv(tiny_corpus, "--bf16", "--load", str(CHECKPOINT_DIR))
    (message,) = run_distributed(pretrain_error, world_size=1, args=(argv,), timeout=300)
    assert message is not None and "tools/convert_checkpoint/upgrade_layout.py" in message, message


def test_the_single_process_reader_reads_both_layouts_alike(tmp_path):
    from megatron.checkpoint.single_process import load_full_state_dict

    old_config, old, _ = load_full_state_dict(str(CHECKPOINT_DIR))
    new_config, new, record = load_full_state_dict(upgraded_checkpoint(str(tmp_path / "upgraded")))
    assert record["checkpoint_layout"] == "bloom" and old_config == new_config
    assert sorted(old) == sorted(new) and all(torch.equal(old[k], new[k]) for k in old)
    files = sorted(p.name for p in (tmp_path / "upgraded" / "global_step10").glob("layer_*-model_00-*"))
    assert files == [f"layer_{i:02d}-model_00-model_states.pt" for i in (1, 3, 4, 6)]  # BLOOM's numbers, L = 2
    embedding = torch.load(tmp_path / "upgraded" / "global_step10" / files[0], weights_only=True)
    assert sorted(embedding) == ["word_embeddings.norm.bias", "word_embeddings.norm.weight", "word_embeddings.weight"]


def test_another_layout_than_the_checkpoints_is_refused_naming_the_conversion(tiny_corpus, tmp_path):
    """Found before any process group: the (2,2,2) checkpoint at TP 1, and at DP 1 with its optimizer."""
    from megatron.arguments import run_config_from_argv
    from megatron.checkpoint.resume import resume_point

    ckpt = upgraded_checkpoint(str(tmp_path / "upgraded"))

    def point(world_size, *flags, **kw):
        return resume_point(run_config_from_argv(tiny_argv(tiny_corpus, "--bf16", *flags, load=ckpt, **kw),
                                                 world_size=world_size))

    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size 2 \(this run: 1\), "
                                         r"--pipeline-model-parallel-size 2 \(this run: 1\).*ds_to_universal.py"):
        point(1)
    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"data-parallel size 2 \(this run: 1\).*--universal-checkpoint"):
        point(4, global_batch_size=8, **layout)
    assert point(4, "--no-load-optim", **layout)[0] == "global_step10"  # weights only: DP does not matter
    assert point(8, **layout)[0] == "global_step10"
