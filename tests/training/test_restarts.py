"""megatron.training.restarts: the restart count and the iterations lost, from the job's progress kept in a store
that every attempt shares (torchrun's, here a HashStore in one process, the default group one rank of gloo)."""

import datetime

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
    first = RestartTracker(job, attempt=0, rank=0)
    assert first.resumed(0) is None  # the first attempt is no restart
    for iteration in range(1, 8):
        first.reached(iteration)  # killed after iteration 7; the newest checkpoint is 4
    second = RestartTracker(job, attempt=1, rank=0)
    assert second.resumed(4) == RestartReport(restarts=1, reached=7, resumed=4, lost=3, lost_total=3)
    # the second attempt dies before finishing an iteration: the third loses nothing more
    third = RestartTracker(job, attempt=2, rank=0)
    assert third.resumed(4) == RestartReport(restarts=2, reached=4, resumed=4, lost=0, lost_total=3)
    third.reached(5)
    third.reached(6)  # killed after 6; the newest checkpoint is 6
    fourth = RestartTracker(job, attempt=3, rank=0)
    report = fourth.resumed(6)
    assert report == RestartReport(restarts=3, reached=6, resumed=6, lost=0, lost_total=3)
    assert report.scalars() == {"restarts/restarts": 3, "restarts/iterations-lost": 0,
                                "restarts/iterations-lost-total": 3}


def test_only_rank_0_records_progress(one_rank_group):
    RestartTracker(one_rank_group, attempt=0, rank=1).reached(5)
    assert not one_rank_group.check(["/megatron/progress"])


def test_a_store_that_no_longer_answers_stops_the_count_not_the_run(one_rank_group, capsys):
    class Gone:
        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")

    tracker = RestartTracker(Gone(), attempt=0, rank=0)
    tracker.reached(1)
    tracker.reached(2)  # asked no more
    assert tracker.store is None and capsys.readouterr().out.count("did not answer") == 1
