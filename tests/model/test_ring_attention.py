"""Ring attention (megatron.model.ring_attention) over CP = 2 and CP = 4 gloo processes equals plain attention on
the whole sequence: outputs and the gradients of queries, keys and values within the tolerance of the online
softmax's depth (fp32, megatron.testing.tolerance), for causal, ALiBi, document masks, grouped-query heads and
value heads of another size than the query / key heads (multi-head latent attention's);
the bytes each rank sends equal the analytic count; recomputed in backward (selective recomputation's activation
checkpoint), the same numbers bit for bit and one more forward's bytes.

One launch per CP size runs every case; each rank holds the load-balanced slice (chunks i and 2c-1-i of 2c)
and must return exactly that slice of the reference output and gradients.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.model.positional import alibi_bias, alibi_slopes
from megatron.model.ring_attention import document_ids, ring_attention
from megatron.parallel.context_parallel import check_context_parallel_length, load_balanced_positions
from megatron.parallel.random import tracked_checkpoint_func
from megatron.testing import run_distributed
from megatron.testing.tolerance import tolerance

B, NP, HN, S = 2, 4, 8, 32
DV = 12  # multi-head latent attention's value heads: wider (or narrower) than the query / key heads
CASES = {  # name -> (key / value heads, alibi, documents, value head dim)
    "causal": (NP, False, False, HN),
    "alibi": (NP, True, False, HN),
    "documents": (NP, False, True, HN),
    "alibi gqa documents": (2, True, True, HN),
    "value heads of their own size": (NP, False, True, DV),
}


def _inputs(ng: int, documents: bool, dv: int):
    gen = torch.Generator().manual_seed(11)
    query = torch.randn(B, NP, S, HN, generator=gen)
    key, value = torch.randn(B, ng, S, HN, generator=gen), torch.randn(B, ng, S, dv, generator=gen)
    weight = torch.randn(B, NP, S, dv, generator=gen)  # the loss: sum(out * weight)
    position_ids = torch.arange(S).repeat(B, 1)  # [b, s]
    if documents:  # documents of uneven lengths, crossing the chunk borders; row 1 differs from row 0
        position_ids = torch.cat((torch.arange(5), torch.arange(13), torch.arange(14))).repeat(B, 1)
        position_ids[1] = torch.cat((torch.arange(20), torch.arange(12)))
    return query, key, value, weight, document_ids(position_ids) if documents else None


def _depth(cp: int) -> int:
    """Roundings from the inputs to an output of ring attention over ``cp`` ranks: one block's Q.K^T, scaling,
    bias, shift by the row's max, exp, sum and P.V with its division (7), then the online softmax's merges of
    the up to 2 cp blocks of a query half (2 cp - 1), each a rescale and a sum (2)."""
    return 7 + 2 * (2 * cp - 1)


def _reference(name):
    ng, alibi, documents, dv = CASES[name]
    query, key, value, weight, docs = _inputs(ng, documents, dv)
    query, key, value = (t.requires_grad_() for t in (query, key, value))
    positions = torch.arange(S)
    slopes = torch.tensor(alibi_slopes(NP)) if alibi else torch.zeros(NP)
    mask = alibi_bias(slopes, positions, positions)[None]  # [1, np, s, s]: causal (-inf after), ALiBi or 0
    if docs is not None:
        mask = mask.masked_fill(~(docs[:, :, None] == docs[:, None, :])[:, None], float("-inf"))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=1 / math.sqrt(HN),
                                         enable_gqa=ng != NP)
    (out * weight).sum().backward()
    return out.detach(), query.grad, key.grad, value.grad


def _worker(rank, world_size):
    import torch.distributed as dist

    import megatron.parallel.context_parallel as context_parallel

    torch.set_num_threads(1)
    sent = []
    original = context_parallel.dist.batch_isend_irecv

    def counting(ops):  # every byte this rank sends through the ring
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return original(ops)

    context_parallel.dist.batch_isend_irecv = counting
    group = dist.new_group(list(range(world_size)))
    mine = load_balanced_positions(S, world_size, rank)
    results = {}
    for name, (ng, alibi, documents, dv) in CASES.items():
        query, key, value, weight, docs = (None if t is None else t[:, :, mine] if t.dim() == 4 else t[:, mine]
                                           for t in _inputs(ng, documents, dv))
        query, key, value = (t.contiguous().requires_grad_() for t in (query, key, value))
        slopes = torch.tensor(alibi_slopes(NP)) if alibi else None
        sent.clear()
        out = ring_attention(query, key, value, group, 1 / math.sqrt(HN), slopes, docs)
        forward_bytes = sum(sent)
        (out * weight).sum().backward()
        results[name] = {"out": out.detach(), "grads": [query.grad, key.grad, value.grad],
                         "bytes": [forward_bytes, sum(sent) - forward_bytes]}
        if name == "alibi gqa documents":  # selective recomputation's form (megatron/model/attention.py)
            inputs = [t.detach().requires_grad_() for t in (query, key, value)]
            sent.clear()
            out = tracked_checkpoint_func(None)(ring_attention, *inputs, group, 1 / math.sqrt(HN), slopes, docs)
            forward_bytes = sum(sent)
            (out * weight).sum().backward()
            results["recomputed"] = {"out": out.detach(), "grads": [t.grad for t in inputs],
                                     "bytes": [forward_bytes, sum(sent) - forward_bytes]}
    dist.destroy_process_group(group)
    return {"positions": mine, "cases": results}


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def ring_results(request):
    return request.param, run_distributed(_worker, world_size=request.param, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_ring_attention_equals_whole_sequence_attention(ring_results, name):
    cp, results = ring_results
    reference = _reference(name)
    for rank, result in enumerate(results):
        mine = torch.tensor(result["positions"])
        case = result["cases"][name]
        got = [torch.tensor(case["out"])] + [torch.tensor(g) for g in case["grads"]]
        for label, value, full in zip(("output", "dq", "dk", "dv"), got, reference):
            expected = full[:, :, mine]
            diff = (value - expected).abs().max().item()
            # Gradients: one product back through each forward operation and their own, summing over the S keys.
            depth = _depth(cp) if label == "output" else 2 * _depth(cp) + 1
            bound = tolerance(torch.float32, depth, S, full.abs().max().item())
            assert diff <= bound, f"CP={cp} rank {rank} {name}: {label} differs by {diff:.2e}"


@pytest.mark.multiprocess
def test_ring_p2p_bytes_match_the_analytic_count(ring_results):
    """Forward: (c-1) hops of the K and V blocks; backward: (c-1) hops of K and V, c hops of dK and dV (fp32)."""
    cp, results = ring_results
    for name, (ng, _, _, dv) in CASES.items():
        block = B * ng * (S // cp) * (HN + dv) * 4  # one K and one V block of a rank, fp32 bytes
        for rank, result in enumerate(results):
            assert result["cases"][name]["bytes"] == [(cp - 1) * block, (cp - 1) * block + cp * block], \
                f"CP={cp} rank {rank} {name}"


@pytest.mark.multiprocess
def test_recomputed_ring_repeats_its_forward_in_backward(ring_results):
    """Under the activation checkpoint of --recompute-granularity selective the ring's output and gradients are the
    plain ring's bit for bit (the same operations), and its backward sends the forward's K / V hops once more."""
    cp, results = ring_results
    block = B * 2 * (S // cp) * 2 * HN * 4  # "alibi gqa documents": 2 key / value heads, fp32
    for rank, result in enumerate(results):
        plain, recomputed = result["cases"]["alibi gqa documents"], result["cases"]["recomputed"]
        assert plain["out"] == recomputed["out"] and plain["grads"] == recomputed["grads"], rank  # as lists
        forward = (cp - 1) * block
        assert recomputed["bytes"] == [forward, forward + forward + cp * block], (cp, rank, recomputed["bytes"])


def test_sequence_not_divisible_by_twice_cp_is_refused():
    with pytest.raises(ValueError, match=r"sequence length 36 is not divisible by 2 x context-parallel size 4 = 8"):
        check_context_parallel_length(36, 4)
    with pytest.raises(ValueError, match="not divisible"):
        load_balanced_positions(30, 4, 0)
    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
