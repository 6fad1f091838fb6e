"""check_argv (pretrain_gpt.py --dry-run): every problem at once, what could not be checked said, and the
dry-run flags refused by a real run."""


import os

import pytest

from megatron.arguments import run_config_from_argv
from megatron.arguments.check import check_argv
from tests.helpers.arguments import ds_json, tiny_config_argv


@pytest.fixture
def files(tokenizer_files):
    """The dry run builds the tokenizer: a real one (conftest's ``tokenizer_files``)."""
    return tokenizer_files


def test_a_valid_command_gives_the_run_config_of_the_public_path(files):
    argv = tiny_config_argv(files) + ["--dry-run", "--world-size", "4"]
    check = check_argv(argv)
    assert check.ok and check.not_checked == [] and (check.world_size, check.world_size_source) == (4, "--world-size")
    assert check.run_config == run_config_from_argv(argv, world_size=4)
    assert check.run_config.model.padded_vocab_size == 512  # the tiny corpus's 400 tokens, padded to 128 x TP 1


def test_the_world_size_comes_from_the_launch_environment(files):
    check = check_argv(tiny_config_argv(files) + ["--dry-run"], env={"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2",
                                                                     "GPUS_PER_NODE": "2"})
    assert check.ok and check.world_size == 4 and check.run_config.parallel.data_parallel_size == 4


def test_an_unknown_flag_is_reported_and_the_rest_still_checked(files):
    check = check_argv(tiny_config_argv(files, num_attention_heads=5) + ["--dry-run", "--world-size", "2",
                                                                         "--bogus", "3"])
    assert check.problems == ["unrecognized arguments: --bogus 3",
                              "--hidden-size 64 is not divisible by --num-attention-heads 5"]


def test_what_depends_on_a_failed_check_is_said_not_checked(files):
    check = check_argv(tiny_config_argv(files, deepspeed_config=files / "missing.json", min_lr=1.0)
                       + ["--dry-run", "--world-size", "3", "--tensor-model-parallel-size", "2"])
    assert len(check.problems) == 2 and "world size 3 is not a multiple of" in check.problems[0]
    assert "missing.json" in check.problems[1]  # --min-lr 1.0 > --lr is not reached: the settings need those first
    assert check.run_config is None and "settings' own rules" in check.not_checked[0]


def test_an_unreadable_value_stops_everything(files):
    check = check_argv(tiny_config_argv(files, num_layers="two") + ["--dry-run"])
    assert check.problems == ["argument --num-layers: invalid int value: 'two'"]
    assert check.not_checked == ["everything else: the flags could not be read"]


def test_the_json_is_checked_against_the_flags_with_the_settings(files):
    json_path = ds_json(files, train_micro_batch_size_per_gpu=4)
    argv = tiny_config_argv(files, deepspeed_config=json_path, min_lr=1.0) + ["--dry-run", "--world-size", "2"]
    check = check_argv(argv)
    assert [p.split(" ")[0] for p in check.problems] == ["--min-lr", "DeepSpeed"]


@pytest.mark.parametrize("flag", [["--world-size", "8"], ["--dry-run-json", "x.json"], ["--dry-run-gpu", "H100-80GB"]])
def test_a_real_run_refuses_the_dry_run_flags(files, flag):
    with pytest.raises(ValueError, match=f"{flag[0]} only apply with --dry-run"):
        run_config_from_argv(tiny_config_argv(files) + flag, world_size=2, with_vocab=False)


def test_zero3_with_tp_and_hpz_is_checked_and_estimated(files):
    argv = tiny_config_argv(files) + ["--dry-run", "--world-size", "8", "--zero-stage", "3",
                                      "--tensor-model-parallel-size", "2", "--zero-hpz-partition-size", "2"]
    check = check_argv(argv)
    assert check.ok, check.problems
    assert check.run_config.deepspeed_zero_stage == 3 and check.run_config.parallel.zero_hpz_partition_size == 2
    from megatron.dry_run.report import build_report

    report = build_report(argv + ["--dry-run-gpu", "H100-80GB"])
    assert report["ok"] and report["memory"]["fits"] and "gathered" in report["memory"]["per_stage_gib"][0]
    assert "dp_comm" in report["step"]["components_s"]
    bad = check_argv(argv[:-2] + ["--zero-hpz-partition-size", "3"])
    assert not bad.ok and any("--zero-hpz-partition-size 3 does not divide the data-parallel size 4" in p
                              for p in bad.problems)


def test_a_truncated_bin_a_missing_split_file_and_ids_beyond_the_vocabulary_fail_the_dry_run_and_the_launch(
        files, tmp_path):
    import io

    import numpy as np

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    from megatron.dry_run import dry_run

    with MMapIndexedDatasetBuilder(str(tmp_path / "wide"), dtype=np.uint16) as builder:
        builder.add_item(np.arange(5000) % 450)  # ids up to 449; the tiny corpus's tokenizer has 400 (+1 eod)
        builder.end_document()
        builder.finalize()
    os.truncate(files / "b.bin", os.path.getsize(files / "b.bin") - 2)
    argv = tiny_config_argv(files, data_path=["0.4", files / "a", "0.3", files / "b", "0.3", tmp_path / "wide"])
    check = check_argv(argv + ["--dry-run", "--world-size", "2"])
    assert len(check.problems) == 2, check.problems
    truncated, wide = check.problems
    assert f"data file for {files / 'b'}.idx is 1598 bytes but the index describes 1600 bytes" in truncated
    assert wide.startswith(f"{tmp_path / 'wide'}.bin holds token id 449 (among 5000 tokens read), beyond the "
                           f"tokenizer's vocabulary of 4")
    assert dry_run(argv + ["--dry-run", "--world-size", "2"], out=io.StringIO()) == 1
    split_file = tiny_config_argv(files, drop=["--data-path"], train_weighted_split_paths_path=tmp_path / "nope.txt")
    assert dry_run(split_file + ["--dry-run", "--world-size", "2"], out=io.StringIO()) == 1
    assert [p for p in check_argv(split_file + ["--dry-run"]).problems if "nope.txt" in p]
    with pytest.raises(ValueError, match=r"b\.idx is 1598 bytes"):  # a real launch: the first problem, every rank
        run_config_from_argv(tiny_config_argv(files, data_path=files / "b"), world_size=2)
    with pytest.raises(ValueError, match=r"wide\.bin holds token id 449"):
        run_config_from_argv(tiny_config_argv(files, data_path=tmp_path / "wide"), world_size=2)
