"""pretrain_gpt.py under torchrun when something is wrong: a bad flag is one line from one process;
killing torchrun (kill -9) leaves no worker behind; SIGTERM to torchrun, or to every process of the job as
``scancel`` sends it, ends in a complete checkpoint that resumes exactly, data-loader workers included; and
with --distributed-timeout-minutes a rank that stops answering (SIGSTOP) ends the whole job, non-zero, naming
the timeout, instead of hanging for the backend's 10-30 minutes; with --hang-watchdog-factor the watchdog ends
it first, with the running ranks' stacks and the stopped rank named; --log-straggler names a slowed rank."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.faults import held_env, kill_env, slow_forward_env
from tests.helpers.paths import REPO_ROOT
from tests.helpers.training import assert_continues, tensorboard_scalars, train

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


def _torchrun(argv, cwd, nproc=2, env=None, max_restarts=0, **kwargs):
    env = {k: v for k, v in (env or os.environ).items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                             "--max-restarts", str(max_restarts), str(REPO_ROOT / "pretrain_gpt.py"), *argv], cwd=cwd,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


@pytest.mark.multiprocess
def test_a_bad_flag_is_one_line_from_one_process(tiny_corpus, tmp_path):
    job = _torchrun(tiny_argv(tiny_corpus, hidden_size=66), tmp_path)  # 66 is not divisible by 4 heads
    output, _ = job.communicate(timeout=120)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert job.returncode != 0
    assert errors == ["error: --hidden-size 66 is not divisible by --num-attention-heads 4"], output
    # No worker prints a traceback; torchrun itself still reports the failed child with its own.
    assert 'pretrain_gpt.py", line' not in output and output.count("Traceback (most recent call last)") <= 1, output


@pytest.mark.multiprocess
def test_a_load_refusal_is_one_line_from_one_process(tiny_corpus, tmp_path):
    (tmp_path / "ckpt" / "global_step4").mkdir(parents=True)  # a save that never finished, and nothing before it
    (tmp_path / "ckpt" / "latest").write_text("global_step4")
    job = _torchrun(tiny_argv(tiny_corpus, load=str(tmp_path / "ckpt")), tmp_path)
    output, _ = job.communicate(timeout=120)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert job.returncode != 0
    assert len(errors) == 1 and "global_step4' has no 'complete' marker" in errors[0], output[-3000:]
    assert 'pretrain_gpt.py", line' not in output and output.count("Traceback (most recent call last)") <= 1, output


def _descendants(pid: int) -> list[int]:
    found = _children(pid)
    return found + [grandchild for child in found for grandchild in _descendants(child)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


def _ranks_and_data_workers(launcher: int, expected: int = 2, wait_s: float = 20.0) -> tuple[list[int], list[int]]:
    """torchrun's ranks, and each rank's DataLoader workers: its children forked from it (the same command line),
    once there are ``expected`` of each. A rank may briefly have another child (seen twice under load: a fork that
    had not yet run its program, or a worker being replaced), so the count is read again until it settles."""
    deadline = time.time() + wait_s
    while True:
        ranks = [pid for pid in _children(launcher) if _rank_of(pid) is not None]
        workers = [child for rank in ranks for child in _children(rank) if _cmdline(child) == _cmdline(rank)]
        if (len(ranks), len(workers)) == (expected, expected) or time.time() > deadline:
            return ranks, workers
        time.sleep(0.2)


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
        while _alive(workers[0]):  # rank 0 ends by itself, through the timeout (pytest's timeout ends a hang)
            assert time.time() - start < 180, "rank 0 still running 180 s after rank 1 stopped"
            time.sleep(0.2)
        elapsed = time.time() - start
        # torchrun then SIGTERMs the stopped rank and SIGKILLs it 30 s later (its fixed grace, not ours to test):
        # let it run again to act on the signal now
        os.kill(stopped, signal.SIGCONT)
        returncode = job.wait(timeout=120)
    finally:
        for pid in [stopped] if stopped else []:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if job.poll() is None:
            job.kill()
    print(f"rank 0 ended {elapsed:.1f} s after rank 1 was stopped; the job's exit status {returncode}")
    reader.join(timeout=10)
    # It ended (the wait above is the hang guard: 15 x the timeout), non-zero, and because of the timeout.
    assert returncode != 0
    assert any("timed out" in line.lower() or "timeout" in line.lower() for line in lines), "".join(lines[-40:])


SLEEP_S = 0.1  # rank 1's sleep in each forward call (tests/helpers/faults.slow_forward_env)
WATCHDOG_MIN_S = 4.0  # --hang-watchdog-min-seconds: far above this tiny job's steps
WATCHDOG_TIMEOUT_MINUTES = 2  # --distributed-timeout-minutes: what the watchdog must beat


@pytest.mark.multiprocess
def test_a_slowed_rank_is_named_by_log_straggler_and_a_stopped_rank_is_reported_by_the_hang_watchdog(
        tiny_corpus, tmp_path):
    """One job: rank 1 sleeps in every forward call, so --log-straggler names it the slowest rank on each log
    line, by at least its sleep; then rank 1 is stopped (SIGSTOP), and rank 0's watchdog reports the overdue step
    with its numbers, dumps its stacks, names rank 1 as not answering, and ends the job non-zero, its threshold
    far under the collective timeout."""
    argv = tiny_argv(tiny_corpus, "--log-straggler", "--hang-watchdog-factor", "5", "--hang-watchdog-min-seconds",
                     str(WATCHDOG_MIN_S), "--hang-watchdog-warmup-iters", "2", "--distributed-timeout-minutes",
                     str(WATCHDOG_TIMEOUT_MINUTES), train_iters=1000, tensorboard_dir=str(tmp_path / "tb"),
                     tensorboard_queue_size=1)  # each scalar written at once: the job ends by os._exit
    job = _torchrun(argv, tmp_path, env=slow_forward_env(tmp_path / "faults", 1, SLEEP_S))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    stopped = None
    try:
        _wait_for_iteration(job, lines, 5)
        stopped = {_rank_of(pid): pid for pid in _children(job.pid)}[1]
        os.kill(stopped, signal.SIGSTOP)
        while not any("hang watchdog: rank 0: ending the job" in line for line in lines):  # pytest's timeout: a hang
            assert job.poll() is None, "".join(lines[-40:])
            time.sleep(0.2)
        # rank 0 has reported and is exiting; SIGCONT lets rank 1 take torchrun's SIGTERM now rather than after
        # torchrun's 30 s wait for a stopped process
        os.kill(stopped, signal.SIGCONT)
        returncode = job.wait(timeout=180)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL) if stopped else ():
            try:
                os.kill(stopped, sig)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            job.kill()
    reader.join(timeout=10)
    output = "".join(lines)
    # --log-straggler: every log line names rank 1 the slowest, its forward time at least its 2 sleeps per iteration
    # (2 micro-batches a rank), and rank 0 the fastest
    named = [re.search(r"fastest ([\d.]+) \(rank (\d)\) \| slowest ([\d.]+) \(rank (\d)\)", line)
             for line in lines if " iteration " in line and "consumed samples" in line]
    assert len(named) >= 5 and all(named), output[-3000:]
    for match in named:
        fastest_ms, fastest, slowest_ms, slowest = float(match[1]), int(match[2]), float(match[3]), int(match[4])
        assert (fastest, slowest) == (0, 1) and slowest_ms >= 2 * 1000 * SLEEP_S > fastest_ms, match[0]
    scalars = tensorboard_scalars(tmp_path / "tb")  # and to TensorBoard, at least for the first 4 log lines
    assert len(scalars["straggler/slowest-rank"]) >= 4, sorted(scalars)
    assert {value for _, value in scalars["straggler/slowest-rank"]} == {1.0}
    assert {value for _, value in scalars["straggler/fastest-rank"]} == {0.0}
    assert min(value for _, value in scalars["straggler/slowest-rank-ms"]) >= 2 * 1000 * SLEEP_S
    # the watchdog: its own numbers; the step ran past its threshold, which is far under the collective timeout
    report = re.search(r"hang watchdog: rank 0: iteration (\d+) has run ([\d.]+) s, past the threshold ([\d.]+) s",
                       output)
    assert report, output[-3000:]
    elapsed_s, threshold_s = float(report[2]), float(report[3])
    assert WATCHDOG_MIN_S <= threshold_s <= elapsed_s < 60 * WATCHDOG_TIMEOUT_MINUTES / 4, report[0]
    assert "[rank 0] Thread MainThread (most recent call last):" in output
    assert re.search(r"\[rank 0\] .*in train_step", output), output[-3000:]  # where the running rank waits
    assert "hang watchdog: rank 0: rank(s) 1 did not answer" in output, output[-3000:]
    assert returncode != 0
    assert "timed out" not in output.lower(), output[-3000:]  # the watchdog ended it, not the collective timeout


HELD_AT = 3  # the iteration inside which the SIGTERM tests signal the job


def _sigterm_a_training_job(common, save, target, nproc=2):
    """Train ``common`` under torchrun with ``nproc`` ranks, a DataLoader worker each, saving to ``save``; each
    rank holds after iteration ``HELD_AT``'s step until a signal reaches it (tests/helpers/faults.held_env), and
    then SIGTERM goes to torchrun alone (``target`` "launcher") or to every process of the job at once ("every
    process"). Asserts the job stopped and saved at that iteration, the first boundary after the signal, with every
    rank's save complete and no process left; returns the iteration it stopped at."""
    held = save.parent / "held"
    job = _torchrun(common + ["--save", str(save)], save.parent, nproc=nproc, env=held_env(held, HELD_AT))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    try:
        while len(list(held.glob("held-rank*"))) < nproc:  # pytest's timeout ends a hang
            assert job.poll() is None, "".join(lines[-30:])
            time.sleep(0.2)
        ranks, workers = _ranks_and_data_workers(job.pid, expected=nproc)
        assert len(ranks) == nproc and len(workers) == nproc, {pid: _cmdline(pid) for pid in _descendants(job.pid)}
        everyone = ranks + workers  # the ranks and a DataLoader worker each
        start = time.time()
        for pid in [job.pid] + (_descendants(job.pid) if target == "every process" else []):
            os.kill(pid, signal.SIGTERM)
        returncode = job.wait(timeout=120)
        elapsed = time.time() - start
    finally:
        if job.poll() is None:
            job.kill()
    reader.join(timeout=10)
    output = "".join(lines)
    print(f"{target}, {nproc} ranks: torchrun exited {returncode} {elapsed:.1f} s after SIGTERM")
    assert "DataLoader worker" not in output, output[-3000:]
    # torchrun itself re-raises the signal (its SignalException, exit 1); every rank saved and left with 0:
    # the 'complete' marker is written only after every rank's files are there and checksummed.
    assert returncode in (0, 1), output[-3000:]
    tag = (save / "latest").read_text().strip()
    assert (save / tag / "complete").is_file()
    stopped_at = int(tag.removeprefix("global_step"))
    # Promptly, counted in iterations, not seconds: the signal reached every rank inside iteration HELD_AT, so the
    # ranks agree to stop at its boundary and save there.
    assert stopped_at == HELD_AT, (HELD_AT, stopped_at)
    assert not [pid for pid in everyone if _alive(pid)], "processes of the job outlived it"
    return stopped_at


@pytest.mark.multiprocess
def test_sigterm_to_every_process_at_zero3_dp2_saves_and_resumes_exactly(tiny_corpus, tmp_path):
    """SIGTERM to every process of the job at once (as ``scancel --signal=TERM`` does: the ranks, their DataLoader
    workers and torchrun), under ZeRO-3 at DP=2. SIGTERM to torchrun alone, which forwards it to each worker's
    process group, is the TP=2 x PP=2 test's."""
    save = tmp_path / "ckpt"
    common = tiny_argv(tiny_corpus, "--zero-stage", "3", num_workers=1, save_interval=100000, train_iters=100000)
    stopped_at = _sigterm_a_training_job(common, save, "every process")
    # The resume continues the run loss for loss (the same data order, RNG and optimizer state).
    straight = common + ["--exit-interval", str(stopped_at + 2)]
    resumed = straight + ["--load", str(save)]
    (reference, tail), _ = run_distributed(train, world_size=2, args=([straight, resumed],), timeout=300)
    assert tail["iterations"] == [stopped_at + 1, stopped_at + 2]
    assert_continues(reference["losses"], tail["losses"], "every process signalled, ZeRO-3 DP=2")


@pytest.mark.multiprocess
def test_sigterm_to_torchrun_at_zero1_tp2_pp2_saves_and_resumes_exactly(tiny_corpus, tmp_path):
    """TP=2 x PP=2 under ZeRO-1, SIGTERM to torchrun alone: it forwards the signal to each worker's process group
    (the rank and its DataLoader worker), every rank stops at the same boundary and saves, and the save resumes loss
    for loss with a straight run. DP is 1: at TP=2 x PP=2 x DP=2 the same test took 114-168 s on the 2-core machine
    (8 ranks and 8 DataLoader workers); DP=2 with SIGTERM is the ZeRO-3 case above, which signals every process."""
    common = tiny_argv(tiny_corpus, "--zero-stage", "1", "--tensor-model-parallel-size", "2",
                       "--pipeline-model-parallel-size", "2", num_workers=1, save_interval=100000,
                       train_iters=100000)
    save = tmp_path / "ckpt"
    stopped_at = _sigterm_a_training_job(common, save, "launcher", nproc=4)
    straight = common + ["--exit-interval", str(stopped_at + 2)]
    resumed = straight + ["--load", str(save)]
    (reference, tail), *_ = run_distributed(train, world_size=4, args=([straight, resumed],), timeout=300)
    assert tail["iterations"] == [stopped_at + 1, stopped_at + 2]
    assert_continues(reference["losses"], tail["losses"], "torchrun signalled, TP=2 x PP=2")


def _model_states(tag_dir) -> dict:
    import torch

    out = {}
    for path in sorted(tag_dir.glob("*model_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        if "module" in state:  # the engine's file: the pipeline engine keeps the weights in the layer files
            state = state["module"] or {}
        out[path.name] = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return {name: tensors for name, tensors in out.items() if tensors}


@pytest.mark.multiprocess
def test_a_killed_rank_restarts_the_job_in_place_and_it_resumes_exactly(tiny_corpus, tmp_path):
    """Under torchrun --max-restarts 2, rank 1 of a PP=2 run killed (-9) after iteration 5 (saving every 2, --load =
    --save): torchrun restarts both workers, which resume from the newest complete checkpoint (4); killed again in
    that attempt right after the last save (8, the end of the run: the issue's hang), the job restarts once more,
    resumes at 8 with nothing left to train and exits 0, its last checkpoint's weights those of an uninterrupted run,
    bit for bit. The log and TensorBoard count the restarts and the iterations lost (5 - 4, then 8 - 8). Killed
    again in the restarted attempt, beyond the budget: the job ends non-zero, torchrun naming the failed rank."""
    common = tiny_argv(tiny_corpus, "--pipeline-model-parallel-size", "2", train_iters=8, save_interval=2)
    save, tensorboard = tmp_path / "restarted", tmp_path / "tb"
    job = _torchrun(common + ["--save", str(save), "--load", str(save), "--tensorboard-dir", str(tensorboard)],
                    tmp_path, env=kill_env(tmp_path / "faults", rank=1, iteration=5, more=[(1, 8, (1,), "save")]),
                    max_restarts=2)
    output, _ = job.communicate(timeout=300)
    assert job.returncode == 0, output[-3000:]
    assert "resumed from" in output and "global_step4 at iteration 4" in output, output[-3000:]
    assert "global_step8 at iteration 8" in output, output[-3000:]
    # rank 0 had finished iteration 5 when rank 1 died (its step waits for rank 1's), and 8 at the second kill
    assert ("in-job restart 1 (torchrun attempt 1): the previous attempt had reached iteration 5, this one resumes "
            "from iteration 4: 1 iteration(s) lost, 1 in all") in output, output[-3000:]
    assert ("in-job restart 2 (torchrun attempt 2): the previous attempt had reached iteration 8, this one resumes "
            "from iteration 8: 0 iteration(s) lost, 1 in all") in output, output[-3000:]
    scalars = tensorboard_scalars(tensorboard)  # written by the last rank of each restarted attempt, at its resume
    assert scalars["restarts/restarts"] == [(4, 1.0), (8, 2.0)], sorted(scalars)
    assert scalars["restarts/iterations-lost"] == [(4, 1.0), (8, 0.0)]
    assert scalars["restarts/iterations-lost-total"] == [(4, 1.0), (8, 1.0)]
    assert (save / "latest").read_text().strip() == "global_step8"
    reference = tmp_path / "reference"
    run_distributed(train, world_size=2, args=([common + ["--save", str(reference)]],), timeout=300)
    got, expected = _model_states(save / "global_step8"), _model_states(reference / "global_step8")
    assert got.keys() == expected.keys() and got
    for name, tensors in expected.items():
        assert tensors.keys() == got[name].keys(), name
        for key, tensor in tensors.items():
            assert torch_equal(got[name][key], tensor), (name, key)
    # beyond the budget: killed in both attempts
    again = tmp_path / "again"
    job = _torchrun(common + ["--save", str(again), "--load", str(again)], tmp_path,
                    env=kill_env(tmp_path / "faults2", rank=1, iteration=5, attempts=(0, 1)), max_restarts=1)
    output, _ = job.communicate(timeout=300)
    assert job.returncode != 0
    assert "ChildFailedError" in output and "rank      : 1" in output and "Signal 9 (SIGKILL)" in output, output[-3000:]


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
