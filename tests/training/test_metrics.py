"""TFLOPs / MFU arithmetic: the training log's (metrics.py) and the planner's agree, by hand-checked numbers."""

import pytest

from megatron.config import ModelConfig
from megatron.config.model import megatron_flops
from megatron.planner import BLOOM_SIZES
from megatron.training.metrics import TrainingLogger, peak_tflops_for_device, throughput_metrics

BLOOM_176B = ModelConfig(num_layers=70, hidden_size=14336, num_attention_heads=112, padded_vocab_size=250880,
                         seq_length=2048)


def test_bloom_176b_iteration_flops_match_megatrons_formula_by_hand():
    # 24 * 4 * 2048 * 2048 * 70 * 14336^2 * (1 + 2048 / (6 * 14336) + 250880 / (16 * 70 * 14336))
    by_hand = 96 * 2048 * 2048 * 70 * 14336 ** 2 * (1 + 2048 / 86016 + 250880 / 16056320)
    assert BLOOM_176B.flops_per_iteration(2048, recompute=True) == pytest.approx(by_hand, rel=1e-12)
    shape = BLOOM_SIZES["176B"]  # the planner's description of the same model
    assert megatron_flops(shape.num_layers, shape.hidden_size, shape.vocab_size, 2048, 2048, True) == pytest.approx(
        by_hand, rel=1e-12)
    assert by_hand == pytest.approx(6.02e18, rel=0.01)


def test_throughput_metrics_split_model_and_hardware_flops():
    # BLOOM-176B at ~105 s per iteration on 384 GPUs: ~150 hardware TFLOPs, 3/4 of it model TFLOPs
    m = throughput_metrics(BLOOM_176B, 2048, True, 104.5, 384, peak_tflops_for_device("NVIDIA A100-SXM4-80GB"))
    assert m["hardware_tflops_per_gpu"] == pytest.approx(150.0, rel=0.01)
    assert m["model_tflops_per_gpu"] == pytest.approx(0.75 * m["hardware_tflops_per_gpu"])
    assert m["mfu"] == pytest.approx(m["model_tflops_per_gpu"] / 312.0)
    assert m["hfu"] == pytest.approx(m["hardware_tflops_per_gpu"] / 312.0)
    no_recompute = throughput_metrics(BLOOM_176B, 2048, False, 104.5, 384, None)
    assert no_recompute["hardware_tflops_per_gpu"] == no_recompute["model_tflops_per_gpu"]
    assert no_recompute["mfu"] is None  # CPU / unknown device: TFLOPs only
    with pytest.raises(ValueError):
        throughput_metrics(BLOOM_176B, 2048, True, 0.0, 384, 312.0)


def test_peak_lookup_and_override():
    assert peak_tflops_for_device("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops_for_device("NVIDIA H200") == 989.0
    assert peak_tflops_for_device("NVIDIA A100-SXM4-40GB") == 312.0
    assert peak_tflops_for_device(None) is None
    assert peak_tflops_for_device("NVIDIA A100-SXM4-40GB", override=250.0) == 250.0


class _Scalars:
    def __init__(self):
        self.values = {}

    def add_scalar(self, tag, value, step):
        self.values[tag, step] = value


def test_log_throughput_adds_megatron_lms_field_tokens_per_gpu_and_mfu_where_the_peak_is_known():
    common = dict(iteration=4, train_iters=10, consumed_samples=32, consumed_tokens=1024, elapsed_ms_per_iter=250.0,
                  lr=1e-3, global_batch_size=8, loss=2.0, grad_norm=1.0, skipped=0, nan_iters=0, seq_length=32,
                  tflops_per_gpu=4.0, model_tflops_per_gpu=3.0, world_size=2)
    writer = _Scalars()
    line = TrainingLogger(writer, log_throughput=True, print_fn=lambda *a, **k: None).training(**common, mfu=0.25)
    # 8 x 32 tokens in 0.25 s over 2 GPUs
    assert writer.values == {("throughput", 4): 3.0, ("throughput/tokens per second per GPU", 4): 512.0,
                             ("throughput/MFU", 4): 0.25}
    assert "| throughput per GPU (TFLOP/s/GPU): 3.0 | tokens per second per GPU: 512.0 |" in line
    writer = _Scalars()
    TrainingLogger(writer, log_throughput=True, print_fn=lambda *a, **k: None).training(**common)  # a CPU: no peak
    assert set(writer.values) == {("throughput", 4), ("throughput/tokens per second per GPU", 4)}
    writer = _Scalars()
    line = TrainingLogger(writer, print_fn=lambda *a, **k: None).training(**common, mfu=0.25)
    assert writer.values == {} and "throughput per GPU" not in line  # only with --log-throughput
