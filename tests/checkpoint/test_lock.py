"""One writer per --save folder: a live holder is named and refused, a dead one's lock is taken over."""

import json
import os
import subprocess
import sys
import time

import pytest

from megatron.checkpoint import lock as save_lock
from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import pretrain_error


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_live_holder_is_refused_and_a_dead_one_taken_over(tmp_path):
    held = save_lock.acquire(str(tmp_path))
    record = json.loads((tmp_path / ".lock").read_text())
    assert record["pid"] == os.getpid() and record["host"]
    with pytest.raises(ValueError, match=rf"in use by another run \(host .*, pid {os.getpid()}, since"):
        save_lock.acquire(str(tmp_path))
    held.release()
    assert not (tmp_path / ".lock").exists()

    (tmp_path / ".lock").write_text(json.dumps(dict(record, pid=_dead_pid())))
    with pytest.warns(UserWarning, match="no longer exists on this host"):
        taken = save_lock.acquire(str(tmp_path))
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    taken.release()

    (tmp_path / ".lock").write_text(json.dumps(dict(record, host="another-node", pid=1)))
    with pytest.raises(ValueError, match="host another-node, pid 1"):  # alive as far as we can tell
        save_lock.acquire(str(tmp_path))
    old = time.time() - save_lock.STALE_AFTER_S - 60
    os.utime(tmp_path / ".lock", (old, old))
    with pytest.warns(UserWarning, match="no heartbeat for 16 minutes"):
        save_lock.acquire(str(tmp_path)).release()


@pytest.mark.multiprocess
def test_a_second_run_on_the_same_save_folder_refuses_to_start(tiny_corpus, tmp_path):
    argv = tiny_argv(tiny_corpus, train_iters=2, lr_warmup_iters=1, save=str(tmp_path / "ckpt"), save_interval=2)
    held = save_lock.acquire(str(tmp_path / "ckpt"))  # "another run": this test process, alive
    # ... in the middle of its first save: 'latest' names a tag whose save has not finished. A run that read
    # --load before taking the lock would refuse for that instead (no complete checkpoint to resume).
    (tmp_path / "ckpt" / "global_step9").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("global_step9")
    try:
        messages = run_distributed(pretrain_error, world_size=2, args=(argv + ["--load", str(tmp_path / "ckpt")],),
                                   timeout=300)
    finally:
        held.release()
        (tmp_path / "ckpt" / "latest").unlink()
        (tmp_path / "ckpt" / "global_step9").rmdir()
    assert all(m is not None and "is in use by another run" in m for m in messages), messages
    assert f"pid {os.getpid()}" in messages[0]
    assert not list((tmp_path / "ckpt").glob("global_step*"))  # nothing written
    assert run_distributed(pretrain_error, world_size=2, args=(argv,), timeout=300) == [None, None]  # free again
    assert (tmp_path / "ckpt" / "global_step2" / "complete").is_file() and not (tmp_path / "ckpt" / ".lock").exists()
