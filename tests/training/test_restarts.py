"""megatron.training.restarts: the restart count and the iterations lost, from the job's progress kept in a store
that every attempt shares (torchrun's, here a HashStore in one process, the default group one rank of gloo)."""

import datetime
import json

import pytest
import torch.distributed as dist

from megatron.training.restarts import RestartReport, RestartTracker


@pytest.fixture
def one_rank_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=dist.PrefixStore("group", store), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield store
    finally:
        dist.destroy_process_group()


def test_each_attempt_counts_the_iterations_since_its_checkpoint_and_the_job_keeps_the_sum(one_rank_group):
    job = one_rank_group  # the job's store: one for every attempt
    first = RestartTracker(job, rank=0)
    assert first.resumed(0) is None  # the first attempt is no restart
    for iteration in range(1, 8):
        first.reached(iteration)  # killed after iteration 7; the newest checkpoint is 4
    second = RestartTracker(job, rank=0)
    assert second.resumed(4) == RestartReport(restarts=1, reached=7, resumed=4, lost=3, lost_total=3)
    # the second attempt dies before finishing an iteration: the third loses nothing more
    third = RestartTracker(job, rank=0)
    assert third.resumed(4) == RestartReport(restarts=2, reached=4, resumed=4, lost=0, lost_total=3)
    third.reached(5)
    third.reached(6)  # killed after 6; the newest checkpoint is 6
    fourth = RestartTracker(job, rank=0)
    report = fourth.resumed(6)
    assert report == RestartReport(restarts=3, reached=6, resumed=6, lost=0, lost_total=3)
    assert report.scalars() == {"restarts/restarts": 3, "restarts/iterations-lost": 0,
                                "restarts/iterations-lost-total": 3}


def test_only_rank_0_records_progress(one_rank_group):
    RestartTracker(one_rank_group, rank=1).reached(5)
    assert not one_rank_group.check(["/megatron/progress"])


def test_a_store_that_no_longer_answers_stops_the_count_not_the_run(one_rank_group, capsys):
    class Gone:
        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")

    tracker = RestartTracker(Gone(), rank=0)
    tracker.reached(1)
    tracker.reached(2)  # asked no more
    assert tracker.store is None and capsys.readouterr().out.count("did not answer") == 1


def test_a_requeued_slurm_job_counts_from_its_progress_file_and_a_new_job_does_not(one_rank_group, tmp_path,
                                                                                     monkeypatch):
    """A SLURM job saving checkpoints keeps its progress in SAVE/job_progress/slurm-<job id>.json: the requeued job
    (the same id, a new launch, no torchrun store) reads the first start's progress; another job id starts clean."""
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    first = RestartTracker.from_launch(str(tmp_path))
    assert first.resumed(0) is None
    for iteration in range(1, 6):
        first.reached(iteration)  # requeued after iteration 5; the newest checkpoint is 4
    assert json.loads((tmp_path / "job_progress" / "slurm-41.json").read_text())["iteration"] == 5
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    report = RestartTracker.from_launch(str(tmp_path)).resumed(4)
    assert report == RestartReport(restarts=1, reached=5, resumed=4, lost=1, lost_total=1, source="SLURM")
    assert report.message().startswith("job restart 1 (SLURM requeue")
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # the next job of a chain resumes the same checkpoints: no restart
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert RestartTracker.from_launch(str(tmp_path)).resumed(4) is None
    monkeypatch.delenv("SLURM_JOB_ID")  # neither SLURM nor torchrun's store: nothing to count
    assert RestartTracker.from_launch(str(tmp_path)) is None
