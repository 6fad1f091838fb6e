"""--dry-run of an FP8 job (--fp8-format): the report's FP8 section and lines, the planner's FP8 figures in the step
and memory sections, the refusal on a GPU without FP8 tensor cores (A100) before launch, and an FP8 job's default
GPU."""

from __future__ import annotations

import dataclasses

from megatron.dry_run.estimate import model_shape, planner_layout
from megatron.dry_run.report import build_report
from megatron.dry_run.text import render
from megatron.planner import CLUSTERS, GPUS, estimate_memory, estimate_step
from tests.helpers.arguments import tiny_config_argv

FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16"]


def _argv(files, *extra):
    return tiny_config_argv(files, num_layers=4) + ["--bf16", "--dry-run", "--world-size", "2", *extra]


def test_the_report_shows_fp8_and_uses_the_planners_fp8_figures(tokenizer_files):
    report = build_report(_argv(tokenizer_files, *FP8, "--dry-run-gpu", "H100-80GB"))
    assert report["ok"], report["problems"]
    f = report["fp8"]
    assert (f["format"], f["recipe"], f["forward_dtype"], f["grad_dtype"], f["wgrad"]) == \
        ("hybrid", "tensorwise", "e4m3", "e5m2", True)
    assert (f["fp8_layers"], f["bf16_layers"]) == ([[1, 2]], [[0, 0], [3, 3]])
    assert (f["peak_fp8_tflops"], f["peak_bf16_tflops"]) == (1979.0, 989.0)
    text = render(report).splitlines()
    fp8 = text.index("fp8          --fp8-format hybrid (e4m3 forward, e5m2 output gradients), recipe tensorwise")
    assert text[fp8 + 1] == ("  in FP8     layers 1-2: the transformer layers' linear GEMMs: QKV, attention output, "
                             "MLP")
    assert text[fp8 + 2] == ("  in bf16    layers 0, 3 whole; in every layer: core attention, embedding, output "
                             "layer (logits), norms")
    assert text[fp8 + 3].startswith("  planner    FP8 GEMMs at 1979 TFLOP/s peak on the H100-80GB, the rest at "
                                    "bf16's 989; MFU above is against the bf16 peak")
    # the step and memory sections are the planner's on the FP8 model shape, not the bf16 one
    from megatron.arguments.check import check_argv

    rc = check_argv(_argv(tokenizer_files, *FP8)).run_config
    shape, layout = model_shape(rc), planner_layout(rc, [4])
    gpu, cluster = GPUS["H100-80GB"], CLUSTERS["dgx-h100"]
    step = estimate_step(shape, layout, gpu, cluster, rc.data.seq_length, rc.batch.global_batch_size)
    bf16 = estimate_step(dataclasses.replace(shape, fp8=None), layout, gpu, cluster, rc.data.seq_length,
                         rc.batch.global_batch_size)
    assert report["step"]["step_s"] == round(step.step_s, 3) and step.step_s != bf16.step_s
    assert report["step"]["components_s"]["fp8_quantize"] == round(step.components_s["fp8_quantize"], 3)
    assert report["step"]["mfu_peak_tflops"] == 989.0
    memory = estimate_memory(shape, layout, rc.data.seq_length, rc.batch.global_batch_size)
    assert "fp8_transient" in report["memory"]["per_stage_gib"][0]
    assert report["memory"]["peak_gib"] == round(memory.peak / 2 ** 30, 2)


def test_fp8_on_an_a100_is_refused_before_launch_with_the_cause_and_the_fix(tokenizer_files):
    report = build_report(_argv(tokenizer_files, *FP8, "--dry-run-gpu", "A100-80GB"))
    assert not report["ok"]
    assert report["problems"] == ["--fp8-format needs FP8 tensor cores: torch._scaled_mm runs FP8 GEMMs on CUDA "
                                  "capability 8.9 or newer (Ada, Hopper), and the A100-80GB (--dry-run-gpu) has "
                                  "capability 8.0, without FP8 tensor cores; drop --fp8-format (train in bf16) or "
                                  "use H100 / H200 GPUs"]
    assert report["step"] is None and report["fp8"] is None
    assert any("FP8 does not run on the A100-80GB" in line for line in report["not_checked"])
    assert "error: --fp8-format needs FP8 tensor cores" in render(report)
    # the same job in bf16 is estimated on the A100
    assert build_report(_argv(tokenizer_files, "--dry-run-gpu", "A100-80GB"))["ok"]


def test_an_fp8_job_assumes_an_h100_without_dry_run_gpu(tokenizer_files):
    report = build_report(_argv(tokenizer_files, *FP8))
    assert report["ok"], report["problems"]
    assert report["step"]["gpu"] == report["fp8"]["gpu"] == "H100-80GB"
    assert build_report(_argv(tokenizer_files))["step"]["gpu"] == "A100-80GB"  # other jobs: the default as before
    assert build_report(_argv(tokenizer_files))["fp8"] is None
    every = render(build_report(_argv(tokenizer_files, "--fp8-format", "e4m3"))).splitlines()
    assert "fp8          --fp8-format e4m3 (e4m3 forward, e4m3 output gradients), recipe delayed (amax history 1, " \
           "most_recent, margin 0)" in every
    assert any(line.startswith("  in FP8     layers 0-3: ") for line in every)
    assert any(line.startswith("  in bf16    no whole layer; in every layer: core attention") for line in every)
