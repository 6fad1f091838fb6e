"""FP8 GEMMs in the tensor-parallel layers (megatron.parallel.fp8_linear).

- One layer, one process: the backward keeps the input as 1-byte FP8 elements (and their scales), not in high
  precision; the output and the three gradients equal the products of the operands quantized by
  the recipe's rules (a reference built here from ``fp8_quantize``'s quantizers and float64 products), within the
  fp32 accumulation; the per-tensor recipes' scales are max / amax of exactly the tensors the products take.
- Delayed scaling: the history rolls newest first, ``max`` / ``most_recent`` and the margin give the scales of the
  formula, an all-zero or non-finite amax keeps the scale in use (Transformer Engine's rule).
- A ZB-H1 store defers dW and computes the same dW as the backward pass does.
- Loading: FP8 scaling state is dropped by a layer without FP8 and started afresh by one with delayed scaling
  whose checkpoint has none; the weights load strictly as before.
- TP = 2 (one 2-process launch): an MLP block (column- then row-parallel) with tensorwise FP8, with and without
  sequence parallelism, equals the block on one process within the fp32 accumulation tolerance: the amaxes of
  the split tensors are reduced over TP, so each rank quantizes its part with the scale one process uses (with a
  per-rank scale the outputs differ by FP8 roundings, about 2^-4, far outside this tolerance).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.config.fp8 import FP8Config
from megatron.model import GPTModel
from megatron.parallel.fp8_linear import FP8Scaling, enable_fp8, fp8_linear, update_fp8_scales
from megatron.parallel.fp8_quantize import amax, dequantize, quantize_blocks, quantize_tensor, tensor_scale
from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.parallel.state import group_rank, group_size
from megatron.parallel.weight_grad_store import WeightGradStore
from megatron.testing.tolerance import tolerance
from tests.helpers.model import tiny_config
from tests.helpers.parallel import gather, randn, rel_err, run_on_tp, seeded_init

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ["tensorwise", "delayed", "blockwise", "mxfp8"]


def _reference_product(a, b, kind, role_a, role_b, grad_dtype):
    """a [M, K] @ b [N, K]^T with both quantized along K as the recipe says, in float64."""
    def q(x, role):
        dtype = grad_dtype if role == "grad" else E4M3
        if kind in ("tensorwise", "delayed"):
            return dequantize(quantize_tensor(x, tensor_scale(amax(x), dtype), dtype))
        if kind == "mxfp8":
            return dequantize(quantize_blocks(x, (1, 32), E4M3, mx=True))
        return dequantize(quantize_blocks(x, (128, 128) if role == "weight" else (1, 128), E4M3))
    return q(a, role_a).double() @ q(b, role_b).double().t()


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_three_products_take_the_recipes_quantized_operands(recipe):
    config = FP8Config(fp8_format="hybrid", fp8_recipe=recipe)
    fp8 = FP8Scaling(config)
    x = randn(3, 4, 160, seed=1).requires_grad_()
    weight = (randn(48, 160, seed=2) * 0.05).requires_grad_()
    bias = randn(48, seed=3).requires_grad_()
    g = randn(3, 4, 48, seed=4)
    if recipe == "delayed":  # one iteration to fill the history: the scales are then the amaxes' (same tensors)
        fp8_linear(x, weight, bias, fp8).backward(g)
        update_fp8_scales(fp8)
        x.grad = weight.grad = bias.grad = None
    kept = []  # what the backward keeps: the input only as dW's FP8 operand (1 byte per element and its scales)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = fp8_linear(x, weight, bias, fp8)
    y.backward(g)
    assert [t.dtype for t in kept if t.numel() >= x.numel()] == [E4M3], [(t.dtype, t.shape) for t in kept]
    # beside it fp32 scales only: at most one per feature and block of tokens (the 12 tokens are one block here)
    assert all(t.dtype == torch.float32 and t.numel() <= x.numel() // 12 for t in kept if t.dtype != E4M3)
    grad_dtype = E5M2 if recipe in ("tensorwise", "delayed") else E4M3
    x2, dy = x.detach().reshape(-1, 160), g.reshape(-1, 48)
    expected_y = _reference_product(x2, weight.detach(), recipe, "input", "weight", grad_dtype) + bias.detach()
    expected_dx = _reference_product(dy, weight.detach().t(), recipe, "grad", "weight", grad_dtype)
    expected_dw = _reference_product(dy.t(), x2.t(), recipe, "grad", "input", grad_dtype)
    # fp32 accumulation of up to 160 (or 12 tokens') products, relative to the largest entry
    for name, got, expected, width in (("output", y.detach().reshape(-1, 48), expected_y, 160),
                                       ("input grad", x.grad.reshape(-1, 160), expected_dx, 48),
                                       ("weight grad", weight.grad, expected_dw, 12)):
        assert rel_err(got.double(), expected) <= tolerance(torch.float32, 1, width), (recipe, name)
    assert torch.equal(bias.grad, dy.sum(0))
    # FP8 really ran: not the unquantized product
    assert rel_err(y.detach().reshape(-1, 48).double(), x2.double() @ weight.detach().double().t()
                   + bias.detach().double()) > 1e-3


def test_delayed_scaling_history_and_scales():
    config = FP8Config(fp8_recipe="delayed", fp8_amax_history_len=3, fp8_amax_compute_algo="max", fp8_margin=1)
    fp8 = FP8Scaling(config)
    assert torch.equal(fp8.scale, torch.ones(3))  # before any amax: scale 1
    for amaxes in ([2.0, 4.0, 8.0], [1.0, 16.0, 0.5], [0.0, float("inf"), 0.25]):
        fp8.pending_amax.copy_(torch.tensor(amaxes))
        update_fp8_scales(fp8)
    assert torch.equal(fp8.amax_history, torch.tensor([[0.0, float("inf"), 0.25], [1.0, 16.0, 0.5],
                                                       [2.0, 4.0, 8.0]]))
    # max over the history, / 2^margin; the weight's history holds inf: its last finite scale stays (448/16/2)
    assert fp8.scale.tolist() == [448.0 / 2.0 / 2, 448.0 / 16.0 / 2, 448.0 / 8.0 / 2]
    assert torch.equal(fp8.pending_amax, torch.zeros(3))
    recent = FP8Scaling(FP8Config(fp8_recipe="delayed", fp8_amax_history_len=2))
    for amaxes in ([8.0, 8.0, 8.0], [2.0, 0.0, 4.0]):
        recent.pending_amax.copy_(torch.tensor(amaxes))
        update_fp8_scales(recent)
    assert recent.scale.tolist() == [224.0, 56.0, 112.0]  # most recent; an all-zero amax keeps 448 / 8


def test_a_zb_h1_store_defers_the_same_weight_gradient():
    config = FP8Config(fp8_recipe="tensorwise")
    layer = ColumnParallelLinear(64, 32, tp_group=None, init_method=seeded_init(5))
    enable_fp8(layer, config)
    x = randn(4, 2, 64, seed=6)
    out, _ = layer(x)
    out.square().sum().backward()
    immediate = layer.weight.grad.clone()
    layer.weight.grad, store = None, WeightGradStore()
    layer.weight_grad_store = store
    out, _ = layer(x)
    out.square().sum().backward()
    store.close_micro_batch()
    assert layer.weight.grad is None and store.num_pending == 1
    store.run_oldest()
    assert torch.equal(layer.weight.grad, immediate)


def test_checkpoints_load_with_and_without_fp8():
    config = tiny_config()
    plain = GPTModel(config)
    delayed = GPTModel(config.__class__(**{**config.__dict__, "fp8": FP8Config(fp8_recipe="delayed")}))
    assert any(".fp8.amax_history" in k for k in delayed.state_dict())
    with torch.no_grad():
        for p in delayed.parameters():
            p.add_(0.01)
        for m in delayed.modules():
            if isinstance(m, FP8Scaling):
                m.amax_history.fill_(3.0)
    plain.load_state_dict(delayed.state_dict())  # FP8 -> no FP8: the scaling state dropped, weights loaded
    for (name, a), b in zip(plain.named_parameters(), delayed.parameters(), strict=True):
        assert torch.equal(a, b), name
    fresh = GPTModel(config.__class__(**{**config.__dict__, "fp8": FP8Config(fp8_recipe="delayed")}))
    fresh.load_state_dict(plain.state_dict())  # no FP8 -> delayed: a fresh history
    assert all(torch.equal(m.amax_history, torch.zeros_like(m.amax_history)) for m in fresh.modules()
               if isinstance(m, FP8Scaling))
    with pytest.raises(RuntimeError, match="Missing key"):  # the weights stay strict
        state = plain.state_dict()
        del state[next(k for k in state if k.endswith("dense.weight"))]
        fresh.load_state_dict(state)


def _mlp(tp_group, sequence_parallel, config):
    column = ColumnParallelLinear(64, 256, tp_group=tp_group, init_method=seeded_init(7),
                                  sequence_parallel=sequence_parallel)
    row = RowParallelLinear(256, 64, tp_group=tp_group, input_is_parallel=True, init_method=seeded_init(8),
                            sequence_parallel=sequence_parallel)
    module = torch.nn.ModuleList([column, row])
    enable_fp8(module, config)
    return module


def _fp8_mlp_worker(tp_group) -> dict:
    tp, rank = group_size(tp_group), group_rank(tp_group)
    config = FP8Config(fp8_format="hybrid", fp8_recipe="tensorwise")
    x, g = randn(8, 2, 64, seed=9), randn(8, 2, 64, seed=10)
    ref = _mlp(None, False, config)
    x_ref = x.clone().requires_grad_()
    y_ref = ref[1](F.gelu(ref[0](x_ref)[0]))[0]
    (y_ref * g).sum().backward()
    errors = {}
    for sp in (False, True):
        mlp = _mlp(tp_group, sp, config)
        chunk = (lambda t: t.chunk(tp, 0)[rank]) if sp else (lambda t: t)  # noqa: E731
        x_in = chunk(x).clone().requires_grad_()
        y = mlp[1](F.gelu(mlp[0](x_in)[0]))[0]
        (y * chunk(g)).sum().backward()
        errors[sp] = {"output": rel_err(y, chunk(y_ref)), "input grad": rel_err(x_in.grad, chunk(x_ref.grad)),
                      "h->4h weight grad": rel_err(gather(mlp[0].weight.grad, 0, tp_group), ref[0].weight.grad),
                      "4h->h weight grad": rel_err(gather(mlp[1].weight.grad, 1, tp_group), ref[1].weight.grad)}
    return errors


@pytest.mark.multiprocess
def test_tensorwise_fp8_mlp_at_tp2_equals_one_process():
    results = run_on_tp(_fp8_mlp_worker, 2)
    # the quantized operands are the same as one process's: only the fp32 sums' order differs (depth: two
    # products and the activation forward, a gradient one product back through each and its own)
    bounds = {"output": tolerance(torch.float32, 3, 256), "input grad": tolerance(torch.float32, 7, 256),
              "h->4h weight grad": tolerance(torch.float32, 7, 256), "4h->h weight grad": tolerance(torch.float32, 7, 256)}
    for rank_errors in results:
        for sp, errors in rank_errors.items():
            for name, err in errors.items():
                assert err <= bounds[name], f"sequence parallel {sp}: {name} {err:.3g} > {bounds[name]:.3g}"


def test_first_and_last_layers_stay_bf16_when_asked():
    from megatron.parallel.fp8_linear import fp8_layers

    fp8 = FP8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                    num_layers_at_end_in_bf16=2)
    model = GPTModel(tiny_config(num_layers=5, fp8=fp8))
    with_fp8 = [i for i, layer in enumerate(model.layers) if fp8_layers(layer)]
    assert with_fp8 == [1, 2]
    assert all(len(fp8_layers(model.layers[i])) == 4 for i in with_fp8)  # QKV, dense, h->4h, 4h->h
    assert model.layers[0].mlp.dense_h_to_4h.fp8 is None
    with pytest.raises(ValueError, match="delayed scaling does not support layers in bf16"):
        FP8Config(fp8_recipe="delayed", first_last_layers_bf16=True).validate(4)
