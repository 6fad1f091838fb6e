"""Fast checks of the benchmark scripts' own arithmetic (the benchmarks themselves run by hand)."""

import math
import os

import pytest
import torch

from megatron.config.hardware import flex_compiles_on_this_cpu
from megatron.testing.tolerance import tolerance


def test_flex_alibi_matches_the_models_sdpa_bias_on_cpu():
    pytest.importorskip("torch.nn.attention.flex_attention")
    from benchmarks import bench_gpu

    out = bench_gpu.attention_kernels(b=1, heads=4, seq=32, head_dim=16, reps=1, device="cpu")
    assert out["flex_error"] is None
    # Two bf16 attentions: the scaling, Q.K^T, the ALiBi bias (rounded to bf16 on the plain path), softmax's exp
    # and normalization, P.V (depth 6), summing over the 32 keys; the output is a weighted mean of the values, so
    # its roundings are on their size. The values as the benchmark draws them:
    torch.manual_seed(0)
    value = [torch.randn(1, 4, 32, 16, dtype=torch.bfloat16) for _ in range(3)][2]
    bound = tolerance(torch.bfloat16, 6, 32, value.float().abs().max().item())
    assert out["flex_vs_plain_max_abs_diff"] <= bound, out["flex_vs_plain_max_abs_diff"]
    assert out["plain_sdpa_bias"]["median_fwd_bwd_s"] > 0


def test_pipeline_names_map_to_gpt_model_names():
    from benchmarks import bench_train_vs_transformers as bench

    class FakeModule:
        def state_dict(self):
            return {"tied_modules.embed.word_embeddings.weight": 0, "3.input_layernorm.weight": 1,
                    "4.mlp.dense_4h_to_h.bias": 2, "6.weight": 3}  # BLOOM's numbering, 2 layers

    class FakeConfig:
        num_layers = 2
        tied_embeddings = True
        mtp_num_layers = 0

    ours = bench.Ours.__new__(bench.Ours)
    ours.engine = type("E", (), {"module": FakeModule()})()
    ours.rc = type("RC", (), {"model": FakeConfig()})()
    assert ours.gpt_state_dict() == {"embedding.word_embeddings.weight": 0, "layers.0.input_layernorm.weight": 1,
                                     "layers.1.mlp.dense_4h_to_h.bias": 2, "final_layernorm.weight": 3}


def test_train_benchmark_roofline_counts_the_step_flops_of_the_megatron_paper():
    """The roofline's GEMMs are the step's: 3 x the forward's 24 B s l h^2 (1 + s / 6h) + 2 B s h V (Narayanan et
    al. 2021, eq. 3, without recomputation's fourth pass)."""
    from benchmarks import bench_train_vs_transformers as bench

    m = bench.MODEL
    b, s, layers, h, vocab = m["micro_batch_size"], m["seq_length"], m["num_layers"], m["hidden_size"], 512
    forward = 24 * b * s * layers * h * h * (1 + s / (6 * h)) + 2 * b * s * h * vocab
    out = bench.layer_gemm_roofline(torch.float32, vocab, reps=1)
    assert out["step_gflop"] == pytest.approx(3 * forward / 1e9, rel=1e-12)
    assert out["gemm_step_s"] > 0 and set(out["shapes"]) == set(bench.gemm_shapes(vocab))


@pytest.mark.skipif(not flex_compiles_on_this_cpu(),
                    reason="the benchmark measures flex attention as inductor compiles it for the CPU, which it does "
                           "only with AVX2 kernels (elsewhere flex runs by blocks of SDPA)")
