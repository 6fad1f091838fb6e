"""Muon (megatron/engine/muon.py) on one process: three updates of one matrix against a plain-PyTorch reference written
here from the Muon definition (EMA momentum, its Nesterov variant, the quintic Newton-Schulz iteration with the
published coefficients, each scale mode), the fused QKV weight as its three matrices, the Adam part against torch's
AdamW, which parameters Muon takes (Megatron-LM's rule), and the --muon-* flags' checks."""

import math

import pytest
import torch

from megatron.arguments import run_config_from_argv
from megatron.config import OptimizerConfig
from megatron.config.muon import ns_coefficients
from megatron.engine.muon import Muon
from megatron.engine.optimizer import build_client_optimizer
from megatron.testing import tiny_argv
from tests.helpers.muon import (
    EPS32,
    KELLER_JORDAN,
    MODDED_NANOGPT,
    SCALES,
    ns_tolerance,
    reference_orthogonalize,
    reference_steps,
)


def _muon(params, **flags):
    config = OptimizerConfig(optimizer="muon", lr=0.02, weight_decay=0.1, muon_fp32_matmul_prec="high", **flags)
    return Muon([{"params": params, "muon": True, "weight_decay": config.weight_decay}], config), config


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)], ids=["wide", "tall"])
@pytest.mark.parametrize("nesterov,coefficients,scale_mode", [
    (False, "quintic", "spectral"), (True, "quintic", "unit_rms_norm"), (True, "simple", "shape_scaling")])
def test_three_updates_of_one_matrix_equal_the_definition(shape, nesterov, coefficients, scale_mode):
    torch.manual_seed(0)
    weight = torch.randn(shape) * 0.1
    grads = [torch.randn(shape) for _ in range(3)]
    param = torch.nn.Parameter(weight.clone())
    optimizer, config = _muon([param], muon_nesterov=nesterov, muon_coefficient_type=coefficients,
                              muon_scale_mode=scale_mode, muon_extra_scale_factor=0.5, muon_momentum=0.8)
    published = KELLER_JORDAN * 5 if coefficients == "simple" else MODDED_NANOGPT
    expected = reference_steps(weight, grads, lr=config.lr, wd=config.weight_decay, beta=0.8, nesterov=nesterov,
                               coefficients=published, scale_mode=scale_mode, extra=0.5)
    step_size = config.lr * SCALES[scale_mode](*shape) * 0.5
    for step, (grad, want) in enumerate(zip(grads, expected, strict=True), start=1):
        param.grad = grad.clone()
        optimizer.step()
        # each step adds at most one Newton-Schulz error (times its step size) and one rounding of the weight
        tol = step * (step_size * ns_tolerance(published, min(shape)) + EPS32 * weight.abs().max().item() * 2)
        error = (param.detach().double() - want).abs().max().item()
        assert error <= tol, f"step {step}: {error} > {tol}"
    # the iteration did orthogonalise: the last update's singular values are near 1 (the quintic band)
    update = reference_orthogonalize(grads[0], published)
    singular = torch.linalg.svdvals(update)
    assert singular.min() > 0.5 and singular.max() < 1.3, singular


