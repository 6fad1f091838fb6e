"""The planner with FP8 GEMMs (megatron/planner/fp8.py): the GPUs' FP8 peaks, the matmul time with the FP8 layers'
linear GEMMs at the FP8 rate (and --first-last-layers-bf16, --no-fp8-wgrad, ZB-H1's W), the quantizers' HBM bytes,
and the memory terms, each against numbers computed here from the formulas written out; the FP8 linear layers
the planner counts against the ones the model builds; and the startup capability check."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron.config.fp8 import FP8Config
from megatron.config.hardware import (
    PEAK_BF16_TFLOPS,
    PEAK_FP8_TFLOPS,
    check_fp8_device,
    fp8_capability_problem,
)
from megatron.planner import CLUSTERS, GPUS, Layout, ModelShape, estimate_memory, estimate_step
from megatron.planner.fp8 import fp8_shape_of, quantize_bytes
from megatron.planner.memory import fp8_kept_savings
from megatron.planner.performance import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY, GEMM_HALF_ROWS
from megatron.planner.specs import model_shape_of
from tests.helpers.config import tiny_model

H, KV, F, V, LAYERS = 1024, 256, 2816, 32000, 4  # a Llama-style shape: 8 heads, 2 key / value heads, SwiGLU
SEQ, MBS, TP = 2048, 2, 2
ROWS = SEQ * MBS
H100, A100, CLUSTER = GPUS["H100-80GB"], GPUS["A100-80GB"], CLUSTERS["dgx-h100"]
BF16_RATE = 989e12 * GEMM_EFFICIENCY * ROWS / (ROWS + GEMM_HALF_ROWS)
FP8_RATE = 1979e12 * GEMM_EFFICIENCY * ROWS / (ROWS + GEMM_HALF_ROWS)
LAYER_FLOPS = 2 * ROWS * H * (H + 2 * KV + H + 3 * F)  # one layer's forward linear GEMMs (QKV, output, SwiGLU MLP)
# (N, K) of each linear layer's weight on one of TP = 2 ranks: QKV, attention output, fc1 (gate + up), fc2
LINEARS = [((H + 2 * KV) / TP, H), (H, H / TP), (2 * F / TP, H), (H, F / TP)]


def _shape(**fp8) -> ModelShape:
    base = ModelShape(LAYERS, H, 8, V, F, embed_layernorm=False, tied_embeddings=False, num_key_value_heads=2,
                      swiglu=True, add_bias_linear=False, normalization="rmsnorm")
    if not fp8:
        return base
    return dataclasses.replace(base, fp8=fp8_shape_of(FP8Config(**fp8), LAYERS))


def _layout(**overrides) -> Layout:
    return Layout(TP, 1, 1, MBS, **{"recompute": False, **overrides})


def _matmul(fp8_layers: int, wgrad_fp8: bool = True) -> float:
    """The stage's matmul seconds per micro-batch at no recomputation: the linear GEMMs (forward, data and weight
    gradients), the core attention at ATTENTION_EFFICIENCY of the bf16 peak, the logits (3 GEMMs) in bf16."""
    bf16_layers = LAYERS - fp8_layers
    linear = bf16_layers * LAYER_FLOPS * 3 / TP / BF16_RATE
    linear += fp8_layers * LAYER_FLOPS * (2 / FP8_RATE + (1 / FP8_RATE if wgrad_fp8 else 1 / BF16_RATE)) / TP
    attention = LAYERS * 4 * MBS * SEQ * SEQ * H * 3 / TP / (989e12 * ATTENTION_EFFICIENCY)
    logits = 3 * 2 * ROWS * H * V / TP / BF16_RATE
    return linear + attention + logits


def test_the_gpus_fp8_peaks_are_the_datasheets():
    assert PEAK_FP8_TFLOPS == {"H100": 1979.0, "H200": 1979.0}
    assert all(PEAK_FP8_TFLOPS[gpu] == pytest.approx(2 * PEAK_BF16_TFLOPS[gpu], rel=1e-3) for gpu in PEAK_FP8_TFLOPS)
    assert [name for name, gpu in GPUS.items() if gpu.has_fp8] == ["H100-80GB", "H200-141GB"]
    assert GPUS["H200-141GB"].peak_fp8_tflops == 1979.0 and A100.peak_fp8_tflops is None


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise", "mxfp8"])
def test_the_fp8_layers_gemms_run_at_the_fp8_peak(recipe):
    bf16 = estimate_step(_shape(), _layout(), H100, CLUSTER, SEQ, MBS)
    fp8 = estimate_step(_shape(fp8_recipe=recipe), _layout(), H100, CLUSTER, SEQ, MBS)
    assert bf16.components_s["matmul"] == pytest.approx(_matmul(0), rel=1e-12)
    assert fp8.components_s["matmul"] == pytest.approx(_matmul(LAYERS), rel=1e-12)
    # the same model FLOPs, MFU against the bf16 peak (Megatron's convention) in both
    assert (fp8.model_flops, fp8.peak_tflops) == (bf16.model_flops, bf16.peak_tflops) == (fp8.model_flops, 989.0)
    assert "fp8_quantize" not in bf16.components_s and fp8.components_s["fp8_quantize"] > 0


def test_first_last_layers_bf16_and_no_fp8_wgrad():
    kept = _shape(fp8_recipe="tensorwise", first_last_layers_bf16=True)  # layers 0 and 3 in bf16
    assert kept.fp8.layer_pattern == (False, True, True, False)
    step = estimate_step(kept, _layout(), H100, CLUSTER, SEQ, MBS)
    assert step.components_s["matmul"] == pytest.approx(_matmul(2), rel=1e-12)
    no_wgrad = _shape(fp8_recipe="tensorwise", fp8_wgrad=False)
    step = estimate_step(no_wgrad, _layout(), H100, CLUSTER, SEQ, MBS)
    assert step.components_s["matmul"] == pytest.approx(_matmul(LAYERS, wgrad_fp8=False), rel=1e-12)


def test_zbh1_weight_pass_runs_at_the_rate_of_the_weight_gradients():
    """ZB-H1's bubble is (p - 1)(F + B - W) slots' worth: W, the weight-gradient GEMMs, at the FP8 rate, or at the
    bf16 rate under --no-fp8-wgrad; a longer W gives a smaller bubble."""
    layout = Layout(1, 2, 1, MBS, recompute=False, schedule="zbh1")
    fp8 = estimate_step(_shape(fp8_recipe="tensorwise"), layout, H100, CLUSTER, SEQ, 8 * MBS)
    no_wgrad = estimate_step(_shape(fp8_recipe="tensorwise", fp8_wgrad=False), layout, H100, CLUSTER, SEQ, 8 * MBS)
    assert no_wgrad.bubble_s / no_wgrad.slot_s < fp8.bubble_s / fp8.slot_s


def _quantize_reference(per_element: float, block: int = 0) -> float:
    """One micro-batch of the 4 FP8 layers, no recomputation: every linear layer quantizes X and W (forward),
    dY and W^T (data gradient), dY^T and X^T (weight gradient); block recipes add their per-K-block sums."""
    total = 0.0
    for n, k in LINEARS:
        x, w, dy = ROWS * k, n * k, ROWS * n
        total += per_element * 2 * (x + w + dy)
        if block:
            for m_, n_, k_ in ((ROWS, n, k), (ROWS, k, n), (n, k, ROWS)):
                total += m_ * n_ * (20 * math.ceil(k_ / block) + 10) + 2 * k_ * (m_ + n_)
    return LAYERS * total


@pytest.mark.parametrize("recipe, per_element, block", [("tensorwise", 4 * 2 + 25, 0), ("delayed", 33, 0),
                                                        ("blockwise", 2 + 37, 128), ("mxfp8", 39, 32)])
def test_the_quantizers_hbm_bytes(recipe, per_element, block):
    shape = _shape(fp8_recipe=recipe)
    assert quantize_bytes(shape, ROWS, TP, LAYERS, 0, False) == pytest.approx(_quantize_reference(per_element, block),
                                                                              rel=1e-12)
    step = estimate_step(shape, _layout(), H100, CLUSTER, SEQ, MBS)
    assert step.components_s["fp8_quantize"] == pytest.approx(_quantize_reference(per_element, block) / 3350e9,
                                                              rel=1e-12)


def test_memory_counts_one_transient_fp8_weight_and_delayed_scalings_buffers():
    bf16 = estimate_memory(_shape(), _layout(), SEQ, MBS).per_stage[0]
    delayed = estimate_memory(_shape(fp8_amax_history_len=16), _layout(), SEQ, MBS).per_stage[0]
    tensorwise = estimate_memory(_shape(fp8_recipe="tensorwise"), _layout(), SEQ, MBS).per_stage[0]
    largest = max(n * k for n, k in LINEARS)  # fc1's [2F/t, H], one byte per element
    assert largest == 2 * F / TP * H
    assert delayed["fp8_transient"] == tensorwise["fp8_transient"] == largest
    # amax_history [16, 3] + scale [3] + pending_amax [3], fp32, per linear layer
    assert delayed["fp8_scaling_state"] == LAYERS * 4 * (16 * 3 + 3 + 3) * 4
    assert tensorwise["fp8_scaling_state"] == 0
    for stage, shape in ((delayed, _shape(fp8_amax_history_len=16)), (tensorwise, _shape(fp8_recipe="tensorwise"))):
        # no FP8 weight copy; each layer (of the one micro-batch in flight) keeps its FP8 layers' inputs in FP8
        assert {k: v for k, v in stage.items() if not k.startswith("fp8_") and k != "activations"} == \
            {k: v for k, v in bf16.items() if k != "activations"}
        kept_less = fp8_kept_savings(shape, _layout(), SEQ, 2)
        assert kept_less > 0 and stage["activations"] == pytest.approx(bf16["activations"] - LAYERS * kept_less)


def test_the_planner_counts_the_linear_layers_the_model_runs_in_fp8():
    from megatron.model import GPTModel
    from megatron.parallel.fp8_linear import fp8_layers

    config = tiny_model(num_layers=4, swiglu=True, fp8=FP8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True))
    shape = model_shape_of(config)
    built = fp8_layers(GPTModel(config))
    assert shape.fp8.layer_pattern == (False, True, True, False)
    assert len(built) == 2 * 4  # QKV, output, fc1, fc2 in each of the two FP8 layers
    memory = estimate_memory(dataclasses.replace(shape, fp8=fp8_shape_of(dataclasses.replace(
        config.fp8, fp8_recipe="delayed", first_last_layers_bf16=False), 4)), Layout(1, 1, 1, 1), 32, 1).per_stage[0]
    delayed = fp8_layers(GPTModel(dataclasses.replace(config, fp8=FP8Config())))
    state = sum(b.numel() * b.element_size() for m in delayed for b in m.buffers())
    assert memory["fp8_scaling_state"] == state


def test_an_fp8_model_is_not_planned_on_an_a100():
    with pytest.raises(ValueError, match="A100-80GB has no FP8 tensor cores"):
        estimate_step(_shape(fp8_recipe="tensorwise"), _layout(), A100, CLUSTERS["dgx-a100"], SEQ, MBS)


@pytest.mark.parametrize("capability, ok", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                            ((10, 0), True), ((7, 0), False)])
def test_the_capability_check(capability, ok):
    problem = fp8_capability_problem(capability, "NVIDIA A100-SXM4-80GB")
    if ok:
        assert problem is None
    else:
        assert problem == (f"--fp8-format needs FP8 tensor cores: torch._scaled_mm runs FP8 GEMMs on CUDA capability "
                           f"8.9 or newer (Ada, Hopper), and NVIDIA A100-SXM4-80GB has capability "
                           f"{capability[0]}.{capability[1]}, without FP8 tensor cores; drop --fp8-format (train in "
                           f"bf16) or use H100 / H200 GPUs")


def test_the_startup_check_on_cuda_reads_the_capability_and_on_cpu_runs_scaled_mm(monkeypatch):
    import torch

    check_fp8_device(cuda=False)  # torch._scaled_mm runs here
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB has capability 8.0, without FP8 tensor cores"):
        check_fp8_device(cuda=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(cuda=True)

    def broken(*args, **kwargs):
        raise RuntimeError("_scaled_mm is not supported on this device")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    with pytest.raises(ValueError, match=r"torch._scaled_mm does not run on this CPU .*drop --fp8-format"):
        check_fp8_device(cuda=False)


def test_the_docs_llama3_8b_figures_are_the_planners():
    """docs/performance.md's table for Megatron-LM's Llama-3-8B FP8 script on 8 x H100 (TP 1, DP 8, MBS 1, global
    batch 128, seq 8192, fused attention) is what the planner computes."""
    from megatron.planner import LLAMA_SIZES
    from megatron.planner.specs import GiB
    from tests.helpers.paths import REPO_ROOT

    doc = (REPO_ROOT / "docs" / "performance.md").read_text()
    layout = Layout(1, 1, 8, 1, recompute=False, sequence_parallel=True, store_attention_scores=False)
    llama = LLAMA_SIZES["llama-3-8b"]
    rows = {"bf16": llama}
    for label, recipe in (("FP8 delayed / tensorwise", "delayed"), ("FP8 blockwise", "blockwise"),
                          ("FP8 mxfp8", "mxfp8")):
        config = FP8Config(fp8_format="hybrid", fp8_recipe=recipe, fp8_amax_history_len=1024,
                           fp8_amax_compute_algo="max")
        rows[label] = dataclasses.replace(llama, fp8=fp8_shape_of(config, 32))
    for label, shape in rows.items():
        step = estimate_step(shape, layout, H100, CLUSTER, 8192, 128)
        memory = estimate_memory(shape, layout, 8192, 128)
        quantize = f"{step.components_s['fp8_quantize']:.2f} s" if shape.fp8 else "-"
        assert (f"| {label} | {step.step_s:.1f} s | {step.mfu:.1%} | {step.components_s['matmul']:.2f} s | {quantize} | "
                f"{memory.peak / GiB:.1f} GiB |") in doc, label


def test_an_moe_layer_runs_its_attention_and_experts_in_fp8_and_its_router_in_bf16():
    """The planner's FP8 FLOPs of an MoE layer are QKV, the output projection, the shared expert's MLP and the k
    routed experts' MLPs each token goes through, the layers the model gives FP8 (counted on a built tiny MoE model:
    the routed experts one scaling per matrix); the router stays at the bf16 rate."""
    from megatron.config.moe import MoEConfig
    from megatron.model import GPTModel
    from megatron.parallel.fp8_linear import fp8_layers
    from megatron.planner.fp8 import layer_linears, routed_expert_linears
    from megatron.planner.moe import MoEShape

    moe = MoEConfig(num_experts=4, layer_pattern=(False, True), shared_expert_intermediate_size=32)
    config = tiny_model(swiglu=True, moe=moe, fp8=FP8Config(fp8_recipe="tensorwise"))
    shape = model_shape_of(config)
    built = fp8_layers(GPTModel(config))
    assert len(built) == (len(layer_linears(shape, 1)) + len(layer_linears(shape, 1, moe_layer=True))
                          + len(routed_expert_linears(shape, 1))) == 4 + 4 + 2

    shared, expert_ffn = 1408, 1408
    moe_shape = MoEShape(8, 2, expert_ffn, (True,) * LAYERS, shared_expert_ffn=shared)
    plain = dataclasses.replace(_shape(), moe=moe_shape)
    fp8 = dataclasses.replace(plain, fp8=fp8_shape_of(FP8Config(fp8_recipe="tensorwise"), LAYERS))
    bf16_step = estimate_step(plain, _layout(), H100, CLUSTER, SEQ, MBS)
    fp8_step = estimate_step(fp8, _layout(), H100, CLUSTER, SEQ, MBS)
    # attention projections, the shared expert and the 2 routed experts a token goes through
    in_fp8 = LAYERS * 2 * ROWS * H * (H + 2 * KV + H + 3 * (shared + 2 * expert_ffn))
    saved = in_fp8 * 3 / TP * (1 / BF16_RATE - 1 / FP8_RATE)
    assert bf16_step.components_s["matmul"] - fp8_step.components_s["matmul"] == pytest.approx(saved, rel=1e-9)