def test_bench_attention_runs_every_path_and_reports_time_and_memory():
    from benchmarks import bench_attention

    row = bench_attention.run([32], b=1, heads=4, head_dim=16, dtype_name="fp32", device="cpu", reps=1)["s32"]
    assert set(row) >= {"sdpa", "flex"}
    assert row["sdpa"]["materialized_bias_mib"] > 0 and row["flex"]["materialized_bias_mib"] == 0
    assert row["flex"]["saved_for_backward_mib"] < row["sdpa"]["saved_for_backward_mib"]
    assert row["sdpa"]["fwd_bwd_s"] > 0 and row["flex"]["fwd_s"] > 0


def test_bench_decode_step_splits_a_step_into_its_matrix_products_attention_and_the_rest():
    import argparse

    from benchmarks import bench_decode_step

    model = bench_decode_step.build_model(argparse.Namespace(num_layers=2, hidden_size=64))
    row = bench_decode_step.measure(model, b=3, reps=1)
    assert row["num_linears"] == 2 * 4 + 1  # QKV, dense, two MLP matrices per layer, and the tied output layer
    # Each part is timed on its own (reps=1 here), so their order is not asserted: on a loaded machine the
    # linears timed alone once took longer (2.34 ms) than the whole forward (2.27 ms).
    assert row["step_ms"] > 0 and row["forward_ms"] > 0 and row["linears_ms"] > 0 and row["attention_ms"] > 0
    # The script's own subtraction, of fields each rounded to 1e-3 ms: at most 4 x 0.5e-3 apart.
    assert abs(row["rest_ms"] - (row["forward_ms"] - row["linears_ms"] - row["attention_ms"])) < 2e-3


def test_bench_serving_reads_a_process_cpu_time_that_grows_with_its_work():
    from benchmarks import bench_serving

    before, cpu_before = bench_serving.process_cpu_seconds(os.getpid()), os.times()
    total = 0
    while os.times().user - cpu_before.user < 0.2:  # burn 0.2 s of this process's CPU
        total += sum(range(10000))
    grown = bench_serving.process_cpu_seconds(os.getpid()) - before
    assert 0.15 <= grown <= 0.2 + (os.times().system - cpu_before.system) + 0.05, grown


def test_bench_pipeline_bubble_counts_the_three_schedules_against_the_formulas():
    from benchmarks import bench_pipeline_bubble

    row = bench_pipeline_bubble.counted(12, 128)  # BLOOM-176B's PP with its final 128 micro-batches
    assert row["1f1b"]["idle_slots_per_stage"] == [row["1f1b"]["analytic_idle_slots"]] * 12 == [33] * 12
    assert row["zbh1"]["idle_slots_per_stage"] == [row["zbh1"]["analytic_idle_slots"]] * 12 == [11] * 12
    assert round(row["1f1b"]["bubble_fraction"], 4) == round(11 / 139, 4)
    assert round(row["zbh1"]["bubble_fraction"], 4) == round(11 / 395, 4)
    assert "multiple of 12" in row["interleaved_v2"]["refused"]  # 128 micro-batches do not form groups of 12
    # the measured layout (p = 4, m = 8): interleaving halves (v = 2) and quarters (v = 4) 1F1B's 9 idle units
    row = bench_pipeline_bubble.counted(4, 8)
    for name, idle in (("1f1b", 9), ("zbh1", 3), ("interleaved_v2", 4.5), ("interleaved_v4", 2.25)):
        assert row[name]["idle_slots_per_stage"] == [row[name]["analytic_idle_slots"]] * 4 == [idle] * 4, name
    assert round(row["interleaved_v2"]["bubble_fraction"], 6) == round(3 / 19, 6)  # (p - 1) / (v m + p - 1)


