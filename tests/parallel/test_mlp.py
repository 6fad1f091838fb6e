"""A Megatron MLP block (ColumnParallelLinear h->4h, GeLU, RowParallelLinear 4h->h) at TP=2 equals
the same block at TP=1, forward and backward, and talks exactly as much as Megatron says it should:
one all-reduce in the forward and one in the backward (with sequence parallelism: one all-gather
and one reduce-scatter each way, no all-reduce but the small bias-gradient one)."""

import collections
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.parallel.state import group_rank, group_size
from megatron.testing.tolerance import tolerance
from tests.helpers.parallel import gather, randn, rel_err, run_on_tp, seeded_init

S, B, H = 4, 2, 16
# TP splits the 4h -> h product's sum over the ranks (and, backward, the h -> 4h one's): relative to the largest
# reference entry, the output's h -> 4h product, bias, GeLU (2), 4h -> h product and bias: depth 6, the longest
# sum over 4h; a gradient one product back through each and its own (2 x 6 + 1).
OUTPUT_RTOL = tolerance(torch.float32, 6, 4 * H)
GRAD_RTOL = tolerance(torch.float32, 13, 4 * H)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
               "reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter")
# Older torch releases only have the *_tensor names: count them under the newer ones.
CANONICAL = {"all_gather_into_tensor": "all_gather_single",
             "reduce_scatter_tensor": "reduce_scatter_single"}


class ParallelMLP(torch.nn.Module):
    """h -> 4h (column-parallel) -> GeLU -> h (row-parallel); the 4h activation never leaves its rank."""

    def __init__(self, hidden_size: int, tp_group, sequence_parallel: bool = False):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, 4 * hidden_size, tp_group=tp_group,
                                                  init_method=seeded_init(21),
                                                  sequence_parallel=sequence_parallel)
        self.dense_4h_to_h = RowParallelLinear(4 * hidden_size, hidden_size, tp_group=tp_group,
                                               input_is_parallel=True, init_method=seeded_init(22),
                                               sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        intermediate, _ = self.dense_h_to_4h(x)  # [s, b, 4h/tp]
        output, _ = self.dense_4h_to_h(F.gelu(intermediate))  # [s(/tp), b, h]
        return output


@contextlib.contextmanager
def _count_collectives():
    """Count calls of torch.distributed collectives made while the block runs (this process only)."""
    counts = collections.Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[CANONICAL.get(name, name)] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _mlp_worker(tp_group, sequence_parallel: bool) -> dict:
    tp, rank = group_size(tp_group), group_rank(tp_group)
    ref, mlp = ParallelMLP(H, None), ParallelMLP(H, tp_group, sequence_parallel)
    with torch.no_grad():  # non-zero biases, so that bias handling is compared too
        for module, full in ((ref, True), (mlp, False)):
            b1, b2 = randn(4 * H, seed=23), randn(H, seed=24)
            module.dense_h_to_4h.bias.copy_(b1 if full else b1.chunk(tp)[rank])
            module.dense_4h_to_h.bias.copy_(b2)
    x, g = randn(S, B, H, seed=25), randn(S, B, H, seed=26)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * g).sum().backward()

    x_in = (x.chunk(tp, 0)[rank] if sequence_parallel else x).clone().requires_grad_()
    with _count_collectives() as forward_calls:
        y = mlp(x_in)
    g_local = g.chunk(tp, 0)[rank] if sequence_parallel else g
    with _count_collectives() as backward_calls:
        (y * g_local).sum().backward()
    chunk = (lambda t: t.chunk(tp, 0)[rank]) if sequence_parallel else (lambda t: t)  # noqa: E731
    col, row = mlp.dense_h_to_4h, mlp.dense_4h_to_h
    errors = {
        "output": rel_err(y, chunk(y_ref)), "input grad": rel_err(x_in.grad, chunk(x_ref.grad)),
        "h->4h weight grad": rel_err(gather(col.weight.grad, 0, tp_group),
                                      ref.dense_h_to_4h.weight.grad),
        "h->4h bias grad": rel_err(gather(col.bias.grad, 0, tp_group), ref.dense_h_to_4h.bias.grad),
        "4h->h weight grad": rel_err(gather(row.weight.grad, 1, tp_group),
                                      ref.dense_4h_to_h.weight.grad),
        "4h->h bias grad": rel_err(row.bias.grad, ref.dense_4h_to_h.bias.grad),
    }
    return {"errors": errors, "forward": dict(forward_calls), "backward": dict(backward_calls)}


def _both_variants(tp_group) -> dict:
    return {sp: _mlp_worker(tp_group, sp) for sp in (False, True)}


@pytest.mark.multiprocess
def test_mlp_tp2_equals_tp1_with_one_all_reduce():
    results = run_on_tp(_both_variants, 2)
    for rank, by_variant in enumerate(results):
        for sp, out in by_variant.items():
            for name, err in out["errors"].items():
                bound = OUTPUT_RTOL if name == "output" else GRAD_RTOL
                assert err <= bound, f"rank {rank}, sequence_parallel={sp}: {name} error {err:.3g}"
        plain, sp = by_variant[False], by_variant[True]
        assert plain["forward"] == {"all_reduce": 1}, f"rank {rank}: forward {plain['forward']}"
        assert plain["backward"] == {"all_reduce": 1}, f"rank {rank}: backward {plain['backward']}"
        # Sequence parallel: all-gather in, reduce-scatter out; backward the mirror image plus the
        # all-reduce of the replicated row bias gradient (each rank saw only its tokens).
        assert sp["forward"] == {"all_gather_single": 1, "reduce_scatter_single": 1}, (
            f"rank {rank}: sequence-parallel forward {sp['forward']}")
        assert sp["backward"] == {"all_gather_single": 1, "reduce_scatter_single": 1,
                                  "all_reduce": 1}, f"rank {rank}: backward {sp['backward']}"
