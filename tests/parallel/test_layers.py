"""Column/RowParallelLinear and VocabParallelEmbedding against plain torch layers holding the
gathered weights: forward output, input gradient and (gathered) weight gradients at TP = 1, 2, 4,
every variant in one launch per TP size. Also: initialization independent of the TP size, the
parameter tags DeepSpeed reads, and the ValueErrors for bad sizes and out-of-range token ids.

TP=1 runs in the test process (group None); TP=2/4 run on gloo processes. The linear layers' products split
their sums over the ranks, so they agree within the tolerance of each product (megatron.testing.tolerance); the
embedding looks rows up, exactly.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.parallel.state import group_rank, group_size
from megatron.testing.tolerance import tolerance
from tests.helpers.parallel import gather, randn, rel_err, run_on_tp, seeded_init

S, B, H, OUT, V = 4, 3, 8, 12 * 4, 16  # sequence (divisible by 4 for sequence parallelism), batch, ...
TOKENS = S * B
# (layer, what) -> (depth, width) of the compared value, relative to its largest reference entry.
DEPTH_WIDTH = {
    ("column", "output"): (2, H),  # the product over h and the bias
    ("column", "input grad"): (2, OUT),  # the product over the outputs, split over the ranks and all-reduced
    ("column", "weight grad"): (1, TOKENS),  # the product over the tokens
    ("column", "bias grad"): (1, TOKENS),  # the sum over the tokens
    ("row", "output"): (3, OUT),  # the product over the inputs, split and all-reduced (or reduce-scattered), bias
    ("row", "input grad"): (1, H),  # the product over h
    ("row", "weight grad"): (1, TOKENS),  # the product over the tokens
    ("row", "bias grad"): (2, TOKENS),  # the sum over the tokens (under sequence parallelism: per rank, all-reduced)
}


TP_SIZES = [1, pytest.param(2, marks=pytest.mark.multiprocess),
            pytest.param(4, marks=pytest.mark.multiprocess)]


def _assert_errors(results: list[dict], tp: int) -> None:
    for rank, errors in enumerate(results):
        for name, err in errors.items():
            where = f"rank {rank} of tp={tp}: {name} relative error {err:.3g}"
            if name.startswith("embedding"):
                # Exact: a lookup of the same rows (other ranks add zeros), and its gradient adds the same rows'
                # upstream gradients into the same rows in the same token order (other ranks' tokens add zeros).
                assert err == 0.0, where
            else:
                depth, width = DEPTH_WIDTH[name.split("(")[0], name.split(") ")[-1]]
                assert err <= tolerance(torch.float32, depth, width), where


# ---- the checks ------------------------------------------------------------------------------------
def _check_column(tp_group, gather_output: bool, skip_bias_add: bool, sequence_parallel: bool) -> dict:
    tp, rank = group_size(tp_group), group_rank(tp_group)
    full = ColumnParallelLinear(H, OUT, tp_group=None, init_method=seeded_init(1))
    layer = ColumnParallelLinear(H, OUT, tp_group=tp_group, init_method=seeded_init(1),
                                 gather_output=gather_output, skip_bias_add=skip_bias_add,
                                 sequence_parallel=sequence_parallel)
    assert torch.equal(layer.weight, full.weight.chunk(tp, 0)[rank]), f"rank {rank}: weight not a slice"
    bias = randn(OUT, seed=2)
    ref = torch.nn.Linear(H, OUT)
    with torch.no_grad():
        ref.weight.copy_(full.weight)
        ref.bias.copy_(bias)
        layer.bias.copy_(bias.chunk(tp)[rank])
    x, g = randn(S, B, H, seed=3), randn(S, B, OUT, seed=4)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * g).sum().backward()

    x_in = (x.chunk(tp, 0)[rank] if sequence_parallel else x).clone().requires_grad_()  # [s(/tp), b, h]
    y, returned_bias = layer(x_in)
    if skip_bias_add:
        assert returned_bias is layer.bias, f"rank {rank}: skip_bias_add must return the bias"
        y = y + returned_bias
    else:
        assert returned_bias is None, f"rank {rank}: bias returned without skip_bias_add"
    y_expected = y_ref if gather_output else y_ref.chunk(tp, -1)[rank]
    g_local = g if gather_output else g.chunk(tp, -1)[rank]
    (y * g_local).sum().backward()
    x_grad_expected = x_ref.grad.chunk(tp, 0)[rank] if sequence_parallel else x_ref.grad
    return {"output": rel_err(y, y_expected), "input grad": rel_err(x_in.grad, x_grad_expected),
            "weight grad": rel_err(gather(layer.weight.grad, 0, tp_group), ref.weight.grad),
            "bias grad": rel_err(gather(layer.bias.grad, 0, tp_group), ref.bias.grad)}


def _check_row(tp_group, input_is_parallel: bool, skip_bias_add: bool, sequence_parallel: bool) -> dict:
    tp, rank = group_size(tp_group), group_rank(tp_group)
    full = RowParallelLinear(OUT, H, tp_group=None, init_method=seeded_init(5))
    layer = RowParallelLinear(OUT, H, tp_group=tp_group, init_method=seeded_init(5),
                              input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add,
                              sequence_parallel=sequence_parallel)
    assert torch.equal(layer.weight, full.weight.chunk(tp, 1)[rank]), f"rank {rank}: weight not a slice"
    bias = randn(H, seed=6)
    ref = torch.nn.Linear(OUT, H)
    with torch.no_grad():
        ref.weight.copy_(full.weight)
        ref.bias.copy_(bias)
        layer.bias.copy_(bias)
    x, g = randn(S, B, OUT, seed=7), randn(S, B, H, seed=8)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * g).sum().backward()

    x_in = (x.chunk(tp, -1)[rank] if input_is_parallel else x).clone().requires_grad_()
    y, returned_bias = layer(x_in)  # [s(/tp), b, h]
    if skip_bias_add:
        y = y + returned_bias
    else:
        assert returned_bias is None, f"rank {rank}: bias returned without skip_bias_add"
    y_expected = y_ref.chunk(tp, 0)[rank] if sequence_parallel else y_ref
    g_local = g.chunk(tp, 0)[rank] if sequence_parallel else g
    (y * g_local).sum().backward()
    x_grad_expected = x_ref.grad.chunk(tp, -1)[rank] if input_is_parallel else x_ref.grad
    return {"output": rel_err(y, y_expected), "input grad": rel_err(x_in.grad, x_grad_expected),
            "weight grad": rel_err(gather(layer.weight.grad, 1, tp_group), ref.weight.grad),
            # Replicated bias: every rank must hold the FULL gradient (summed over the sequence).
            "bias grad": rel_err(layer.bias.grad, ref.bias.grad)}


def _check_embedding(tp_group) -> dict:
    tp, rank = group_size(tp_group), group_rank(tp_group)
    full = VocabParallelEmbedding(V, H, tp_group=None, init_method=seeded_init(9))
    layer = VocabParallelEmbedding(V, H, tp_group=tp_group, init_method=seeded_init(9))
    assert torch.equal(layer.weight, full.weight.chunk(tp, 0)[rank]), f"rank {rank}: weight not a slice"
    assert (layer.vocab_start_index, layer.vocab_end_index) == (rank * V // tp, (rank + 1) * V // tp)
    ref = torch.nn.Embedding(V, H)
    with torch.no_grad():
        ref.weight.copy_(full.weight)
    ids = torch.randint(0, V, (B, S + 3), generator=torch.Generator().manual_seed(10))
    ids[0, :2] = torch.tensor([0, V - 1])  # both ends of the vocabulary, and repeats elsewhere
    g = randn(B, S + 3, H, seed=11)
    y_ref = ref(ids)
    (y_ref * g).sum().backward()
    y = layer(ids)
    (y * g).sum().backward()
    return {"output": rel_err(y, y_ref),
            "weight grad": rel_err(gather(layer.weight.grad, 0, tp_group), ref.weight.grad)}


def _check_bad_sizes(tp_group) -> None:
    tp, rank = group_size(tp_group), group_rank(tp_group)
    bad = 2 * tp + 1  # not divisible by tp >= 2
    cases = [(lambda: ColumnParallelLinear(H, bad, tp_group=tp_group), "ColumnParallelLinear"),
             (lambda: RowParallelLinear(bad, H, tp_group=tp_group), "RowParallelLinear"),
             (lambda: VocabParallelEmbedding(bad, H, tp_group=tp_group), "pad the vocabulary")]
    for build, word in cases:
        with pytest.raises(ValueError) as err:
            build()
        msg = str(err.value)
        assert str(bad) in msg and str(tp) in msg and word in msg, f"rank {rank}: {msg}"


def _check_out_of_range_ids(tp_group) -> None:
    layer = VocabParallelEmbedding(V, H, tp_group=tp_group)
    for bad_id in (-1, V, V + 7):
        ids = torch.tensor([[1, 2], [3, bad_id]])
        with pytest.raises(ValueError) as err:
            layer(ids)
        msg = str(err.value)
        assert f"token id {bad_id}" in msg and str(V) in msg, f"rank {group_rank(tp_group)}: {msg}"


def _check_tags_and_dtype(tp_group) -> None:
    rank = group_rank(tp_group)
    col = ColumnParallelLinear(H, OUT, tp_group=tp_group, init_method=seeded_init(12),
                               params_dtype=torch.bfloat16)
    row = RowParallelLinear(OUT, H, tp_group=tp_group, init_method=seeded_init(12))
    emb = VocabParallelEmbedding(V, H, tp_group=tp_group)
    tags = lambda p: (p.tensor_model_parallel, p.partition_dim, p.partition_stride)  # noqa: E731
    assert tags(col.weight) == (True, 0, 1) and tags(col.bias) == (True, 0, 1), f"rank {rank}"
    assert tags(row.weight) == (True, 1, 1) and tags(emb.weight) == (True, 0, 1), f"rank {rank}"
    assert row.bias.tensor_model_parallel is False, f"rank {rank}: row bias must be replicated"
    assert col.weight.dtype == torch.bfloat16 and not col.bias.any(), f"rank {rank}"
    # Initialized in fp32 and then cast: the bf16 shard is the rounded fp32 slice.
    full = ColumnParallelLinear(H, OUT, tp_group=None, init_method=seeded_init(12)).weight
    expected = full.chunk(group_size(tp_group), 0)[rank].to(torch.bfloat16)
    assert torch.equal(col.weight, expected), f"rank {rank}: bf16 weight is not the cast fp32 slice"


def _layers_worker(tp_group) -> dict:
    errors = {}
    for gather_output, skip_bias_add, sp in [(False, False, False), (True, False, False),
                                              (False, True, False), (False, False, True),
                                              (False, True, True)]:
        name = f"column(gather_output={gather_output}, skip_bias_add={skip_bias_add}, sp={sp})"
        for what, err in _check_column(tp_group, gather_output, skip_bias_add, sp).items():
            errors[f"{name} {what}"] = err
    for input_is_parallel, skip_bias_add, sp in [(False, False, False), (True, False, False),
                                                  (True, True, False), (True, False, True),
                                                  (True, True, True)]:
        name = f"row(input_is_parallel={input_is_parallel}, skip_bias_add={skip_bias_add}, sp={sp})"
        for what, err in _check_row(tp_group, input_is_parallel, skip_bias_add, sp).items():
            errors[f"{name} {what}"] = err
    for what, err in _check_embedding(tp_group).items():
        errors[f"embedding {what}"] = err
    _check_tags_and_dtype(tp_group)
    _check_out_of_range_ids(tp_group)
    if group_size(tp_group) > 1:
        _check_bad_sizes(tp_group)
    return errors


@pytest.mark.parametrize("tp", TP_SIZES)
def test_layers_match_torch_reference(tp):
    results = run_on_tp(_layers_worker, tp)
    assert len(results[0]) == 5 * 4 + 5 * 4 + 2, sorted(results[0])
    _assert_errors(results, tp)


def test_row_sequence_parallel_needs_parallel_input():
    with pytest.raises(ValueError, match="input_is_parallel=True"):
        RowParallelLinear(OUT, H, tp_group=None, sequence_parallel=True)


def test_default_init_is_normal_002_and_biases_zero():
    torch.manual_seed(0)
    layer = ColumnParallelLinear(256, 512, tp_group=None)
    std = layer.weight.std().item()
    assert abs(std - 0.02) < 0.001, std
    assert not layer.bias.any()
    assert abs(layer.weight.mean().item()) < 0.001


def test_embedding_matches_functional_on_one_rank():
    layer = VocabParallelEmbedding(V, H, tp_group=None, init_method=seeded_init(3))
    ids = torch.arange(V).view(2, -1)
    assert torch.equal(layer(ids), F.embedding(ids, layer.weight))
