"""DeepSpeed-Ulysses attention (megatron.engine.ulysses) equals the unsplit attention, outputs and gradients;
a model of a sequence-parallel rank is complete when built, or refused.

Each case runs the same layer (weights depend on (seed, name) only) on one process over the whole sequence,
and on SP (x TP) gloo processes through DeepSpeed's DistributedAttention, each holding s / sp tokens: every
rank's output must be its slice of the reference output, its input gradient the slice of the reference
input gradient, and its parameter gradients summed over the SP group (what DeepSpeed's reduction does) the
reference ones; for TP > 1 against the rank's TP slice. Then the whole GPTModel with the Ulysses loss
(an uneven loss mask) against gpt_loss on one process. Both within the tolerances of their depth
(megatron.testing.tolerance): the split changes the shapes of the products and the order of the sums.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.testing import run_distributed
from megatron.testing.tolerance import model_tolerance, step_depth, tolerance
from tests.helpers.model import tiny_config

S, B = 16, 2
# One attention layer: the QKV product, Q.K^T, the scaling, the bias, softmax's exp and normalization, P.V, the
# dense product (depth 8), the longest sum over the hidden size (64); its gradients one product back through
# each and their own (2 x 8 + 1), summing over the hidden size or the B x S = 32 tokens.
ATTENTION_DEPTH, ATTENTION_GRAD_DEPTH, WIDTH = 8, 17, 64


def _assert_within(got: torch.Tensor, expected: torch.Tensor, depth: int, width: int, what: str) -> None:
    diff = (got - expected).abs().max().item()
    assert diff <= tolerance(torch.float32, depth, width, expected.abs().max().item()), (what, diff)
CASES = {  # name -> ModelConfig overrides
    "absolute": dict(position_embedding_type="absolute"),
    "rotary gqa": dict(position_embedding_type="rotary", num_attention_heads=8, num_key_value_heads=4,
                       normalization="rmsnorm", swiglu=True, add_bias_linear=False),
    "alibi": dict(position_embedding_type="alibi", num_attention_heads=8, embed_layernorm=True),
}


def _hidden(config):
    return torch.randn(S, B, config.hidden_size, generator=torch.Generator().manual_seed(7))


def _attention_reference(config):
    from megatron.model.attention import SelfAttention

    attention = SelfAttention(config, None, 0)
    hidden = _hidden(config).requires_grad_()
    out = attention(hidden)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    (out * weight).sum().backward()
    return out.detach(), hidden.grad, {n: p.grad.clone() for n, p in attention.named_parameters()}, weight


def _attention_worker(rank, world_size, config, tp):
    from deepspeed.sequence.layer import DistributedAttention

    from megatron.engine.initialize import init_deepspeed_comm
    from megatron.engine.ulysses import ulysses_exchange
    from megatron.model.attention import SelfAttention
    from megatron.parallel.state import ParallelState

    torch.set_num_threads(1)
    init_deepspeed_comm("gloo")
    state = ParallelState.create(tp=tp, pp=1, sp=world_size // tp)
    try:
        attention = SelfAttention(config, state.layer_groups(ulysses_exchange(state)), 0)
        assert isinstance(attention._sequence_exchange, DistributedAttention), f"rank {rank}"
        part = S // state.sp_size
        cut = slice(state.sp_rank * part, (state.sp_rank + 1) * part)
        _, _, _, weight = _attention_reference(config)
        hidden = _hidden(config)[cut].clone().requires_grad_()
        out = attention(hidden)  # [s/sp, b, h]
        (out * weight[cut]).sum().backward()
        grads = {}
        for name, param in attention.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=state.sp_group)  # DeepSpeed sums over the SP ranks
            grads[name] = grad
        slopes = attention.alibi_slopes.tolist() if attention.alibi_slopes is not None else None
        return {"out": out.detach(), "input_grad": hidden.grad, "grads": grads, "cut": (cut.start, cut.stop),
                "tp_rank": state.tp_rank, "slopes": slopes}
    finally:
        state.destroy()


def _tensors(result: dict) -> dict:
    """run_distributed hands results back as plain lists: the tensors again."""
    out = dict(result)
    for key in ("out", "input_grad"):
        if key in out:
            out[key] = torch.tensor(out[key])
    out["grads"] = {n: torch.tensor(g) for n, g in out["grads"].items()}
    return out


def _tp_slice(full: torch.Tensor, name: str, tp: int, tp_rank: int) -> torch.Tensor:
    """The TP rank's slice of a reference gradient: rows for column-parallel weights, columns for dense."""
    if tp == 1 or name == "dense.bias":
        return full
    dim = 1 if name == "dense.weight" else 0
    return full.chunk(tp, dim=dim)[tp_rank]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,tp,sp", [(name, 1, 2) for name in CASES]
                         + [("rotary gqa", 2, 2), ("alibi", 2, 2)])  # TP x SP: the head-dependent cases
