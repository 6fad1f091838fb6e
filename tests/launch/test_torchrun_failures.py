"""pretrain_gpt.py under torchrun when something is wrong: a bad flag is one line from one process;
killing torchrun (kill -9) leaves no worker behind; and with --distributed-timeout-minutes a rank that
stops answering (SIGSTOP) ends the whole job, non-zero, within the timeout plus torchrun's teardown,
instead of the backend's 10-30 minutes."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from megatron.testing import tiny_argv
from tests.helpers.paths import REPO_ROOT

TIMEOUT_MINUTES = 0.2  # 12 s: well above any legitimate wait of this tiny job, even on a loaded machine


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _rank_of(pid: int):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None


def _torchrun(argv, cwd, **kwargs):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(REPO_ROOT / "pretrain_gpt.py"), *argv], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


@pytest.mark.multiprocess
def test_a_bad_flag_is_one_line_from_one_process(tiny_corpus, tmp_path):
    job = _torchrun(tiny_argv(tiny_corpus, hidden_size=66), tmp_path)  # 66 is not divisible by 4 heads
    output, _ = job.communicate(timeout=120)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert job.returncode != 0
    assert errors == ["error: --hidden-size 66 is not divisible by --num-attention-heads 4"], output
    # No worker prints a traceback; torchrun itself still reports the failed child with its own.
    assert 'pretrain_gpt.py", line' not in output and output.count("Traceback (most recent call last)") <= 1, output


def _wait_for_iteration(job, lines, iteration: int) -> None:
    deadline = time.time() + 120
    while not any(f"iteration {iteration:8d}/" in line for line in lines):  # the last rank logs each iteration
        assert job.poll() is None and time.time() < deadline, "".join(lines[-30:])
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has ended
    except OSError:
        return False


@pytest.mark.multiprocess
def test_workers_end_when_torchrun_is_killed(tiny_corpus, tmp_path):
    job = _torchrun(tiny_argv(tiny_corpus, train_iters=1000), tmp_path)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    workers = []
    try:
        _wait_for_iteration(job, lines, 3)
        workers = _children(job.pid)
        assert len(workers) == 2, workers
        job.kill()  # SIGKILL: torchrun cannot stop its workers itself
        job.wait(timeout=30)
        deadline = time.time() + 10
        while any(_alive(pid) for pid in workers) and time.time() < deadline:
            time.sleep(0.1)
        left = [pid for pid in workers if _alive(pid)]
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not left, f"workers {left} still running 10 s after torchrun was killed"


@pytest.mark.multiprocess
def test_a_stopped_rank_ends_the_job_within_the_timeout(tiny_corpus, tmp_path):
    argv = tiny_argv(tiny_corpus, "--distributed-timeout-minutes", str(TIMEOUT_MINUTES), train_iters=1000)
    job = _torchrun(argv, tmp_path)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)  # keep the pipe drained
    reader.start()
    stopped = None
    try:
        _wait_for_iteration(job, lines, 3)
        workers = {_rank_of(pid): pid for pid in _children(job.pid)}
        stopped = workers[1]
        os.kill(stopped, signal.SIGSTOP)
        start = time.time()
        returncode = job.wait(timeout=180)
        elapsed = time.time() - start
    finally:
        for pid in [stopped] if stopped else []:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if job.poll() is None:
            job.kill()
    print(f"job ended {elapsed:.1f} s after rank 1 was stopped, exit status {returncode}")
    reader.join(timeout=10)
    assert returncode != 0
    assert elapsed < 120, f"the job took {elapsed:.0f} s to end after a rank stopped"
    assert any("timed out" in line.lower() or "timeout" in line.lower() for line in lines), "".join(lines[-40:])
