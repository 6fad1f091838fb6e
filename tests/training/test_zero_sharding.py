"""ZeRO-2 / ZeRO-3 (and ZeRO++'s hpZ) with our tensor parallelism train as (1, 1, 1) does.

fp32, no dropout, 10 iterations: losses and grad norms within ``run_tolerance`` (megatron/testing/tolerance.py) of a
single process, for ZeRO-2 DP=4, ZeRO-3 DP=4, ZeRO-3 TP=2 x DP=2 and hpZ groups of 2 (DP=4, and
TP=2 x DP=2 where DeepSpeed's own grouping of consecutive ranks would pair TP peers); bf16 variants
track fp32; resuming a ZeRO-2 or ZeRO-3 checkpoint continues bit for bit. One 4-process launch
trains every layout in turn (launches are the expensive part).
"""

import json

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import (
    assert_continues,
    assert_same_run,
    layout,
    pretrain_error,
    to_universal,
    train,
    weights_tolerance,
)

ITERS = 10


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    argv = tiny_argv(tiny_corpus, train_iters=ITERS)
    save1, save2, save3 = (str(tmp_path_factory.mktemp(name)) for name in ("one", "zero2", "zero3"))
    reference, _ = run_distributed(train, world_size=1, timeout=300, args=(
        [argv, layout(argv, "--save", save1, "--save-interval", 100, "--exit-interval", 5)],))[0]
    assert reference["losses"][-1] < reference["losses"][0] - 0.05, reference["losses"]  # it learns
    tp2 = ["--tensor-model-parallel-size", 2]
    # DeepSpeed keeps parameters under 1e5 elements gathered (stage3_param_persistence_threshold): all of
    # this tiny model's. 0 makes every parameter live in partitions only, as a large model's do.
    no_persistence = tmp_path_factory.mktemp("ds") / "zero3.json"
    no_persistence.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    partitioned = ["--deepspeed_config", no_persistence]
    layouts = {
        "zero2 dp4": layout(argv, "--zero-stage", 2),
        "zero3 dp4": layout(argv, "--zero-stage", 3, *partitioned),
        "zero3 tp2 dp2": layout(argv, "--zero-stage", 3, *tp2, *partitioned),
        "hpz2 dp4": layout(argv, "--zero-stage", 3, "--zero-hpz-partition-size", 2),
        "hpz2 tp2 dp2": layout(argv, "--zero-stage", 3, "--zero-hpz-partition-size", 2, *tp2),
        "zero3 tp2 recompute": layout(argv, "--zero-stage", 3, *tp2, *partitioned, "--checkpoint-activations"),
        "zero2 recompute 2": layout(argv, "--zero-stage", 2, "--checkpoint-activations", "--checkpoint-num-layers", 2),
        "bf16 zero2": layout(argv, "--zero-stage", 2, "--bf16"),
        "bf16 zero3 tp2": layout(argv, "--zero-stage", 3, "--bf16", *tp2),
        "zero2 first half": layout(argv, "--zero-stage", 2, "--save", save2, "--save-interval", 100,
                                    "--exit-interval", 5),
        "zero2 resumed": layout(argv, "--zero-stage", 2, "--load", save2),
        "zero3 first half": layout(argv, "--zero-stage", 3, *tp2, "--save", save3, "--save-interval", 100,
                                    "--exit-interval", 5),
        "zero3 resumed": layout(argv, "--zero-stage", 3, *tp2, "--load", save3),
    }
    results = run_distributed(train, world_size=4, args=(list(layouts.values()),), timeout=900)
    return argv, reference, {rank: dict(zip(layouts, per_rank)) for rank, per_rank in enumerate(results)}, \
        {"one": save1, "zero2": save2, "zero3": save3}