def test_ulysses_attention_equals_unsplit(name, tp, sp):
    config = tiny_config(**CASES[name])
    ref_out, ref_input_grad, ref_grads, _ = _attention_reference(config)
    results = run_distributed(_attention_worker, world_size=tp * sp, args=(config, tp), timeout=120)
    for rank, r in enumerate(results):
        start, stop = r["cut"]
        r = _tensors(r)
        _assert_within(r["out"], ref_out[start:stop], ATTENTION_DEPTH, WIDTH, f"rank {rank}: output")
        if tp == 1:  # with TP the input gradient is a partial sum (the layer norm's copy all-reduces it)
            _assert_within(r["input_grad"], ref_input_grad[start:stop], ATTENTION_GRAD_DEPTH, WIDTH,
                           f"rank {rank}: input gradient")
        for pname, grad in r["grads"].items():
            expected = _tp_slice(ref_grads[pname], pname, tp, r["tp_rank"])
            _assert_within(grad, expected, ATTENTION_GRAD_DEPTH, WIDTH, f"rank {rank} {pname}: gradient")
    if name == "alibi":
        from megatron.model.positional import alibi_slopes

        full = torch.tensor(alibi_slopes(config.num_attention_heads), dtype=torch.float32)
        per = config.num_attention_heads // (tp * sp)
        for rank, r in enumerate(results):
            sp_rank = (rank // tp) % sp  # independent of megatron.parallel: rank = sp_rank * tp + tp_rank
            first = r["tp_rank"] * (config.num_attention_heads // tp) + sp_rank * per
            assert r["slopes"] == full[first:first + per].tolist(), rank  # exact: a slice of the same fp32 cast


def _model_loss_reference(config, tokens, mask):
    from megatron.model import GPTModel

    model = GPTModel(config)
    positions = torch.arange(S)[None].expand(B, S)
    with torch.no_grad():
        logits = model(tokens[:, :-1], positions)  # [s, b, v]
    loss = model(tokens[:, :-1], positions, tokens[:, 1:], mask)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, logits


def _model_worker(rank, world_size, config, tokens, mask):
    from deepspeed.sequence.layer import DistributedAttention

    from megatron.engine.initialize import init_deepspeed_comm
    from megatron.engine.ulysses import sequence_parallel_loss, ulysses_exchange
    from megatron.model import GPTModel
    from megatron.parallel.state import ParallelState
    from megatron.training.batches import sequence_slice

    torch.set_num_threads(1)
    init_deepspeed_comm("gloo")
    state = ParallelState.create(tp=1, pp=1, sp=world_size)
    try:
        model = GPTModel(config, state, sequence_exchange=ulysses_exchange(state))
        exchanges = [layer.self_attention._sequence_exchange for layer in model.layers]
        assert len({id(e) for e in exchanges}) == config.num_layers, f"rank {rank}: one exchange per layer"
        assert all(isinstance(e, DistributedAttention) for e in exchanges), f"rank {rank}"
        positions = torch.arange(S)[None].expand(B, S)
        (ids, pos), (labels, m) = sequence_slice(((tokens[:, :-1], positions), (tokens[:, 1:], mask)),
                                                 state.sp_rank, state.sp_size)
        loss = sequence_parallel_loss(model(ids, pos, labels), m, state.sp_group)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=state.sp_group)
        grads = {}
        for name, param in model.named_parameters():
            grads[name] = param.grad.clone()
            dist.all_reduce(grads[name], group=state.sp_group)
        return {"loss": total.item(), "grads": grads}
    finally:
        state.destroy()


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_ulysses_model_loss_and_gradients_with_uneven_mask(name):
    config = tiny_config(**CASES[name])
    tokens = torch.randint(0, 200, (B, S + 1), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(B, S)
    mask[0, :11] = 0.0  # the first slice of row 0 counts nothing, the second only 5 of its 8 tokens
    mask[1, 12:] = 0.0
    ref_loss, ref_grads, ref_logits = _model_loss_reference(config, tokens, mask)
    # A token's loss moves by at most twice its logits' difference (the model's depth); the cross entropy's own
    # shift, exp, sum over the vocabulary, log and the masked mean's product, sum and division (depth 7) add theirs.
    loss_bound = (2 * model_tolerance(config, torch.float32, ref_logits)
                  + tolerance(torch.float32, 7, config.padded_vocab_size, ref_loss))
    # A gradient: a whole step's depth, its longest sum over the MLP's width or the tokens.
    grad_width = max(config.ffn_size, B * S)
    # the mean of the slices' own means would differ: the test can tell the right average from that
    results = run_distributed(_model_worker, world_size=2, args=(config, tokens, mask), timeout=120)
    for rank, r in enumerate(results):
        r = _tensors(r)
        loss_diff = abs(r["loss"] - ref_loss)
        assert loss_diff <= loss_bound, (rank, r["loss"], ref_loss)
        for pname, grad in r["grads"].items():
            _assert_within(grad, ref_grads[pname], step_depth(config.num_layers), grad_width,
                           f"rank {rank} {pname}: gradient")


def _sequence_parallel_state(sp_rank: int, sp_size: int):
    """A ParallelState at SP rank ``sp_rank`` of ``sp_size`` (no process groups: nothing here communicates)."""
    from megatron.parallel.state import ParallelState, group_layout

    return ParallelState(layout=group_layout(1, 1, 1, sp_size), rank=sp_rank)


def _no_exchange(local_attention):
    raise AssertionError("a refused model must not get as far as building its exchange")


def test_a_sequence_parallel_model_without_its_exchange_is_refused():
    from megatron.engine.pipeline import build_pipeline_module
    from megatron.engine.ulysses import ulysses_exchange
    from megatron.model import GPTModel, SequenceExchange
    from megatron.parallel.state import ParallelState

    config = tiny_config()
    assert ulysses_exchange(ParallelState.single()) is None
    with pytest.raises(ValueError, match="sequence-parallel rank 1 of 2 but the sequence exchange is rank 0 of 1"):
        GPTModel(config, _sequence_parallel_state(1, 2))
    with pytest.raises(ValueError, match="rank 0 of 1 but the sequence exchange is rank 1 of 2"):
        GPTModel(config, ParallelState.single(), sequence_exchange=SequenceExchange(1, 2, _no_exchange))
    with pytest.raises(ValueError, match="pipeline engine has no DeepSpeed-Ulysses.*size 2"):
        build_pipeline_module(config, _sequence_parallel_state(0, 2))
    for rank, size in ((2, 2), (0, 1), (-1, 2)):
        with pytest.raises(ValueError, match=f"sp_rank {rank} of a sequence-parallel group of {size}"):
            SequenceExchange(rank, size, _no_exchange)


def test_attention_is_built_for_its_sequence_rank():
    """The exchange is built once per layer around that layer's core attention, the ALiBi slopes are those of
    the heads the rank attends with after the all-to-all, and heads that do not split over SP are refused."""
    from megatron.model import GPTModel, SequenceExchange
    from megatron.model.attention import SelfAttention
    from megatron.model.positional import alibi_slopes
    from megatron.parallel.state import LayerGroups

    config = tiny_config(**CASES["alibi"])
    wrapped = []
    exchange = SequenceExchange(1, 2, lambda local_attention: wrapped.append(local_attention) or len(wrapped))
    model = GPTModel(config, _sequence_parallel_state(1, 2), sequence_exchange=exchange)
    assert [layer.self_attention._sequence_exchange for layer in model.layers] == [1, 2]
    assert [f.__self__ for f in wrapped] == [layer.self_attention for layer in model.layers]
    # exact: a slice of the same fp32 cast
    assert model.layers[1].self_attention.alibi_slopes.tolist() == torch.tensor(alibi_slopes(8), dtype=torch.float32)[4:].tolist()
    with pytest.raises(ValueError, match="4 query heads and 1 key / value heads .* TP x SP = 4"):
        SelfAttention(tiny_config(num_attention_heads=4, num_key_value_heads=1),
                      LayerGroups(sequence_exchange=SequenceExchange(0, 4, _no_exchange)), 0)
