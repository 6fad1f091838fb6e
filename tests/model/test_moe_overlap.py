"""The overlapped expert-parallel all-to-all (--overlap-moe-expert-parallel-comm, --moe-shared-expert-overlap) at
EP = 2 (2 processes, one launch) against the blocking one: the same MoE layer (SwiGLU, shared expert, aux and z
losses), the same tokens, its output and every gradient (input, router, experts, shared expert) within the layer's
fp32 tolerance, with and without capacity dropping (the capacity stays the micro-batch's when the tokens are split in
two parts). And where each exchange stood when the experts ran: the order proves the overlap (part 2's dispatch
started before part 1's experts computed, forward; part 2's gradient on its way back while part 1's experts' backward
ran), counted by ``take_exchange_stats`` (no clocks). The end-to-end run (ZB-H1 x EP = 2 with both flags, against
one process, resumed bit for bit) is tests/training/test_moe_schedules.py's."""

import pytest
import torch

from megatron.testing import run_distributed
from megatron.testing.tolerance import tolerance
from tests.helpers.model import tiny_config

HIDDEN, TOKENS_PER_RANK = 32, 12
# the layer's depth (tests/model/test_moe.py's LAYER_DEPTH): router, scores, the expert's products, the weighted
# sum, the shared expert; gradients one product back through each and the weight gradient's own
DEPTH = 13
GRAD_DEPTH = 2 * DEPTH + 1


def _layer_runs(rank, world_size):
    import torch.distributed as dist

    from megatron.config.moe import MoEConfig
    from megatron.model.moe import set_aux_loss_scale
    from megatron.model.transformer import _mlp
    from megatron.parallel.all_to_all import EXCHANGES, take_exchange_stats
    from megatron.parallel.state import LayerGroups

    torch.set_num_threads(1)
    group = dist.new_group([0, 1])
    x_all = torch.randn(2 * TOKENS_PER_RANK, 2, HIDDEN, generator=torch.Generator().manual_seed(0))
    g_all = torch.randn(2 * TOKENS_PER_RANK, 2, HIDDEN, generator=torch.Generator().manual_seed(1))
    mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    out = {}
    for capacity in (None, 1.0):
        for overlap in (False, True):
            moe = MoEConfig(num_experts=4, layer_pattern=(True,), router_topk=2, aux_loss_coeff=0.01,
                            z_loss_coeff=1e-3, shared_expert_intermediate_size=16, expert_capacity_factor=capacity,
                            overlap_expert_parallel_comm=overlap, shared_expert_overlap=overlap).validate(1)
            config = tiny_config(moe=moe, swiglu=True, hidden_size=HIDDEN, ffn_hidden_size=48, num_layers=1,
                                 num_attention_heads=4)
            layer = _mlp(config, LayerGroups(ep=group), 0)  # the MoE layer with its shared expert
            set_aux_loss_scale(layer, 0.5)
            seen = []
            experts = layer.experts

            def logged(rows, counts, weight, experts=experts, seen=seen):
                seen.append(("forward", EXCHANGES.calls))
                rows.register_hook(lambda grad: seen.append(("backward", EXCHANGES.calls)))
                return experts(rows, counts, weight)

            layer.__dict__["experts"] = logged  # the module stays registered (its parameters), called through this
            x = x_all[mine].clone().requires_grad_()
            take_exchange_stats()
            y = layer(x)
            (y * g_all[mine]).sum().backward()
            stats = take_exchange_stats()
            out[capacity, overlap] = {
                "output": y.detach(), "input grad": x.grad,
                **{name: p.grad for name, p in layer.named_parameters()},
                "seen": seen, "calls": stats.calls, "bytes": stats.bytes_sent}
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_layer_runs, world_size=2)


@pytest.mark.parametrize("capacity", [None, 1.0], ids=["dropless", "capacity 1.0"])
def test_overlapped_exchanges_compute_what_the_blocking_ones_do(runs, capacity):
    for rank, out in enumerate(runs):
        blocking, overlapped = out[capacity, False], out[capacity, True]
        assert overlapped.keys() == blocking.keys()
        for name, expected in blocking.items():
            if not isinstance(expected, torch.Tensor):
                continue
            depth = DEPTH if name == "output" else GRAD_DEPTH
            diff = (overlapped[name] - expected).abs().max().item()
            assert diff <= tolerance(torch.float32, depth, HIDDEN, expected.abs().max().item()), (rank, name, diff)
        # the same rows travel, in twice as many exchanges (two parts, each dispatched (the rows and their routing
        # weights) and combined, and back)
        assert (blocking["calls"], overlapped["calls"]) == (6, 12), rank
        assert overlapped["bytes"] == blocking["bytes"], rank


def test_one_parts_exchange_travels_while_the_others_experts_compute(runs):
    for rank, out in enumerate(runs):
        # blocking: the experts run once the dispatch (2 exchanges: the rows and their routing weights) is done;
        # their backward once the combine's gradient came back (4: dispatch, combine, combine's adjoint)
        assert out[None, False]["seen"] == [("forward", 2), ("backward", 4)], rank
        # overlapped, forward: part 1's experts run with both dispatches started (4), part 2's with part 1's
        # combine started too (5). Backward (part 2 first): both combines' gradients started back (6 + 2 = 8)
        # when part 2's experts' backward has run; part 2's dispatch gradients (rows, weights) on their way (10)
        # while part 1's ran
        assert out[None, True]["seen"] == [("forward", 4), ("forward", 5), ("backward", 8), ("backward", 10)], rank