def test_bench_moe_times_our_experts_and_transformers_experts_on_the_same_weights(monkeypatch):
    import argparse

    from benchmarks import bench_moe

    outputs = {}  # each layer's output by the order it ran: the roofline GEMM first, then ours
    time_layer = bench_moe.time_layer

    def recording(*args):
        seconds, out = time_layer(*args)
        outputs[len(outputs)] = out
        return seconds, out

    monkeypatch.setattr(bench_moe, "time_layer", recording)
    args = argparse.Namespace(tokens=32, hidden_size=16, ffn_hidden_size=24, num_experts=4, topk=2,
                              hf_implementations=["eager"], warmup=0, reps=1, load_skew=0.0)
    result = bench_moe.run_dtype(args, torch.float32)
    rows = result["paths"]
    assert set(rows) == {"gemm_roofline", "ours", "ours_padded", "ours_loop", "transformers_eager"}, rows
    assert rows["ours"]["experts_path"] == "segments"
    assert sum(result["expert_loads"]) == 32 * 2
    # the four compute the same function (transformers' Mixtral block holds our router and experts) in fp32:
    # the router's product, the scores and their renormalization (5), the expert's two products, SiLU and the gate
    # product (4), the weighting and the sum over the chosen experts (2): depth 12, the longest sum over 24.
    bound = tolerance(torch.float32, 12, 24, outputs[1].abs().max().item())
    for name, row in rows.items():
        assert row["fwd_bwd_s"] > 0, name
        if name != "gemm_roofline":
            assert row["tokens_per_s"] > 0 and row["expert_gflops"] > 0, name
            assert row["max_abs_diff_vs_ours"] <= bound, (name, row)
    assert rows["ours"]["speed_vs_ours"] == 1.0
    assert rows["transformers_eager"]["speed_vs_best_transformers"] == 1.0
    # a skewed router: expert 0 takes more than its even share
    skewed = bench_moe.run_dtype(argparse.Namespace(**{**vars(args), "load_skew": 4.0}), torch.float32)
    assert skewed["expert_loads"][0] == max(skewed["expert_loads"]) > 32 * 2 / 4


def test_bench_gpu_moe_row_runs_its_three_expert_paths_on_cpu():
    from benchmarks import bench_gpu

    out = bench_gpu.moe_experts(tokens=16, hidden=16, ffn=24, num_experts=4, topk=2, reps=1, device="cpu")
    for skew in ("skew_0", "skew_2"):
        entry = out[skew]
        assert sum(entry["counts"]) == 32
        # the same bf16 experts three ways: two products, SiLU and the gate product (4), sums over 24
        for path in ("segments", "padded", "loop"):
            assert "error" not in entry[path], (skew, path, entry[path])
            assert entry[path]["median_fwd_bwd_s"] > 0
            assert entry[path]["max_abs_diff_vs_segments"] <= tolerance(torch.bfloat16, 4, 24, 1.0), (skew, path)


def test_bench_muon_steps_adamw_and_muon_over_the_same_parameters(capsys):
    from benchmarks import bench_muon

    result = bench_muon.main(["--layers", "2", "--hidden-size", "32", "--heads", "4", "--vocab", "64", "--reps", "1",
                              "--warmup", "0"])
    paths = result["paths"]
    assert set(paths) == {"adam", "muon_fp32", "muon_bf16"} and paths["adam"]["vs_adam"] == 1
    for name in ("muon_fp32", "muon_bf16"):
        # per layer QKV, dense, h -> 4h, 4h -> h; the rest (embeddings, output layer, biases, norms) on AdamW
        assert paths[name]["muon_matrices"] == 8
        assert paths[name]["muon_params"] + paths[name]["adam_params"] == result["total_params"]
        assert paths[name]["muon_params"] == 2 * (3 + 1 + 4 + 4) * 32 * 32
        assert paths[name]["ns_gflop_per_step"] > 0


