"""--sequence-parallel trains as the same layout without it does, on both engines.

fp32, no dropout, 10 iterations of pretrain(): losses and grad norms within ``run_tolerance`` (megatron/testing/tolerance.py)
of the same layout without --sequence-parallel, for TP=2, TP=2 with --checkpoint-activations,
TP=4, TP=2 x PP=2 (DeepSpeed's pipeline engine, activations sent unpartitioned) and TP=2 x DP=2 under
ZeRO-3 (the model engine, every parameter partitioned); a run saved at iteration 5 and resumed
continues as the straight run, and its checkpoint serves (decoding builds the model without it); a ZeRO-1 save made
universal moves to TP=4 and to TP=1 x DP=4. One launch per world size (launches are the expensive part).
"""

import json

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import assert_continues, assert_same_run, layout, to_universal, train

ITERS = 10
SP = "--sequence-parallel"


def _assert_same_as_without_sp(reference, other, label):
    assert len(reference["losses"]) == ITERS, label
    assert_same_run(reference, other, f"{label} (reference: without {SP})")


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """The TP=2 + SP runs' saves at iteration 5: ZeRO-0 (resumed exactly, served) and ZeRO-1 (made universal)."""
    root = tmp_path_factory.mktemp("sequence_parallel")
    return {"zero0": str(root / "sp"), "zero1": str(root / "sp_zero1")}


@pytest.fixture(scope="module")
def two_ranks(tiny_corpus, saves):
    """One 2-process launch: each rank's records by label. "tp2 sp zero1" is also the straight run the universal
    resumes continue (test_universal_checkpoint_moves_between_sequence_parallel_sizes), "tp2 sp zero1 first half"
    the save they convert."""
    argv = tiny_argv(tiny_corpus, train_iters=ITERS, tensor_model_parallel_size=2)
    save = saves["zero0"]
    runs = {
        "tp2": argv,
        "tp2 sp": layout(argv, SP),
        "tp2 sp recompute": layout(argv, SP, "--checkpoint-activations"),
        "tp2 sp zero1": layout(argv, SP, "--zero-stage", 1),
        # the fp32 ZeRO-0 path (our clipping wrapper around AdamW): it resumed with a stale learning rate until
        # the wrapper re-shared the groups torch's load_state_dict replaces (found here, iteration 8 differed)
        "tp2 sp first half": layout(argv, SP, "--save", save, "--save-interval", 100, "--exit-interval", 5),
        "tp2 sp resumed": layout(argv, SP, "--load", save),
        "tp2 sp zero1 first half": layout(argv, SP, "--zero-stage", 1, "--save", saves["zero1"], "--save-interval", 100,
                                          "--exit-interval", 5),
    }
    results = run_distributed(train, world_size=2, args=(list(runs.values()),), timeout=600)
    return [dict(zip(runs, per_rank)) for per_rank in results]


@pytest.mark.multiprocess
def test_two_ranks_tp2_recompute_and_exact_resume(two_ranks, saves):
    for rank, by in enumerate(two_ranks):
        reference = by["tp2"]
        assert reference["losses"][-1] < reference["losses"][0] - 0.05, reference["losses"]  # it learns
        assert not reference["model_sp"] and by["tp2 sp"]["model_sp"]
        assert by["tp2 sp"]["pipe_partitioned"] is False and reference["pipe_partitioned"] is True
        for label in ("tp2 sp", "tp2 sp recompute"):
            _assert_same_as_without_sp(reference, by[label], f"rank {rank}: {label}")
        first, resumed, straight = by["tp2 sp first half"], by["tp2 sp resumed"], by["tp2 sp"]
        _assert_same_as_without_sp(reference, by["tp2 sp zero1"], f"rank {rank}: tp2 sp zero1")
        assert first["iterations"] == [1, 2, 3, 4, 5] and resumed["iterations"] == [6, 7, 8, 9, 10], (rank, first,
                                                                                                        resumed)
        # bit for bit: the resumed run continues exactly where the straight one went on
        assert first["losses"] + resumed["losses"] == straight["losses"], rank
        assert first["grad_norms"] + resumed["grad_norms"] == straight["grad_norms"], rank
    _assert_serves(saves["zero0"])


def _assert_serves(ckpt_dir):
    """A checkpoint trained with --sequence-parallel loads for serving, built without it (one token at a time)."""
    import torch

    from megatron.inference.generation import Generator
    from megatron.testing.tolerance import model_tolerance

    generator = Generator.from_checkpoint(ckpt_dir)
    assert not generator.config.sequence_parallel
    model = generator.model
    ids = torch.tensor([[5, 17, 42, 8, 99]])
    with torch.no_grad():
        full = model(ids)  # [s, b, vp]
        caches = model.new_kv_caches()
        steps = [model(ids[:, i:i + 1], kv_caches=caches) for i in range(ids.shape[1])]
    diff = (torch.cat(steps) - full).abs().max().item()
    assert diff <= model_tolerance(generator.config, torch.float32, full), diff  # one token at a time: other sums


