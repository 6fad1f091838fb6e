"""A save that fails for want of space (on one rank, or a real full tmpfs where this machine lets a test mount
one): one error naming the folder, the space needed and ENOSPC on every rank; the half-written tag removed,
``latest`` untouched; the resume from it continues the run loss for loss."""

import subprocess

import pytest

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.full_disk import check_failed_save_and_resume, fail_to_save_then_resume, mount_tmpfs


@pytest.mark.multiprocess
def test_enospc_on_one_rank_removes_the_tag_and_leaves_latest(tiny_corpus, tmp_path):
    save = tmp_path / "ckpt"
    argv = tiny_argv(tiny_corpus, "--zero-stage", "1", train_iters=4, save=str(save), save_interval=2)
    # rank 1 writes its own optimizer shard (ZeRO-1 over DP=2): only its write fails
    failed = run_distributed(fail_to_save_then_resume, world_size=2, args=(argv, 1), timeout=300)
    check_failed_save_and_resume(str(save), failed)


@pytest.mark.multiprocess
def test_a_full_tmpfs_removes_the_tag_and_leaves_latest(tiny_corpus, tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    if not mount_tmpfs(save, 64 * 2**20):
        pytest.skip("this machine does not let a test mount a tmpfs (the injected ENOSPC test stands in)")
    try:
        argv = tiny_argv(tiny_corpus, "--zero-stage", "1", train_iters=4, save=str(save), save_interval=2)
        # after global_step2 is saved, rank 0 shrinks the tmpfs to what is used + 64 KiB: global_step4 fills it
        failed = run_distributed(fail_to_save_then_resume, world_size=2, args=(argv, None), timeout=300)
        check_failed_save_and_resume(str(save), failed)
    finally:
        subprocess.run(["umount", str(save)], capture_output=True)
