"""examples/slurm/tiny_bloom.slurm under a real SLURM (a single-node cluster on loopback, started here).

One chain of three jobs on the same experiment folder, as a long run crosses time limits:
  A  srun style (one task per rank, ranks from SLURM_PROCID), fresh start, leaves by --exit-interval 4;
  B  torchrun style (BLOOM's: one srun task running torchrun), resumes at iteration 5, is preempted by a
     SIGTERM to the batch shell (what `#SBATCH --signal=B:TERM@N` sends), saves and exits 0;
  C  srun style, submitted with --dependency=afterok:B while B runs, resumes where B stopped and leaves
     by --exit-duration-in-mins.
Every job must end COMPLETED with exit code 0:0; where each one started and stopped is read from the
tensorboard record (steps of `lm-loss-training/lm loss`) and the checkpoints, not from stdout.

And a job submitted with --requeue, requeued (`scontrol requeue`) once it has saved a checkpoint: SLURM stops it
(SIGTERM: it saves and leaves), starts its script again, and it resumes and ends with the losses of an uninterrupted
job, bit for bit.
When SLURM is absent, Debian's slurm-wlm is installed (root and apt-get needed, else the test skips).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time

import pytest

from megatron.testing.tiny_corpus import make_tiny_corpus
from tests.helpers import faults
from tests.helpers.paths import REPO_ROOT
from tests.helpers.slurm_cluster import SlurmCluster, ensure_slurm_installed
from tests.helpers.training import tensorboard_scalars

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = str(REPO_ROOT / "examples" / "slurm" / "tiny_bloom.slurm")
JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cluster():
    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(reason)
    # a short path: munged's socket path must fit in a UNIX socket address (108 bytes)
    root = tempfile.mkdtemp(prefix="slurm-test-", dir="/tmp")
    try:
        try:
            cluster = SlurmCluster(root).__enter__()
        except RuntimeError as error:
            if os.geteuid() != 0:  # slurmd without root may be refused by the system; root must work
                pytest.skip(f"could not start a private SLURM cluster without root: {error}")
            raise
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _loss_steps(tensorboard_dir) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars("lm-loss-training/lm loss")]


def _latest_iteration(checkpoints) -> int:
    tag = (checkpoints / "latest").read_text().strip()
    assert (checkpoints / tag / "complete").is_file(), f"{tag} has no complete marker"
    return int(tag.replace("global_step", ""))


def _tail(path, n=4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError as e:
        return f"(no output file: {e})"


def _job_env(tmp_path, experiment, **extra) -> dict:
    corpus = make_tiny_corpus(str(tmp_path / "corpus"))
    return {"PY": sys.executable, "RUN_ROOT": str(tmp_path / "runs"), "EXPERIMENT": experiment,
            "TRAIN_ITERS": "100000", "SAVE_INTERVAL": "100000", "GPUS_PER_NODE": "2", "TP": "1", "PP": "2",
            "DATA_PREFIX": corpus["data_prefix"], "VOCAB_FILE": corpus["vocab_file"],
            "MERGE_FILE": corpus["merge_file"], "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "SRUN_ARGS": "--overlap", **extra}


def test_chained_jobs_resume_and_survive_preemption_in_both_launch_styles(cluster, tmp_path):
    env = _job_env(tmp_path, "chain")
    run_dir = tmp_path / "runs" / "chain"
    checkpoints, tensorboard = run_dir / "checkpoints", run_dir / "tensorboard"
    out = str(tmp_path / "job-%j.out")
    srun_style = ["--ntasks-per-node=2", f"--output={out}"]

    def finished(job_id: int, timeout_s: float = JOB_TIMEOUT_S) -> dict:
        info = cluster.wait(job_id, timeout_s)
        context = f"job {job_id}: {info}\n--- job output ---\n{_tail(info.get('StdOut', ''))}\n{cluster.logs()}"
        assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), context
        return info

    t0 = time.time()
    # A: srun direct launch, fresh start, stops itself after iteration 4 with a checkpoint.
    job_a = cluster.sbatch([*srun_style, SCRIPT], env={**env, "LAUNCH_STYLE": "srun", "EXIT_INTERVAL": "4"},
                           cwd=str(REPO_ROOT))
    info_a = finished(job_a)
    assert _latest_iteration(checkpoints) == 4
    assert _loss_steps(tensorboard) == [1, 2, 3, 4]
    assert os.path.getsize(info_a["StdOut"]) > 0
    assert (run_dir / "logs" / f"ds_config.{job_a}.json").is_file()

    # B: torchrun per node (BLOOM's style), resumes; preempted once it has trained a few iterations.
    job_b = cluster.sbatch([f"--output={out}", SCRIPT], env={**env, "LAUNCH_STYLE": "torchrun"},
                           cwd=str(REPO_ROOT))
    # C: queued behind B, starts only if B ends with exit code 0.
    job_c = cluster.sbatch([*srun_style, f"--dependency=afterok:{job_b}", SCRIPT],
                           env={**env, "LAUNCH_STYLE": "srun", "EXIT_DURATION_IN_MINS": "0.2"}, cwd=str(REPO_ROOT))
    b_out = out.replace("%j", str(job_b))
    deadline = time.time() + JOB_TIMEOUT_S
    while True:  # the output is only used to time the signal, never asserted on
        done = [int(i) for i in re.findall(r" iteration\s+(\d+)/", _tail(b_out, 20000))]
        if done and max(done) >= 8:
            break
        state = cluster.job(job_b).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job B {state}\n{_tail(b_out)}\n{cluster.logs()}"
        assert time.time() < deadline, f"job B did not reach iteration 8\n{_tail(b_out)}\n{cluster.logs()}"
        time.sleep(0.5)
    assert cluster.job(job_c).get("JobState") == "PENDING"
    cluster.run(["scancel", "--batch", "--signal=TERM", str(job_b)])
    finished(job_b)
    stopped_b = _latest_iteration(checkpoints)
    assert stopped_b >= 8
    assert _loss_steps(tensorboard) == list(range(1, stopped_b + 1))  # B started at 5, saved where it stopped

    # C: started by the dependency, continues from B's checkpoint.
    finished(job_c)
    stopped_c = _latest_iteration(checkpoints)
    assert stopped_c > stopped_b
    assert _loss_steps(tensorboard) == list(range(1, stopped_c + 1))
    print(f"SLURM chain: A 1-4, B 5-{stopped_b} (preempted), C {stopped_b + 1}-{stopped_c}; "
          f"{time.time() - t0:.0f} s")


def _losses_by_start(tensorboard_dir) -> list[dict[int, float]]:
    """{iteration: loss} of each start of the job (one event file each, oldest first)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for path in sorted(tensorboard_dir.glob("events.out.tfevents.*")):  # named by their start time
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        out.append({e.step: e.value for e in acc.Scalars("lm-loss-training/lm loss")})
    return out