def test_fused_qkv_is_orthogonalised_as_its_query_key_and_value_rows():
    """Rows [groups, q + k + v, hn]: 2 query groups of 2 query heads, head size 4: q 8, k 4, v 4 rows per group."""
    torch.manual_seed(1)
    rows, hidden = (8, 4, 4), 12
    grad = torch.randn(2 * sum(rows), hidden)
    param = torch.nn.Parameter(torch.zeros_like(grad))
    config = OptimizerConfig(optimizer="muon", lr=1.0, weight_decay=0.0, muon_momentum=0.0,
                             muon_fp32_matmul_prec="high")
    optimizer = Muon([{"params": [param], "muon": True}], config, qkv_rows=rows, qkv_params=[param])
    param.grad = grad.clone()
    optimizer.step()
    per_group = grad.view(2, sum(rows), hidden)
    expected = torch.zeros(2, sum(rows), hidden, dtype=torch.float64)
    start = 0
    for size in rows:  # each part: the rows of every group stacked, orthogonalised whole, scaled by its own shape
        part = per_group[:, start:start + size].reshape(-1, hidden)
        ortho = reference_orthogonalize(part, MODDED_NANOGPT) * SCALES["spectral"](*part.shape)
        expected[:, start:start + size] = ortho.view(2, size, hidden)
        start += size
    tol = ns_tolerance(MODDED_NANOGPT, 8) * math.sqrt(16)
    assert (-param.detach().double() - expected.view_as(grad)).abs().max().item() <= tol
    # --muon-no-split-qkv: one matrix
    whole = torch.nn.Parameter(torch.zeros_like(grad))
    config = OptimizerConfig(optimizer="muon", lr=1.0, weight_decay=0.0, muon_momentum=0.0,
                             muon_fp32_matmul_prec="high", muon_split_qkv=False)
    optimizer = Muon([{"params": [whole], "muon": True}], config, qkv_rows=rows, qkv_params=[whole])
    whole.grad = grad.clone()
    optimizer.step()
    expected = reference_orthogonalize(grad, MODDED_NANOGPT) * SCALES["spectral"](*grad.shape)
    assert (-whole.detach().double() - expected).abs().max().item() <= tol


