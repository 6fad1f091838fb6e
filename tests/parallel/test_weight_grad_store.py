"""The split backward of ZB-H1: input gradients in the backward pass, weight gradients deferred to a store.

A layer with a store computes the same output, input gradient and bias gradient in the backward pass, leaves the
weight's ``.grad`` untouched until its W pass runs, and then holds the same weight gradient as plain autograd: the
output exactly (the same F.linear), the gradients within the tolerance of their products
(megatron.testing.tolerance): the store computes them with its own matmuls, not autograd's kernels.
"""

import pytest
import torch

from megatron.model import GPTModel
from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.parallel.weight_grad_store import WeightGradStore, defer_weight_grads
from megatron.testing.tolerance import step_depth, tolerance
from tests.helpers.model import tiny_config
from tests.helpers.parallel import randn, rel_err, seeded_init


def _grads(layer, x, store=None, micro_batches=1):
    """Run ``micro_batches`` forward/backward passes of ``layer`` on ``x`` (scaled per micro-batch); the output,
    the input gradient, and each parameter's gradient after the backward passes and after the W passes."""
    layer.zero_grad(set_to_none=True)
    layer.weight_grad_store = store
    for i in range(micro_batches):
        xi = (x * (i + 1)).requires_grad_()
        out, _ = layer(xi)
        out.square().sum().backward()
        if store is not None:
            store.close_micro_batch()
    after_backward = {name: None if p.grad is None else p.grad.clone() for name, p in layer.named_parameters()}
    if store is not None:
        assert store.num_pending == micro_batches
        for _ in range(micro_batches):
            store.run_oldest()
        store.assert_empty()
    final = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return out.detach(), xi.grad, after_backward, final


@pytest.mark.parametrize("kind", ["column", "row"])
def test_deferred_weight_grad_matches_autograd(kind):
    if kind == "column":
        layer = ColumnParallelLinear(16, 24, tp_group=None, init_method=seeded_init(1))
    else:
        layer = RowParallelLinear(24, 16, tp_group=None, init_method=seeded_init(1))
    with torch.no_grad():
        layer.bias.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(2))
    x = randn(5, 3, layer.input_size, seed=3)  # [s, b, h]
    out, dx, _, plain = _grads(layer, x, micro_batches=2)
    out_z, dx_z, after_backward, deferred = _grads(layer, x, WeightGradStore(), micro_batches=2)
    assert torch.equal(out_z, out), kind
    tokens = x.shape[0] * x.shape[1]
    # dX = dY A: one product over the output features.
    assert rel_err(dx_z, dx) <= tolerance(torch.float32, 1, layer.output_size), kind
    assert after_backward["weight"] is None, f"{kind}: the weight gradient ran in the backward pass"
    # db and dA: a sum (a product) over the tokens, accumulated over the two micro-batches: depth 2.
    bias_err = rel_err(after_backward["bias"], plain["bias"])
    assert bias_err <= tolerance(torch.float32, 2, tokens), f"{kind}: bias gradient not in the backward pass"
    assert rel_err(deferred["weight"], plain["weight"]) <= tolerance(torch.float32, 2, tokens), kind


def test_deferred_weight_grad_reaches_the_parameter_under_recomputation():
    """Non-reentrant activation checkpointing hands the backward recomputed aliases of saved tensors; the W pass
    must still accumulate into the parameter itself."""
    first = ColumnParallelLinear(8, 16, tp_group=None, init_method=seeded_init(5))
    second = RowParallelLinear(16, 8, tp_group=None, init_method=seeded_init(6))

    def block(x):
        return second(torch.nn.functional.gelu(first(x)[0]))[0]

    def weight_grads(store, recompute):
        for layer in (first, second):
            layer.zero_grad(set_to_none=True)
            layer.weight_grad_store = store
        x = randn(4, 2, 8, seed=7).requires_grad_()
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        y.square().sum().backward()
        if store is not None:
            store.close_micro_batch()
            store.run_oldest()
        return [first.weight.grad, second.weight.grad]

    for plain, deferred in zip(weight_grads(None, False), weight_grads(WeightGradStore(), True)):
        # The second layer's input-gradient product, GeLU's backward, the weight gradient's product: depth 3,
        # the longest sum over the 16 features.
        assert deferred is not None
        assert rel_err(deferred, plain) <= tolerance(torch.float32, 3, 16)