UNIVERSAL_TARGETS = {"tp4 sp": ["--tensor-model-parallel-size", 4, SP], "tp1 dp4": []}


@pytest.fixture(scope="module")
def four_ranks(tiny_corpus, two_ranks, saves, tmp_path_factory):
    """One 4-process launch: each rank's records by label; "universal ..." resume the 2-process launch's ZeRO-1
    save, converted here."""
    import os

    argv = tiny_argv(tiny_corpus, train_iters=ITERS)
    # every parameter partitioned under ZeRO-3, the norms too (DeepSpeed keeps small ones whole by default)
    no_persistence = tmp_path_factory.mktemp("sequence_parallel_zero3") / "zero3.json"
    no_persistence.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    tp4 = ["--tensor-model-parallel-size", 4]
    tp2pp2 = ["--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2]
    zero3 = ["--tensor-model-parallel-size", 2, "--zero-stage", 3, "--deepspeed_config", no_persistence]
    runs = {"tp4": layout(argv, *tp4), "tp4 sp": layout(argv, *tp4, SP),
            "tp2 pp2": layout(argv, *tp2pp2), "tp2 pp2 sp": layout(argv, *tp2pp2, SP),
            "zero3 tp2 dp2": layout(argv, *zero3), "zero3 tp2 dp2 sp": layout(argv, *zero3, SP)}
    save = saves["zero1"]
    to_universal(os.path.join(save, "global_step5"), os.path.join(save, "global_step5_universal"))
    zero1 = tiny_argv(tiny_corpus, train_iters=ITERS, zero_stage=1)
    for label, flags in UNIVERSAL_TARGETS.items():
        runs[f"universal {label}"] = layout(zero1, *flags, "--load", save, "--universal-checkpoint")
    results = run_distributed(train, world_size=4, args=(list(runs.values()),), timeout=900)
    return [dict(zip(runs, per_rank)) for per_rank in results]


@pytest.mark.multiprocess
def test_four_ranks_tp4_pipeline_and_zero3(four_ranks):
    for rank, by in enumerate(four_ranks):
        for plain in ("tp4", "tp2 pp2", "zero3 tp2 dp2"):
            _assert_same_as_without_sp(by[plain], by[f"{plain} sp"], f"rank {rank}: {plain} {SP}")
        assert by["zero3 tp2 dp2 sp"]["engine"] == "ModelEngine", by["zero3 tp2 dp2 sp"]["engine"]
        assert by["tp2 pp2 sp"]["pipe_partitioned"] is False


@pytest.mark.multiprocess
def test_universal_checkpoint_moves_between_sequence_parallel_sizes(two_ranks, four_ranks):
    """--sequence-parallel changes no parameter: a TP=2 run with it (ZeRO-1, as universal conversion wants),
    converted at iteration 5 by ds_to_universal.py, continues at TP=4 with it (shards of s/4 instead of s/2)
    and at TP=1 x DP=4 without it, each within ``run_tolerance`` of the straight run's losses. (The runs: the
    2-process launch's "tp2 sp zero1" and "tp2 sp zero1 first half", the 4-process launch's "universal ...".)"""
    straight = two_ranks[0]["tp2 sp zero1"]
    for rank, by in enumerate(four_ranks):
        for label in UNIVERSAL_TARGETS:
            run = by[f"universal {label}"]
            assert run["iterations"] == list(range(6, 11)), (label, run["iterations"])
            assert run["model_sp"] == (label == "tp4 sp")
            assert_continues(straight["losses"], run["losses"], f"rank {rank} {label}", dtype=torch.float32)


def test_sequence_not_divisible_by_tp_is_refused_before_launch(tiny_corpus):
    from megatron.arguments import run_config_from_argv

    argv = tiny_argv(tiny_corpus, seq_length=30, tensor_model_parallel_size=4)
    with pytest.raises(ValueError, match=r"--seq-length 30 is not a multiple of --tensor-model-parallel-size 4"):
        run_config_from_argv(argv + [SP], world_size=4)
    run_config_from_argv(argv, world_size=4)  # fine without it
    one = run_config_from_argv(tiny_argv(tiny_corpus) + [SP], world_size=1)
    assert one.parallel.sequence_parallel and not one.model.sequence_parallel  # TP 1: kept, said, not run
    assert any("--sequence-parallel has no effect" in w for w in one.startup_warnings), one.startup_warnings


def test_deepspeed_json_partitioning_the_pipeline_contradicts_the_flag(tiny_corpus, tmp_path):
    from megatron.arguments import run_config_from_argv

    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"pipeline": {"pipe_partitioned": True}}))
    argv = tiny_argv(tiny_corpus, tensor_model_parallel_size=2) + [SP, "--deepspeed_config", str(user)]
    with pytest.raises(ValueError, match="pipeline.pipe_partitioned"):
        run_config_from_argv(argv, world_size=2)
