"""A save that fails for want of space, and the checks of what it leaves (tests/training/test_full_disk.py, and
tests/training/test_async_save.py with --async-save).

    fail_to_save_then_resume(rank, world_size, argv, full_disk_rank)  a run_distributed target: the save of
                                          iteration 4 fails with ENOSPC, then the run resumes from --save
    check_failed_save_and_resume(save, failed)  one error on every rank naming the folder, the space and ENOSPC;
                                          the tag removed, ``latest`` untouched; the resume continues exactly
    mount_tmpfs(folder, size_bytes, remount=False)  a tmpfs there, where this machine lets a test mount one
"""

import errno
import os
import shutil
import subprocess

from tests.helpers.training import assert_continues, train


def fail_to_save_then_resume(rank, world_size, argv, full_disk_rank):
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
            assert mount_tmpfs(rc.checkpoint.save, shutil.disk_usage(rc.checkpoint.save).used + 64 * 1024,
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
        assert mount_tmpfs(rc.checkpoint.save, 64 * 2**20, remount=True)  # room again, for the resumed run's save
    torch.distributed.barrier()  # the room is back before any rank writes again
    (resumed,) = train(rank, world_size, [argv + ["--load", rc.checkpoint.save]])
    return message, losses, entries, resumed


def _folder_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def check_failed_save_and_resume(save, failed):
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


def mount_tmpfs(folder, size_bytes: int, remount: bool = False) -> bool:
    """A tmpfs of ``size_bytes`` on ``folder`` (``remount``: resize the one there); False where not allowed."""
    options = ("remount," if remount else "") + f"size={size_bytes}"
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True).returncode == 0
