"""The multi-process test harness (megatron.testing.run_distributed) reports each rank's own failure."""

import os

import pytest

from megatron.testing import DistributedTestError, run_distributed


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