@pytest.mark.multiprocess
def test_zero2_zero3_and_hpz_match_single_process_in_fp32(runs):
    _, reference, by_rank, _ = runs
    for rank, results in by_rank.items():
        for label in ("zero2 dp4", "zero3 dp4", "zero3 tp2 dp2", "hpz2 dp4", "hpz2 tp2 dp2", "zero3 tp2 recompute",
                      "zero2 recompute 2"):
            assert_same_run(reference, results[label], f"rank {rank}: {label}")
        assert results["zero2 dp4"]["optimizer"] == "DeepSpeedZeroOptimizer"
        assert results["zero3 dp4"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"


@pytest.mark.multiprocess
def test_zero3_holds_only_partitions(runs):
    _, reference, by_rank, _ = runs
    for rank, results in by_rank.items():
        for label, dp in (("zero3 dp4", 4), ("zero3 tp2 dp2", 2)):
            run = results[label]
            assert run["held_numel"] == 0, f"rank {rank} {label}: parameters materialized"
            # each rank's partitions hold 1 / DP of its TP slice (DeepSpeed pads each to a multiple of DP)
            slice_numel = run["full_numel"]
            assert slice_numel / dp <= run["partition_numel"] <= slice_numel / dp + 64 * dp, (rank, label, run)


@pytest.mark.multiprocess
def test_hpz_groups_are_runs_of_data_parallel_ranks(runs):
    _, _, by_rank, _ = runs
    # Computed here from the layout's definition (TP fastest: rank = dp_rank * TP + tp_rank), not read
    # from megatron.parallel: groups of 2 consecutive data-parallel ranks of the same TP rank.
    expected = {"hpz2 dp4": {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]},
                "hpz2 tp2 dp2": {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}}
    for label, groups in expected.items():
        for rank, ranks in groups.items():
            assert by_rank[rank][label]["hpz_ranks"] == ranks, (label, rank, by_rank[rank][label]["hpz_ranks"])
            assert by_rank[rank][label]["hpz_ranks_engine"] == ranks
    assert by_rank[0]["zero3 dp4"]["hpz_ranks"] is None


@pytest.mark.multiprocess
def test_bf16_zero2_and_zero3_track_fp32(runs):
    _, reference, by_rank, _ = runs
    for label in ("bf16 zero2", "bf16 zero3 tp2"):
        run = by_rank[3][label]
        assert_same_run(reference, run, label, dtype=torch.bfloat16)
        assert run["losses"][-1] < run["losses"][0] - 0.05, run["losses"]


@pytest.mark.multiprocess
def test_zero2_and_zero3_checkpoints_resume_bit_for_bit(runs):
    _, _, by_rank, _ = runs
    for rank, results in by_rank.items():
        for stage, straight in (("zero2", "zero2 dp4"), ("zero3", "zero3 tp2 dp2")):
            first, resumed = results[f"{stage} first half"], results[f"{stage} resumed"]
            assert first["iterations"] == list(range(1, 6)) and resumed["iterations"] == list(range(6, 11))
            assert first["losses"] + resumed["losses"] == results[straight]["losses"], (rank, stage)
            assert first["grad_norms"] + resumed["grad_norms"] == results[straight]["grad_norms"], (rank, stage)


@pytest.mark.multiprocess
def test_a_zero3_checkpoint_at_another_stage_names_the_conversion(runs):
    argv, _, _, saves = runs
    error = run_distributed(pretrain_error, world_size=4, args=(layout(argv, "--zero-stage", 1,
                                                                        "--tensor-model-parallel-size", 2,
                                                                        "--load", saves["zero3"]),), timeout=300)[0]
    assert error and "ZeRO stage 3 (this run: 1)" in error and "ds_to_universal.py" in error, error


