"""RNGStatesTracker: dropout inside fork() differs across TP ranks, outside it is identical; forking
leaves the default stream untouched; get_states / set_states replay a dropout mask."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.parallel.random import MODEL_PARALLEL_RNG, RNGStatesTracker, model_parallel_rng_seed
from megatron.parallel.state import group_rank
from tests.helpers.parallel import run_on_tp


def _mask(device: str = "cpu") -> torch.Tensor:
    """A dropout mask of 4096 elements (p = 0.5) as bools."""
    return F.dropout(torch.ones(4096, device=device), p=0.5, training=True) != 0


def _tracker_worker(tp_group) -> dict:
    rank = group_rank(tp_group)
    tracker = model_parallel_rng_seed(1234, rank, tracker=RNGStatesTracker("cpu"))
    outside = _mask()
    with tracker.fork():
        inside = _mask()
    # Replay: the saved states reproduce the next forked mask exactly.
    states = tracker.get_states()
    with tracker.fork():
        first = _mask()
    tracker.set_states(states)
    with tracker.fork():
        replay = _mask()
    assert torch.equal(first, replay), f"rank {rank}: set_states did not replay the mask"
    assert not torch.equal(first, inside), f"rank {rank}: the forked stream did not advance"
    # Gather every rank's masks (test-side all_gather) for the parent to compare.
    masks = torch.stack([outside, inside]).to(torch.uint8)  # [2, 4096]
    gathered = [torch.empty_like(masks) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(gathered, masks, group=tp_group)
    # Plain lists: a tensor sent through torch.multiprocessing's queue shares memory with a child
    # that may have exited before the parent reads it.
    return [g.tolist() for g in gathered]


@pytest.mark.multiprocess
def test_fork_differs_across_tp_ranks_outside_identical():
    results = run_on_tp(_tracker_worker, 2)
    masks = [torch.tensor(m, dtype=torch.bool) for m in results[0]]  # [rank] -> [outside, inside]
    for rank in range(1, 2):
        assert torch.equal(masks[rank][0], masks[0][0]), f"rank {rank}: default-stream dropout differs"
        mismatch = (masks[rank][1] != masks[0][1]).float().mean().item()
        # Independent p=0.5 masks disagree on about half the elements.
        assert 0.4 < mismatch < 0.6, f"rank {rank}: forked masks agree too often ({mismatch:.3f})"


def test_fork_leaves_default_stream_untouched():
    tracker = RNGStatesTracker("cpu")
    torch.manual_seed(7)
    tracker.add("stream", 99)
    expected = [_mask(), _mask()]
    torch.manual_seed(7)
    tracker.reset()
    tracker.add("stream", 99)
    first = _mask()
    with tracker.fork("stream"):
        forked = _mask()
    assert torch.equal(first, expected[0]) and torch.equal(_mask(), expected[1])
    # The forked stream is the one seeded with 99.
    torch.manual_seed(99)
    assert torch.equal(forked, _mask())


def test_seed_offsets_match_megatron():
    tracker = model_parallel_rng_seed(100, 3, tracker=RNGStatesTracker("cpu"))
    assert tracker.seeds_ == {100 + 2718 + 3}
    with tracker.fork():
        forked = _mask()
    default = _mask()
    torch.manual_seed(100 + 2718 + 3)
    assert torch.equal(forked, _mask())
    torch.manual_seed(100)
    assert torch.equal(default, _mask())


def test_bad_names_and_seeds_raise():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="'a' is already tracked"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match=f"{MODEL_PARALLEL_RNG!r} is not tracked"):
        with tracker.fork():
            pass
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        RNGStatesTracker("meta")


def test_fork_restores_default_state_on_exception():
    tracker = RNGStatesTracker("cpu")
    tracker.add("s", 5)
    state = torch.get_rng_state()
    with pytest.raises(KeyError):
        with tracker.fork("s"):
            _mask()
            raise KeyError("boom")
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tracker_forks_the_cuda_stream_only():
    tracker = model_parallel_rng_seed(11, 1, tracker=RNGStatesTracker("cuda"))
    cpu_state = torch.get_rng_state()
    outside = _mask("cuda")
    with tracker.fork():
        inside = _mask("cuda")
    assert torch.equal(torch.get_rng_state(), cpu_state), "the CPU stream moved"
    torch.cuda.manual_seed(11 + 2718 + 1)
    assert torch.equal(inside, _mask("cuda"))
    torch.cuda.manual_seed(11)
    assert torch.equal(outside, _mask("cuda"))
