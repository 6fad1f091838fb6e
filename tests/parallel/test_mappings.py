"""The autograd collectives: forward and backward of each against the formula it stands for.

Inputs and upstream gradients differ per rank (scaled by rank + 1) so a sum, a gather and a slice
give different answers; inputs are non-contiguous views to exercise the contiguity handling. What only moves
numbers (identities, slices, gathers of the same products) must be exact; a sum over the ranks of x * (rank + 1)
against x * sum(rank + 1) within the tolerance of the products and the sum (megatron.testing.tolerance).
"""

import pytest
import torch
import torch.distributed as dist

from megatron.parallel import mappings as m
from megatron.parallel.state import group_rank, group_size
from megatron.testing.tolerance import tolerance
from tests.helpers.parallel import randn, rel_err, run_on_tp

S, B, H = 8, 3, 12  # S and H divisible by 2 and 4
# The mappings whose result is a sum over the ranks; every other one moves numbers and must be exact.
SUMMED = {"copy backward (all-reduce)", "reduce forward (all-reduce)", "gather-first backward (reduce-scatter)",
          "reduce-scatter-first forward"}


def _non_contiguous(*shape, seed: int) -> torch.Tensor:
    """A [*shape] view that is not contiguous (the transpose of a contiguous tensor)."""
    base = randn(*reversed(shape), seed=seed)
    out = base.permute(*reversed(range(len(shape))))
    assert not out.is_contiguous()
    return out


def _apply(fn, x: torch.Tensor, grad: torch.Tensor, group):
    """(fn(x), d<fn(x), grad>/dx) with x a fresh leaf."""
    x = x.detach().clone().requires_grad_() if x.is_contiguous() else x.detach().requires_grad_()
    y = fn(x, group)
    y.backward(grad)
    return y.detach(), x.grad


def _mappings_worker(tp_group) -> dict:
    tp, rank = group_size(tp_group), group_rank(tp_group)
    scale = float(rank + 1)
    total = float(tp * (tp + 1) // 2)  # sum over ranks of (rank + 1)
    x = _non_contiguous(S, B, H, seed=1)  # same full tensor on every rank
    g_full = _non_contiguous(S, B, H, seed=2)
    first, last = (lambda t: t.chunk(tp, 0)), (lambda t: t.chunk(tp, -1))
    errors = {}

    def record(name, actual, expected):
        errors[name] = rel_err(actual, expected)

    y, dx = _apply(m.copy_to_tensor_model_parallel_region, x, g_full * scale, tp_group)
    record("copy forward", y, x)
    record("copy backward (all-reduce)", dx, g_full * total)

    x_before = (x * scale).clone()
    y, dx = _apply(m.reduce_from_tensor_model_parallel_region, x * scale, g_full, tp_group)
    record("reduce forward (all-reduce)", y, x * total)
    record("reduce backward (identity)", dx, g_full)
    assert torch.equal(x * scale, x_before), f"rank {rank}: reduce modified its input"

    g_local = last(g_full)[rank] * scale
    y, dx = _apply(m.scatter_to_tensor_model_parallel_region, x, g_local, tp_group)
    record("scatter-last forward (slice)", y, last(x)[rank])
    record("scatter-last backward (all-gather)",
           dx, torch.cat([c * (r + 1) for r, c in enumerate(last(g_full))], dim=-1))

    y, dx = _apply(m.gather_from_tensor_model_parallel_region, last(x)[rank], g_full * scale, tp_group)
    record("gather-last forward (all-gather)", y, x)
    record("gather-last backward (slice)", dx, last(g_full)[rank] * scale)

    g_local = first(g_full)[rank] * scale
    y, dx = _apply(m.scatter_to_sequence_parallel_region, x, g_local, tp_group)
    record("scatter-first forward (slice)", y, first(x)[rank])
    record("scatter-first backward (all-gather)",
           dx, torch.cat([c * (r + 1) for r, c in enumerate(first(g_full))], dim=0))

    y, dx = _apply(m.gather_from_sequence_parallel_region, first(x)[rank], g_full * scale, tp_group)
    record("gather-first forward (all-gather)", y, x)
    record("gather-first backward (reduce-scatter)", dx, first(g_full)[rank] * total)

    y, dx = _apply(m.gather_replicated_sequence_region, first(x)[rank], g_full * scale, tp_group)
    record("gather-replicated forward (all-gather)", y, x)
    record("gather-replicated backward (slice)", dx, first(g_full)[rank] * scale)

    y, dx = _apply(m.reduce_scatter_to_sequence_parallel_region, x * scale, g_local, tp_group)
    record("reduce-scatter-first forward", y, first(x)[rank] * total)
    record("reduce-scatter-first backward (all-gather)",
           dx, torch.cat([c * (r + 1) for r, c in enumerate(first(g_full))], dim=0))

    if tp > 1:
        bad = torch.zeros(S, B, 2 * tp + 1)
        with pytest.raises(ValueError, match=f"{2 * tp + 1}.*{tp} tensor-parallel ranks"):
            m.scatter_to_tensor_model_parallel_region(bad, tp_group)
        with pytest.raises(ValueError, match=f"{2 * tp + 1}.*{tp} tensor-parallel ranks"):
            m.scatter_to_sequence_parallel_region(bad.transpose(0, 2), tp_group)
        _check_groups_of_one(rank, tp)
    return errors


def _check_groups_of_one(rank: int, tp: int) -> None:
    # new_group is collective: every rank creates every singleton group and keeps its own.
    singles = [dist.new_group([r]) for r in range(tp)]
    x = torch.randn(4, 2, 4)
    for fn in (m.copy_to_tensor_model_parallel_region, m.reduce_from_tensor_model_parallel_region,
               m.scatter_to_tensor_model_parallel_region, m.gather_from_tensor_model_parallel_region,
               m.scatter_to_sequence_parallel_region, m.gather_from_sequence_parallel_region,
               m.reduce_scatter_to_sequence_parallel_region, m.gather_replicated_sequence_region):
        assert fn(x, singles[rank]) is x, f"rank {rank}: {fn.__name__} on a group of one"
    dist.destroy_process_group(singles[rank])  # the others are not this rank's to destroy


TP_SIZES = [1, pytest.param(2, marks=pytest.mark.multiprocess),
            pytest.param(4, marks=pytest.mark.multiprocess)]


@pytest.mark.parametrize("tp", TP_SIZES)
def test_mappings_forward_and_backward(tp):
    results = run_on_tp(_mappings_worker, tp)
    assert len(results[0]) == 16, sorted(results[0])
    for rank, errors in enumerate(results):
        for name, err in errors.items():
            if name in SUMMED:  # each rank's product, the sum over the tp ranks: depth 2, width tp
                assert err <= tolerance(torch.float32, 2, tp), f"rank {rank} of tp={tp}: {name} relative error {err:.3g}"
            else:
                assert err == 0.0, f"rank {rank} of tp={tp}: {name} relative error {err:.3g}"


def test_group_none_is_identity_without_collectives():
    # No process group exists in this process: any collective call would raise.
    assert not dist.is_initialized()
    x = torch.randn(4, 2, 6)
    for name in m.__all__:
        assert getattr(m, name)(x, None) is x, name