@pytest.mark.multiprocess
def test_zero2_and_zero3_checkpoints_give_the_single_process_weights_and_export(runs, tmp_path):
    """The tools read ZeRO-2 / ZeRO-3 checkpoints (megatron.checkpoint.zero_files): the fp32 masters put back
    together over DP and TP equal the weights a single process saved at the same iteration, and the
    Hugging Face export of the ZeRO-3 TP=2 checkpoint equals that of the single-process one."""
    import torch

    from megatron.checkpoint.single_process import load_full_state_dict
    from tools.convert_checkpoint import to_hf

    *_, saves = runs
    _, reference, _ = load_full_state_dict(saves["one"])
    for stage in ("zero2", "zero3"):
        _, state, record = load_full_state_dict(saves[stage])
        assert record["parallel"]["zero_stage"] == int(stage[-1]) and set(state) == set(reference)
        for name, tensor in reference.items():
            assert state[name].dtype == torch.float32 and state[name].shape == tensor.shape, name
            # ITERS steps at another layout: weights_tolerance apart
            diff, scale = (state[name] - tensor.float()).abs().max().item(), tensor.abs().max().item()
            assert diff <= weights_tolerance(torch.float32, 5, 1e-3, scale), f"{stage} {name}: max diff {diff}"
    exports = {}
    for name in ("one", "zero3"):
        assert to_hf.main(["--load", saves[name], "--output-dir", str(tmp_path / name)]) == 0
        from transformers import AutoModelForCausalLM

        exports[name] = AutoModelForCausalLM.from_pretrained(str(tmp_path / name)).state_dict()
    assert set(exports["one"]) == set(exports["zero3"])
    for name, tensor in exports["one"].items():  # the same weights as above, converted
        diff, scale = (exports["zero3"][name] - tensor).abs().max().item(), tensor.abs().max().item()
        assert diff <= weights_tolerance(torch.float32, 5, 1e-3, scale), (name, diff)


@pytest.mark.multiprocess
def test_a_crafted_zero3_file_is_refused_by_name(runs, tmp_path):
    import os
    import shutil

    import torch

    from megatron.checkpoint.integrity import record_checksums
    from megatron.checkpoint.single_process import load_full_state_dict
    from megatron.checkpoint.tags import CheckpointFormatError

    *_, saves = runs
    copy = tmp_path / "ckpt"
    shutil.copytree(saves["zero3"], copy)
    tag = copy / "global_step5"
    target = tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt"
    marker = tmp_path / "payload_ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save(dict(torch.load(target, weights_only=False), extra=Payload()), target)
    record_checksums(str(tag), distributed=False)
    with pytest.raises(CheckpointFormatError, match="zero_pp_rank_1_mp_rank_01_optim_states.pt"):
        load_full_state_dict(str(copy))
    assert not marker.exists() and os.path.exists(target)


@pytest.mark.multiprocess
def test_a_zero3_checkpoint_reshapes_through_a_universal_checkpoint(runs, tiny_corpus, tmp_path):
    """ZeRO-3 at TP=2 x DP=2, converted by ds_to_universal.py, resumes at TP=1 x DP=4 exactly on the straight
    run's losses; a ZeRO-1 run refuses it by name, naming the conversion for it, and resumes from that
    (--target-engine pipeline) on the same losses (more in test_universal_zero3_3d.py)."""
    import os

    argv, _, by_rank, saves = runs
    to_universal(os.path.join(saves["zero3"], "global_step5"), os.path.join(saves["zero3"], "global_step5_universal"))
    resumed = run_distributed(train, world_size=4, timeout=600, args=(
        [layout(argv, "--zero-stage", 3, "--load", saves["zero3"], "--universal-checkpoint")],))
    straight = by_rank[0]["zero3 tp2 dp2"]
    for rank, (run,) in enumerate(resumed):
        assert run["iterations"] == list(range(6, 11)), run["iterations"]
        assert_continues(straight["losses"], run["losses"], f"rank {rank}: ZeRO-3 TP=2 -> TP=1", dtype=torch.float32)
    error = run_distributed(pretrain_error, world_size=4, timeout=300, args=(
        layout(argv, "--zero-stage", 1, "--load", saves["zero3"], "--universal-checkpoint"),))[0]
    assert error and "universal checkpoint for the model engine" in error and "--target-engine pipeline" in error, error
    # converted for the pipeline engine, the TP=2 slices (merged by DeepSpeed, not flat as at TP=1) resume there
    for_pipeline = os.path.join(str(tmp_path), "for_pipeline")
    to_universal(os.path.join(saves["zero3"], "global_step5"), os.path.join(for_pipeline, "global_step5_universal"),
                 "--target-engine", "pipeline")
    (run,), = run_distributed(train, world_size=1, timeout=300, args=(
        [layout(argv, "--zero-stage", 1, "--load", for_pipeline, "--universal-checkpoint")],))
    assert_continues(straight["losses"], run["losses"], "ZeRO-3 TP=2 -> (1,1,1) ZeRO-1", dtype=torch.float32)
