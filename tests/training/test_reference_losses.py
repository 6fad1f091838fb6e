"""Refactors that do not change the math reproduce the recorded losses bit for bit (on the machine
kind they were recorded on; within tolerance elsewhere), and a checkpoint written by the tree of
2026-12-01 before the structure refactor still resumes exactly. See reference_losses.py."""

import json
import shutil

import pytest

from tests.training.reference_losses import CHECKPOINT_DIR, GOLDEN_FILE, compare, machine, measure


@pytest.mark.multiprocess
def test_recorded_losses_and_an_old_checkpoint_are_reproduced(tiny_corpus, tmp_path):
    recorded = json.loads(GOLDEN_FILE.read_text())
    old_checkpoint = shutil.copytree(CHECKPOINT_DIR, tmp_path / "old_checkpoint")
    measured = measure(tiny_corpus, resume_from=str(old_checkpoint))
    exact = recorded["machine"] == machine()
    assert len(measured["222_bf16_resumed"]["losses"]) == 10  # it resumed at iteration 10, not from scratch
    problems = compare(recorded["runs"], measured, exact)
    assert not problems, f"{'bit-exact' if exact else 'tolerance'} comparison failed:\n" + "\n".join(problems)