REQUEUE_ITERS, HELD_AFTER = 12, 5


def test_a_requeued_job_resumes_and_ends_with_the_uninterrupted_jobs_losses(cluster, tmp_path):
    """Two jobs of the same run side by side: one straight, one submitted with --requeue and requeued once its
    checkpoint of iteration 4 (or a later one) is complete. The requeued one restarts (SLURM_RESTART_COUNT 1), resumes
    from its newest checkpoint, and both end at iteration 12 with the same loss at every iteration, bit for bit; the
    requeued one's log and TensorBoard count the restart and the iterations lost.

    The requeued job's ranks hold after iteration 5 until a signal reaches them (``faults.held_env``; iteration 4's
    checkpoint is written by then): on a fast machine the tiny job had otherwise finished all 12 iterations before
    the requeue landed, and its second start had nothing left to train (seen: no loss in its event file)."""
    out = str(tmp_path / "job-%j.out")
    args = ["--ntasks-per-node=2", f"--output={out}"]
    held = faults.held_env(tmp_path / "faults", HELD_AFTER)
    hold = {name: held[name] for name in ("PYTHONPATH", faults.HOLD_ENV)}
    jobs = {name: cluster.sbatch([*args, *(["--requeue"] if name == "requeued" else []), SCRIPT],
                                 env=_job_env(tmp_path, name, TRAIN_ITERS=str(REQUEUE_ITERS), SAVE_INTERVAL="2",
                                              LAUNCH_STYLE="srun", **(hold if name == "requeued" else {})),
                                 cwd=str(REPO_ROOT))
            for name in ("straight", "requeued")}
    checkpoints = tmp_path / "runs" / "requeued" / "checkpoints"
    deadline = time.time() + JOB_TIMEOUT_S
    while not ((checkpoints / "latest").is_file() and _latest_iteration(checkpoints) >= 4):
        state = cluster.job(jobs["requeued"]).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"{state}\n{cluster.logs()}"
        assert time.time() < deadline, f"no checkpoint of iteration 4\n{cluster.logs()}"
        time.sleep(0.5)
    requeued_at = _latest_iteration(checkpoints)
    cluster.run(["scontrol", "requeue", str(jobs["requeued"])])
    for name, job_id in jobs.items():
        info = cluster.wait(job_id, 2 * JOB_TIMEOUT_S)
        context = f"job {name} {job_id}: {info}\n--- job output ---\n{_tail(info.get('StdOut', ''))}\n{cluster.logs()}"
        assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), context
        assert info.get("Restarts") == ("1" if name == "requeued" else "0"), context
    (straight,), (first, second) = (_losses_by_start(tmp_path / "runs" / name / "tensorboard") for name in jobs)
    assert sorted(straight) == list(range(1, REQUEUE_ITERS + 1)), sorted(straight)
    # the second start resumed from a checkpoint (requeued_at or a later one), not from scratch, and ran to the end
    resumed_at = min(second) - 1
    assert requeued_at <= resumed_at <= max(first) and sorted(second) == list(range(resumed_at + 1, REQUEUE_ITERS + 1))
    assert {**first, **second} == straight  # every iteration's loss, bit for bit
    assert _latest_iteration(checkpoints) == REQUEUE_ITERS
    # the second start counts the restart and the iterations it trains again, in its log and in TensorBoard (the
    # job's progress file under --save, named by the job id, which the requeued job keeps)
    lost = max(first) - resumed_at
    counted = tensorboard_scalars(tmp_path / "runs" / "requeued" / "tensorboard")
    assert counted["restarts/restarts"] == [(resumed_at, 1.0)], sorted(counted)
    assert counted["restarts/iterations-lost"] == [(resumed_at, float(lost))]
    output = (tmp_path / f"job-{jobs['requeued']}.out").read_text()
    assert (f"job restart 1 (SLURM requeue: the same job, started again): the previous attempt had reached iteration "
            f"{max(first)}, this one resumes from iteration {resumed_at}: {lost} iteration(s) lost, {lost} in all"
            ) in output, _tail(output)
    assert "restarts/restarts" not in tensorboard_scalars(tmp_path / "runs" / "straight" / "tensorboard")
    print(f"requeued after the checkpoint of iteration {requeued_at}: the first start trained 1-{max(first)}, the "
          f"second {resumed_at + 1}-{REQUEUE_ITERS}, the straight job's losses")
