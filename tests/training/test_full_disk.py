"""A save that fails for want of space (on one rank, or a real full tmpfs where this machine lets a test mount
one): one error naming the folder, the space needed and ENOSPC on every rank; the half-written tag removed,
``latest`` untouched; the resume from it continues the run loss for loss."""

import errno
import os
import shutil
import subprocess

import pytest

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import assert_continues, train


def _fail_to_save_then_resume(rank, world_size, argv, full_disk_rank):
    """pretrain ``argv``, the save of iteration 4 failing with ENOSPC on ``full_disk_rank`` (None: the disk
    itself is full), then again with --load SAVE; (the error's message, the losses trained, the folder's
    entries after the failure, the resumed run's record)."""
    import torch

    import megatron.training.loop as loop
    from megatron.arguments import run_config_from_argv
    from megatron.checkpoint.training_io import CheckpointSaveError
    from megatron.training.pretrain import pretrain

    losses, real_step, real_save = [], loop.Trainer.train_step, torch.save

    def step(self):
        record = real_step(self)
        losses.append(record.loss)
        if full_disk_rank is None and record.iteration == 3 and rank == 0:  # global_step2 is saved: shrink the disk
            assert _mount_tmpfs(rc.checkpoint.save, shutil.disk_usage(rc.checkpoint.save).used + 64 * 1024,
                                remount=True)
        return record

    def save(obj, f, *args, **kwargs):
        if rank == full_disk_rank and "global_step4" in str(f):
            with open(f, "wb") as out:
                out.write(b"\0" * 128)  # what fitted before the disk filled
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    rc = run_config_from_argv(argv, world_size=world_size)
    loop.Trainer.train_step, torch.save = step, save
    message = None
    try:
        pretrain(rc)
    except CheckpointSaveError as error:
        message = str(error)
    finally:
        loop.Trainer.train_step, torch.save = real_step, real_save
    entries = sorted(os.listdir(rc.checkpoint.save))
    if full_disk_rank is None and rank == 0:
        assert _mount_tmpfs(rc.checkpoint.save, 64 * 2**20, remount=True)  # room again, for the resumed run's save
    torch.distributed.barrier()  # the room is back before any rank writes again
    (resumed,) = train(rank, world_size, [argv + ["--load", rc.checkpoint.save]])
    return message, losses, entries, resumed


def _folder_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def _check_failed_save_and_resume(save, failed):
    (message, losses, entries, resumed), (message_1, *_) = failed
    assert message is not None and message == message_1  # agreed: every rank raises the same
    tag_dir = os.path.join(save, "global_step4")
    assert message.startswith(f"saving {tag_dir} failed: no space left on device (ENOSPC); "), message
    assert f"a checkpoint needs about {_folder_bytes(os.path.join(save, 'global_step2'))} bytes (the size of " \
           f"global_step2)" in message and "'latest' still names global_step2" in message, message
    assert "global_step4" not in entries and not [name for name in entries if ".tmp." in name], entries
    assert "latest" in entries and "global_step2" in entries
    assert len(losses) == 4 and resumed["iterations"] == [3, 4]  # resumed from global_step2 ...
    assert_continues(losses, resumed["losses"], "resumed after the failed save")  # ... exactly


@pytest.mark.multiprocess
def test_enospc_on_one_rank_removes_the_tag_and_leaves_latest(tiny_corpus, tmp_path):
    save = tmp_path / "ckpt"
    argv = tiny_argv(tiny_corpus, "--zero-stage", "1", train_iters=4, save=str(save), save_interval=2)
    # rank 1 writes its own optimizer shard (ZeRO-1 over DP=2): only its write fails
    failed = run_distributed(_fail_to_save_then_resume, world_size=2, args=(argv, 1), timeout=300)
    _check_failed_save_and_resume(str(save), failed)


def _mount_tmpfs(folder, size_bytes: int, remount: bool = False) -> bool:
    """A tmpfs of ``size_bytes`` on ``folder`` (``remount``: resize the one there); False where not allowed."""
    options = ("remount," if remount else "") + f"size={size_bytes}"
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


@pytest.mark.multiprocess
def test_a_full_tmpfs_removes_the_tag_and_leaves_latest(tiny_corpus, tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    if not _mount_tmpfs(save, 64 * 2**20):
        pytest.skip("this machine does not let a test mount a tmpfs (the injected ENOSPC test stands in)")
    try:
        argv = tiny_argv(tiny_corpus, "--zero-stage", "1", train_iters=4, save=str(save), save_interval=2)
        # after global_step2 is saved, rank 0 shrinks the tmpfs to what is used + 64 KiB: global_step4 fills it
        failed = run_distributed(_fail_to_save_then_resume, world_size=2, args=(argv, None), timeout=300)
        _check_failed_save_and_resume(str(save), failed)
    finally:
        subprocess.run(["umount", str(save)], capture_output=True)