def test_bench_fp8_runs_its_three_sections_and_every_fp8_path_computes_the_product():
    import json
    import subprocess
    import sys

    from benchmarks import _common

    # One subprocess (the step section builds DeepSpeed engines: kept out of the test process), tiny sizes.
    argv = ["--gemm-shapes", "16x256x24", "--linear-shape", "16x256x24", "--step-layers", "1", "--step-hidden",
            "64", "--step-heads", "4", "--step-ffn", "128", "--step-seq", "16", "--step-mbs", "2", "--reps", "1",
            "--warmup", "0", "--step-reps", "1", "--step-warmup", "0"]
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_fp8", *argv], cwd=_common.REPO,
                          capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["threads"] >= 1 and result["versions"]["torch"] and "note" in result
    gemm = result["gemm"]["16x256x24"]["paths"]
    assert set(gemm) == {"fp32", "bf16"} | {f"fp8_{r}{q}" for r in ("tensorwise", "blockwise", "mxfp8")
                                             for q in ("", "_quantized", "_dequantized_fp32")}
    linear = result["linear"]["paths"]
    assert set(linear) == {"fp32", "bf16"} | {f"fp8_{r}" for r in ("tensorwise", "delayed", "blockwise", "mxfp8")}
    # Against the fp32 product, relative to its largest value: each operand rounded once to the path's narrowest
    # type and the output once (depth 3; bf16 output, below FP8's rounding), sums over K = 256 in fp32. In the
    # layer's backward, hybrid's tensorwise / delayed output gradients are e5m2 (the widest eps, taken for every
    # FP8 path of the layer); every GEMM-section operand is e4m3.
    for name, row in gemm.items():
        dtype = torch.float32 if name == "fp32" else torch.bfloat16 if name == "bf16" else torch.float8_e4m3fn
        assert row["median_ms"] > 0 and row["gflops"] > 0, name
        assert row["rel_error_vs_fp32"] <= tolerance(dtype, 3, 256), (name, row)
    for name, row in linear.items():
        dtype = torch.float32 if name == "fp32" else torch.bfloat16 if name == "bf16" else torch.float8_e5m2
        assert row["median_ms"] > 0, name
        assert row["rel_error_vs_fp32"] <= tolerance(dtype, 3, 256), (name, row)
    assert 0 < gemm["fp8_tensorwise"]["rel_error_vs_fp32"]  # the FP8 paths did round (not an fp32 product)
    variants = result["step"]["variants"]
    assert set(variants) == {"bf16"} | {f"bf16_fp8_{r}" for r in ("tensorwise", "delayed", "blockwise", "mxfp8")}
    for name, row in variants.items():
        # one layer: QKV, dense and the MLP's two products run FP8 (the embedding and the output layer do not)
        assert row["fp8_layers"] == (0 if name == "bf16" else 4), (name, row)
        assert row["median_step_s"] > 0 and row["tokens_per_s"] > 0 and math.isfinite(row["first_loss"]), name


def test_bench_gpu_fp8_row_runs_bf16_and_every_recipe_on_cpu():
    from benchmarks import bench_gpu

    out = bench_gpu.fp8_layer_gemms(tokens=16, hidden=64, heads=4, query_groups=2, ffn=96, reps=1, device="cpu")
    assert out["products_k_n"] == {"qkv": (64, 128), "dense": (64, 64), "gate_up": (64, 192), "down": (96, 64)}
    assert out["flops_fwd_bwd"] == 6 * 16 * (64 * 128 + 64 * 64 + 64 * 192 + 96 * 64)
    assert out["peak_bf16_tflops"] is None and out["peak_fp8_tflops"] is None  # no MFU on a CPU
    for path in ("bf16", "fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "fp8_mxfp8"):
        assert "error" not in out[path], (path, out[path])
        assert out[path]["median_fwd_bwd_s"] > 0 and out[path]["mfu_vs_bf16_peak"] is None
        # the forward's output against bf16's: the operands rounded to e4m3 and the output to bf16 (depth 3),
        # sums over K up to 96 (down's); relative to the largest output
        assert out[path]["rel_error_vs_bf16"] <= tolerance(torch.float8_e4m3fn, 3, 96), (path, out[path])
    assert out["bf16"]["rel_error_vs_bf16"] == 0.0 and out["fp8_tensorwise"]["rel_error_vs_bf16"] > 0