def test_the_adam_part_is_torch_adamw():
    torch.manual_seed(2)
    values, grads = torch.randn(7), [torch.randn(7) for _ in range(3)]
    ours, theirs = torch.nn.Parameter(values.clone()), torch.nn.Parameter(values.clone())
    config = OptimizerConfig(optimizer="muon", lr=0.01, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95,
                             adam_eps=1e-6)
    muon = Muon([{"params": [ours], "muon": False}], config)
    adamw = torch.optim.AdamW([theirs], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        muon.step()
        adamw.step()
    torch.testing.assert_close(ours.detach(), theirs.detach())


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        shapes = {"word_embeddings.weight": (16, 8), "position_embeddings.weight": (4, 8),
                  "layers.0.self_attention.query_key_value.weight": (24, 8), "layers.0.self_attention.dense.weight":
                  (8, 8), "layers.0.self_attention.dense.bias": (8,), "layers.0.input_layernorm.weight": (8,),
                  "layers.0.mlp.router.weight": (4, 8), "layers.0.mlp.experts.fc1_weight": (4, 8, 8),
                  "layers.0.mlp.experts.fc1_bias": (4, 8), "output_layer.weight": (16, 8)}
        self.names = {}
        for name, shape in shapes.items():
            key = name.replace(".", "_")
            self.register_parameter(key, torch.nn.Parameter(torch.zeros(shape)))
            self.names[key] = name

    def named_parameters(self, *args, **kwargs):
        for key, param in super().named_parameters(*args, **kwargs):
            yield self.names[key], param


def test_muon_takes_the_matrices_megatron_lm_gives_it():
    """Megatron-LM: every 2-D parameter except the word embeddings and the output layer (so the learned positions and
    the router too); 1-D, 3-D (our stacked experts) and biases ([experts, n] ones too) go to AdamW."""
    model = _Model()
    optimizer = build_client_optimizer(model, OptimizerConfig(optimizer="muon"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"])
    assert muon == ["layers.0.mlp.router.weight", "layers.0.self_attention.dense.weight",
                    "layers.0.self_attention.query_key_value.weight", "position_embeddings.weight"]
    decay = {g["name"]: g["weight_decay"] for g in optimizer.param_groups}
    assert decay == {"muon": 0.01, "decay": 0.01, "no_decay": 0.0}


def test_coefficient_step_rules():
    assert ns_coefficients("quintic", 10) == tuple(MODDED_NANOGPT) * 2
    assert ns_coefficients("simple", 3) == tuple(KELLER_JORDAN) * 3
    assert len(ns_coefficients("polar_express", 10)) == 10
    with pytest.raises(ValueError, match="not a multiple of 5"):
        ns_coefficients("quintic", 7)
    with pytest.raises(ValueError, match="below 8"):
        ns_coefficients("polar_express", 5)


@pytest.mark.parametrize("flags,match", [
    (["--muon-fp32-matmul-prec", "low"], "torch.set_float32_matmul_precision, which has no 'low'"),
    (["--muon-scalar-optimizer", "lion"], "lion is not implemented here"),
    (["--muon-num-ns-steps", "4"], "not a multiple of 5"),
    (["--muon-momentum", "1.0"], "--muon-momentum must be in"),
])
def test_flags_refused_with_the_cause(tiny_corpus, flags, match):
    with pytest.raises(ValueError, match=match):
        run_config_from_argv(tiny_argv(tiny_corpus, "--optimizer", "muon", *flags), world_size=1)


def test_flags_take_megatron_lm_meanings(tiny_corpus):
    rc = run_config_from_argv(tiny_argv(tiny_corpus, "--optimizer", "muon", "--muon-no-split-qkv", "--muon-nesterov",
                                        "--muon-tp-mode", "blockwise", "--muon-scale-mode", "unit_rms_norm"),
                              world_size=1)
    o = rc.optimizer
    assert (o.optimizer, o.muon_split_qkv, o.muon_nesterov, o.muon_tp_mode, o.muon_scale_mode) == (
        "muon", False, True, "blockwise", "unit_rms_norm")
    default = run_config_from_argv(tiny_argv(tiny_corpus, "--optimizer", "muon"), world_size=1).optimizer
    assert (default.muon_momentum, default.muon_num_ns_steps, default.muon_coefficient_type, default.muon_tp_mode,
            default.muon_fp32_matmul_prec, default.muon_split_qkv) == (0.9, 5, "quintic", "duplicated", "medium", True)


def test_flags_without_effect_here_say_so_at_startup(tiny_corpus):
    rc = run_config_from_argv(tiny_argv(tiny_corpus, "--optimizer", "muon", "--muon-use-syrk", "--muon-tp-mode",
                                        "distributed"), world_size=1)
    assert any(w.startswith("--muon-use-syrk has no effect here") for w in rc.startup_warnings), rc.startup_warnings
    assert any(w.startswith("--muon-tp-mode distributed runs as duplicated") for w in rc.startup_warnings)
    adam = run_config_from_argv(tiny_argv(tiny_corpus, "--muon-momentum", "0.95"), world_size=1)
    assert "--muon-momentum has no effect without --optimizer muon (--optimizer adam)" in adam.startup_warnings
    plain = run_config_from_argv(tiny_argv(tiny_corpus, "--optimizer", "muon"), world_size=1)
    assert not any("muon" in w for w in plain.startup_warnings), plain.startup_warnings


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_on_the_gpt_model_muon_takes_every_matrix_but_the_vocabulary_ones(untie):
    from megatron.model.gpt import GPTModel
    from tests.helpers.model import tiny_config

    config = tiny_config(position_embedding_type="absolute", untie_embeddings_and_output_weights=untie,
                         num_attention_heads=4, num_key_value_heads=2)
    model = GPTModel(config)
    optimizer = build_client_optimizer(model, OptimizerConfig(optimizer="muon"), model_config=config)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    matrices = {n for n, p in model.named_parameters() if p.dim() == 2}
    vocabulary = {"embedding.word_embeddings.weight"} | ({"output_layer.weight"} if untie else set())
    assert vocabulary <= matrices and muon == matrices - vocabulary
    # the fused QKV rows split per query group: 2 query heads, a key and a value head of 16 each
    assert optimizer.qkv_rows == (32, 16, 16) and len(optimizer._qkv) == 2
