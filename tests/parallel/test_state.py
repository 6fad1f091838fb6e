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
    assert "world size 4 is not a multiple of --tensor-model-parallel-size 3" in str(err.value)
    assert "rank 0" in str(err.value) and "rank 3" in str(err.value)


@pytest.mark.parametrize("tp,pp,dp,sp", [(2, 1, 2, 2), (1, 1, 2, 4), (2, 2, 1, 2), (1, 2, 2, 2)])
def test_ulysses_layout_against_an_independent_enumeration(tp, pp, dp, sp):
    """SP sits between data and model: ranks enumerated here by nested loops (pipe, data, seq, model)."""
    coords = {}
    rank = 0
    for p in range(pp):
        for d in range(dp):
            for s in range(sp):
                for t in range(tp):
                    coords[rank] = (p, d, s, t)
                    rank += 1
    layout = group_layout(tp, pp, dp, sp)

    def groups(same):  # ranks sharing the coordinates ``same`` picks, as sorted lists
        out = {}
        for r, c in coords.items():
            out.setdefault(same(c), []).append(r)
        return sorted(out.values())

    assert sorted(layout.sequence) == groups(lambda c: (c[0], c[1], c[3]))
    assert sorted(layout.sequence_data) == groups(lambda c: (c[0], c[3]))
    assert sorted(layout.tensor) == groups(lambda c: (c[0], c[1], c[2]))
    assert sorted(layout.data) == groups(lambda c: (c[0], c[2], c[3]))
    assert sorted(layout.pipeline) == groups(lambda c: (c[1], c[2], c[3]))
    for r, (p, d, s, t) in coords.items():
        assert layout.coords(r) == (p, d, t) and layout.sp_rank_of(r) == s and layout.rank_of(p, d, t, s) == r
    assert all(g == list(range(g[0], g[0] + sp * tp, tp)) for g in layout.sequence)  # inside tp*sp consecutive


def _ulysses_groups(rank, world_size, tp, sp):
    state = ParallelState.create(tp=tp, pp=1, sp=sp)
    try:
        return {"sp": dist.get_process_group_ranks(state.sp_group), "sp_rank": state.sp_rank,
                "sp_data": dist.get_process_group_ranks(state.sp_data_group), "dp_size": state.dp_size}
    finally:
        state.destroy()


@pytest.mark.multiprocess
def test_ulysses_groups_on_four_processes():
    out = run_distributed(_ulysses_groups, world_size=4, args=(2, 2))
    # TP = 2, SP = 2, DP = 1: rank = sp_rank * 2 + tp_rank
    assert [o["sp"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o["sp_rank"] for o in out] == [0, 0, 1, 1]
    assert [o["sp_data"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert {o["dp_size"] for o in out} == {1}


def test_bookkeeping_collectives_use_the_gpu_under_nccl_and_the_cpu_otherwise(monkeypatch):
    """NCCL has no CPU collectives: the exit check, the save lock's refusal, the MoE and MTP statistics, the timers
    and the token count make their tensors on ``collective_device()``, which must be this rank's GPU there."""
    from megatron.parallel.state import collective_device

    assert collective_device() == torch.device("cpu")  # no process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, device in (("gloo", torch.device("cpu")), ("nccl", torch.device("cuda", 3))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, name=backend: name)
        assert collective_device() == device, backend
