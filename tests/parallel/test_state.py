"""ParallelState: the group layout equals DeepSpeed's PipeModelDataParallelTopology."""

import pytest
import torch
import torch.distributed as dist

from megatron.parallel.state import ParallelState, group_layout
from megatron.testing import run_distributed

LAYOUTS = [(2, 2, 2), (1, 2, 4), (4, 1, 2), (2, 4, 1)]  # (pp, tp, dp)


@pytest.mark.parametrize("pp,tp,dp", LAYOUTS)
def test_layout_matches_deepspeed_topology(pp, tp, dp):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    layout = group_layout(tp=tp, pp=pp, dp=dp)
    # DeepSpeed lists every group, singletons included, for each axis.
    assert layout.tensor == topo.get_axis_comm_lists("model")
    assert layout.pipeline == topo.get_axis_comm_lists("pipe")
    assert layout.data == topo.get_axis_comm_lists("data")
    for rank in range(pp * tp * dp):
        coord = topo.get_coord(rank)
        assert layout.coords(rank) == (coord.pipe, coord.data, coord.model)
        assert layout.rank_of(coord.pipe, coord.data, coord.model) == rank
    # Embedding group: first and last stage of each pipeline, same (data, model) coordinates.
    for ranks in layout.embedding:
        first, last = layout.coords(ranks[0]), layout.coords(ranks[-1])
        assert first[0] == 0 and last[0] == pp - 1 and first[1:] == last[1:]
    assert len(layout.embedding) == dp * tp


def test_world_size_mismatch_names_every_factor():
    from megatron.parallel.state import _check_sizes

    with pytest.raises(ValueError) as err:
        _check_sizes(tp=2, pp=3, dp=2, world_size=8)
    msg = str(err.value)
    for text in ("world size 8", "tensor-model-parallel size 2", "pipeline-model-parallel size 3",
                 "data-parallel size 2", "12"):
        assert text in msg, msg


def test_single_has_no_groups():
    state = ParallelState.single()
    assert (state.tp_size, state.pp_size, state.dp_size, state.world_size) == (1, 1, 1, 1)
    assert state.tp_group is None and state.is_first_stage and state.is_last_stage


def _create_and_check(rank, world_size, tp, pp):
    state = ParallelState.create(tp=tp, pp=pp)
    try:
        out = {}
        for name, group, size in (("tp", state.tp_group, state.tp_size), ("pp", state.pp_group, state.pp_size),
                                  ("dp", state.dp_group, state.dp_size)):
            if group is None:
                assert size == 1, (name, size)
                members = [rank]
            else:
                members = [None] * dist.get_world_size(group)
                dist.all_gather_object(members, rank, group=group)
            out[name] = members
        # An all-reduce over the embedding group sums the first and last stage's values.
        value = torch.tensor([float(rank)])
        if state.embedding_group is not None:
            dist.all_reduce(value, group=state.embedding_group)
        out["embedding_sum"] = value.item()
        out["coords"] = (state.pp_rank, state.dp_rank, state.tp_rank)
        return out
    finally:
        state.destroy()


@pytest.mark.multiprocess
def test_groups_on_eight_processes():
    tp, pp, dp = 2, 2, 2
    layout = group_layout(tp, pp, dp)
    results = run_distributed(_create_and_check, world_size=8, args=(tp, pp))
    for rank, out in enumerate(results):
        assert out["coords"] == layout.coords(rank)
        assert [g for g in layout.tensor if rank in g] == [out["tp"]]
        assert [g for g in layout.pipeline if rank in g] == [out["pp"]]
        assert [g for g in layout.data if rank in g] == [out["dp"]]
        (emb,) = [g for g in layout.embedding if rank in g]
        assert out["embedding_sum"] == float(sum(emb)), (rank, emb, out)


def _bad_world(rank, world_size):
    ParallelState.create(tp=3, pp=1)


@pytest.mark.multiprocess
def test_world_not_divisible_raises_on_every_rank():
    from megatron.testing import DistributedTestError

    with pytest.raises(DistributedTestError) as err:
        run_distributed(_bad_world, world_size=4)
    assert "world size 4 is not divisible by tensor-model-parallel size 3" in str(err.value)
    assert "rank 0" in str(err.value) and "rank 3" in str(err.value)
