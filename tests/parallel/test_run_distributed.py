"""The multi-process test harness (megatron.testing.processes) reports each rank's own failure."""

import os

import pytest

from megatron.testing import DistributedTestError, run_distributed
from megatron.testing.tolerance import tolerance


def _refuse(rank, world_size):
    raise ValueError(f"refused on rank {rank} of {world_size}")


def _init_barrier(rank, world_size):
    import torch.distributed as dist

    dist.new_group(list(range(world_size)))  # a subgroup's creation runs the same barrier
    return os.environ.get("TORCH_DIST_INIT_BARRIER")


@pytest.mark.multiprocess
def test_a_function_failing_at_once_is_reported_by_every_rank():
    """Ranks that fail straight after joining must not tear the group down under a rank still connecting
    (CI once saw rank 0 die in gloo's connectFullMesh, "Connection closed by peer", instead)."""
    for _ in range(5):
        with pytest.raises(DistributedTestError) as err:
            run_distributed(_refuse, world_size=4, timeout=60)
        message = str(err.value)
        assert "4 of 4 ranks failed" in message, message
        for rank in range(4):
            assert f"ValueError: refused on rank {rank} of 4" in message, message
        assert "Connection closed" not in message


@pytest.mark.multiprocess
def test_every_group_is_created_behind_a_store_barrier():
    assert run_distributed(_init_barrier, world_size=2) == ["1", "1"]


def _compile_something_new(rank, world_size, salt):
    import torch

    # A constant no other test uses: inductor's code cache cannot hold this kernel already.
    compiled = torch.compile(lambda x: torch.cos(x) * salt + rank)
    value = compiled(torch.ones(4)).tolist()
    return value, os.environ["TORCHINDUCTOR_CACHE_DIR"]


@pytest.mark.multiprocess
def test_ranks_compile_with_a_cold_cache_after_the_caller_compiled(tmp_path, monkeypatch):
    """A process that compiled holds inductor's asynchronous compile pool; ranks forked from it wait forever
    on it when they compile something new (cold cache). The fork server's ranks inherit no such pool.

    The hang shows as run_distributed's timeout (every rank's stack in the error), not as a measured time: the
    ranks must come back with their values at all, however slowly a loaded machine compiles."""
    import math
    import random

    import torch

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    salt = 1.0 + random.random()
    # A float32 sine and product against Python's float64 ones: depth 2, nothing summed.
    value = torch.compile(lambda x: torch.sin(x) * salt)(torch.ones(4))
    diff = (value.double() - math.sin(1.0) * salt).abs().max().item()
    assert diff <= tolerance(torch.float32, 2, 1, scale=salt), value
    results = run_distributed(_compile_something_new, world_size=2, args=(salt,), timeout=180)
    for rank, (value, cache_dir) in enumerate(results):
        # The cosine, the product and the sum: depth 3, on numbers up to salt + rank.
        diff = max(abs(v - (math.cos(1.0) * salt + rank)) for v in value)
        assert diff <= tolerance(torch.float32, 3, 1, scale=salt + rank), (rank, value)
        assert cache_dir == str(tmp_path / "inductor")  # the caller's environment, set after the server started


def _hang_on_rank_one(rank, world_size):
    import time

    import torch.distributed as dist

    if rank == 1:
        time.sleep(600)  # never reaches the barrier
    dist.barrier()


@pytest.mark.multiprocess
def test_a_hang_is_stopped_with_every_ranks_stack():
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_hang_on_rank_one, world_size=2, timeout=10)
    message = str(err.value)
    assert "2 of 2 ranks failed" in message, message
    rank0, rank1 = message.split("--- rank 1 of 2 failed ---")
    assert "timed out after 10 s" in rank0 and "timed out after 10 s" in rank1, message
    # Each rank says where it was (faulthandler names Python frames only): rank 0 in the barrier, rank 1 in
    # the function itself (its sleep is C code).
    assert "in barrier" in rank0 and "in _hang_on_rank_one" in rank0, rank0
    assert "in _hang_on_rank_one" in rank1 and "in barrier" not in rank1, rank1
