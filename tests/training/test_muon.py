"""Muon (--optimizer muon) end to end on the tiny model, fp32 (Newton-Schulz in fp32: --muon-fp32-matmul-prec high):
one process learns; in one 4-process launch, each TP = 2 rank's orthogonalised shard of known matrices equals the
reference's (whole matrix for duplicated / distributed, its own shard for blockwise, the QKV rows split), and
TP = 2 x DP = 2 (no ZeRO; ZeRO-1; ZeRO-2 on the model engine), PP = 2 x DP = 2 with ZeRO-1, and bf16 (BF16_Optimizer)
train as the one process does (``assert_same_run``: within ``run_tolerance``, bf16's for bf16); runs saved after 3
iterations and resumed to 6 (no ZeRO, ZeRO-1, bf16) repeat the straight run bit for bit (the momentum restored)."""

import math

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.muon import (
    MODDED_NANOGPT,
    QKV_ROWS,
    SCALES,
    ns_tolerance,
    reference_orthogonalize,
    tp_matrices,
    tp_orthogonalize_then_train,
)
from tests.helpers.training import assert_same_run, layout, train

ITERS = 10
MUON = ("--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--muon-nesterov")
# the layouts saved after 3 iterations and resumed to 6: the whole momentum (no ZeRO), its ZeRO-1 shards, and
# BF16_Optimizer's (with the fp32 masters)
RESUMED = ("TP=2 x DP=2", "TP=2 x DP=2, ZeRO-1", "TP=2 x DP=2, bf16")


@pytest.fixture(scope="module")
def muon_argv(tiny_corpus):
    return tiny_argv(tiny_corpus, *MUON, train_iters=ITERS)


@pytest.fixture(scope="module")
def reference(muon_argv):
    return run_distributed(train, world_size=1, args=([muon_argv],))[0][0]


@pytest.fixture(scope="module")
def four_processes(muon_argv, tmp_path_factory):
    """One launch: the TP orthogonalisation checks, then every layout (and the save / resume pair)."""
    tp2, zero1 = layout(muon_argv, tp=2), ["--zero-stage", "1"]
    runs = {"TP=2 x DP=2": tp2,
            "TP=2 x DP=2, ZeRO-1": tp2 + zero1,
            "TP=2 x DP=2, ZeRO-2": tp2 + ["--zero-stage", "2"],
            "PP=2 x DP=2, ZeRO-1": layout(muon_argv, *zero1, pp=2),
            "TP=2 x DP=2, bf16": tp2 + ["--bf16"]}
    for straight in RESUMED:
        save = str(tmp_path_factory.mktemp("muon_checkpoints"))
        checkpoint = ["--save", save, "--save-interval", "100"]
        runs[f"{straight}: saved at 3"] = runs[straight] + checkpoint + ["--exit-interval", "3"]
        runs[f"{straight}: resumed to 6"] = runs[straight] + checkpoint + ["--load", save, "--exit-interval", "6"]
    per_rank = run_distributed(tp_orthogonalize_then_train, world_size=4, args=(list(runs.values()),))
    checks = [rank_checks for rank_checks, _ in per_rank]
    records = [dict(zip(runs, rank_records, strict=True)) for _, rank_records in per_rank]
    return checks, records


def test_one_process_learns(reference):
    losses = reference["losses"]
    assert len(losses) == ITERS and losses[-1] < losses[0] - 0.05, losses
    assert reference["groups"] == [("muon", 0.01), ("decay", 0.01), ("no_decay", 0.0)]


def _scaled(matrix):
    return reference_orthogonalize(matrix, MODDED_NANOGPT) * SCALES["spectral"](*matrix.shape)


def _qkv_whole(matrix):
    """The fused QKV matrix's update: its query, key and value rows (over all groups) orthogonalised each."""
    per_group = matrix.view(-1, sum(QKV_ROWS), matrix.shape[1])
    out, start = torch.zeros(per_group.shape, dtype=torch.float64), 0
    for size in QKV_ROWS:
        part = per_group[:, start:start + size].reshape(-1, matrix.shape[1])
        out[:, start:start + size] = _scaled(part).view(per_group.shape[0], size, -1)
        start += size
    return out.view(matrix.shape)


def test_tp_modes_orthogonalise_the_whole_matrix_or_each_shard(four_processes):
    checks, _ = four_processes
    matrices = tp_matrices()
    for rank, got in enumerate(checks):
        tp_rank = rank % 2
        for name, (matrix, dim) in matrices.items():
            shard = matrix.chunk(2, dim=dim)[tp_rank]
            whole = _qkv_whole(matrix) if name == "qkv" else _scaled(matrix)
            blockwise = _qkv_whole(shard) if name == "qkv" else _scaled(shard)
            expected = {"duplicated": whole.chunk(2, dim=dim)[tp_rank], "distributed": whole.chunk(2, dim=dim)[tp_rank],
                        "blockwise": blockwise}
            for mode, want in expected.items():
                tol = ns_tolerance(MODDED_NANOGPT, min(matrix.shape)) * math.sqrt(max(matrix.shape))
                error = (torch.tensor(got[f"{mode} {name}"]).double() - want).abs().max().item()
                assert error <= tol, f"rank {rank}, {mode} {name}: {error} > {tol}"
        # blockwise is a different update from the whole matrix's (the test could tell them apart)
        assert not torch.allclose(torch.tensor(got["blockwise column"]), torch.tensor(got["duplicated column"]))


@pytest.mark.parametrize("name", ["TP=2 x DP=2", "TP=2 x DP=2, ZeRO-1", "TP=2 x DP=2, ZeRO-2", "PP=2 x DP=2, ZeRO-1"])
def test_layouts_train_as_one_process(reference, four_processes, name):
    _, records = four_processes
    for rank, runs in enumerate(records):
        if runs[name]["losses"]:  # the pipeline's first stage reports none
            assert_same_run(reference, runs[name], f"rank {rank}, {name}")
    assert any(runs[name]["losses"] for runs in records)
    stage_optimizer = records[0][name]["optimizer"]
    assert stage_optimizer == ("GradNormClippingOptimizer" if "ZeRO" not in name else "DeepSpeedZeroOptimizer")


def test_bf16_trains_close_to_fp32(reference, four_processes):
    _, records = four_processes
    run = records[0]["TP=2 x DP=2, bf16"]
    assert run["optimizer"] == "BF16_Optimizer" and run["master_numel"] > 0
    assert_same_run(reference, run, "bf16 (BF16_Optimizer)", dtype=torch.bfloat16)


@pytest.mark.parametrize("straight", RESUMED)
def test_checkpoints_resume_bit_for_bit(four_processes, straight):
    """Saved after 3 iterations and resumed to 6: the straight run's first 6 losses and grad norms, bit for bit."""
    _, records = four_processes
    for rank, runs in enumerate(records):
        full, first, resumed = (runs[k] for k in (straight, f"{straight}: saved at 3", f"{straight}: resumed to 6"))
        assert first["iterations"] == [1, 2, 3] and resumed["iterations"] == [4, 5, 6], f"rank {rank}"
        assert first["losses"] + resumed["losses"] == full["losses"][:6], f"rank {rank}"
        assert resumed["grad_norms"] == full["grad_norms"][3:6], f"rank {rank}"