def test_model_with_a_store_trains_the_same_gradients():
    """Every linear and the tied head of a whole model defer; after the W passes every gradient equals autograd's."""
    config = tiny_config()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    labels, mask = torch.roll(ids, -1, dims=1), torch.ones(2, 16)
    plain, split = GPTModel(config), GPTModel(config)
    store = WeightGradStore()
    # 2 per layer in attention, 2 in the MLP, and the embedding (its tied head)
    assert defer_weight_grads(split, store) == 4 * config.num_layers + 1
    plain(ids, labels=labels, loss_mask=mask).backward()
    loss = split(ids, labels=labels, loss_mask=mask)
    loss.backward()
    store.close_micro_batch()
    head = split.embedding.word_embeddings.weight
    lookup_only = head.grad.clone()  # the embedding lookup's part; the head's product waits
    store.run_oldest()
    assert not torch.equal(head.grad, lookup_only), "the tied head deferred nothing"
    # Every input gradient of the backward is the store's product, not autograd's: a whole step's depth, the
    # longest sum over the MLP's width.
    bound = tolerance(torch.float32, step_depth(config.num_layers), config.ffn_size)
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        assert rel_err(q.grad, p.grad) <= bound, name
    with torch.no_grad():  # evaluation defers nothing
        split(ids)
    store.assert_empty()


def test_store_refuses_a_w_pass_without_a_backward_and_a_step_with_waiting_ones():
    store = WeightGradStore()
    with pytest.raises(AssertionError, match="no deferred backward pass"):
        store.run_oldest()
    store.defer(lambda: None)
    with pytest.raises(AssertionError, match="incomplete gradients"):
        store.assert_empty()


@pytest.mark.parametrize("experts", [4, 1])  # 4: the unpadded row segments; 1: every row to one expert
def test_moe_layer_defers_its_experts_and_router_weights(experts):
    """The grouped experts' W1 and W2 (one batched product each) and the router's weight (computed in fp32) leave
    their ``.grad`` to the W pass, one pass per backward; the biases' come in the backward pass. After the W pass
    every gradient is plain autograd's within the tolerance of the layer's products."""
    from megatron.config.moe import MoEConfig
    from megatron.model.moe import MoELayer

    moe = MoEConfig(num_experts=experts, layer_pattern=(True, True), router_topk=1, aux_loss_coeff=0.01,
                    z_loss_coeff=0.001).validate(2)
    config = tiny_config(moe=moe, swiglu=True)
    plain, split = MoELayer(config, layer_number=0), MoELayer(config, layer_number=0)
    store = WeightGradStore()
    assert defer_weight_grads(split, store) == 2  # the router and the grouped experts
    x = randn(8, 3, config.hidden_size, seed=8)
    plain(x).square().sum().backward()
    split(x).square().sum().backward()
    store.close_micro_batch()
    deferred = ["router.weight", "experts.w1", "experts.w2"]
    grads = dict(split.named_parameters())
    assert [name for name in deferred if grads[name].grad is not None] == []
    assert grads["experts.fc1_bias"].grad is not None and grads["experts.fc2_bias"].grad is not None
    assert store.num_pending == 1
    store.run_oldest()
    store.assert_empty()
    # the deepest: the router weight's gradient, back through the experts' two products, their activation, the
    # routing weights' softmax and renormalization, then its own product: a depth of 13 over the 24 tokens' sums
    bound = tolerance(torch.float32, 13, x.shape[0] * x.shape[1])
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        assert q.grad is not None and rel_err(q.grad, p.grad) <= bound, (name, rel_err(q.grad, p.grad))


def test_a_weight_of_another_dtype_is_deferred_in_the_input_dtype_and_cast_back():
    """The MoE router's bf16 weight computes in fp32 (cast): the deferred gradient lands in bf16, as autograd's."""
    from megatron.parallel.weight_grad_store import linear

    def weight_grad(store):
        weight = torch.nn.Parameter(randn(4, 16, seed=9).bfloat16())
        x = randn(6, 16, seed=10).requires_grad_()
        linear(x, weight, None, store).square().sum().backward()
        if store is not None:
            assert weight.grad is None
            store.close_micro_batch()
            store.run_oldest()
        return weight.grad, x.grad

    (plain, plain_dx), (deferred, dx) = weight_grad(None), weight_grad(WeightGradStore())
    assert deferred.dtype == torch.bfloat16
    assert rel_err(deferred, plain) <= tolerance(torch.bfloat16, 1, 6)
    assert rel_err(dx, plain_dx) <= tolerance(torch.float32, 1, 4)
