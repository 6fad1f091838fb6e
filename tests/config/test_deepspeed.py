"""The DeepSpeed config built from the flags, merged with a user JSON: derived keys, kept keys, conflicts."""

import subprocess
import sys

import pytest

from megatron.config import BatchConfig, PrecisionConfig
from megatron.config.deepspeed import STEPS_PER_PRINT, build_deepspeed_config
from tests.helpers.config import run_config


def test_bf16_gives_the_bf16_optimizer_path_and_no_optimizer_section():
    ds = build_deepspeed_config(run_config())
    assert ds == {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                  "gradient_clipping": 1.0, "bf16": {"enabled": True}, "fp16": {"enabled": False},
                  "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"},
                  "steps_per_print": STEPS_PER_PRINT, "wall_clock_breakdown": False}


def test_bf16_zero_stage_0_builds_stage_1_and_accepts_bloom_json_saying_0():
    bloom = run_config("bf16", PrecisionConfig(zero_stage=0))
    user = {"zero_optimization": {"stage": 0, "reduce_bucket_size": 5e8}, "bf16": {"enabled": True}}
    for ds in (build_deepspeed_config(bloom), build_deepspeed_config(bloom, user)):
        assert ds["zero_optimization"]["stage"] == 1 and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert build_deepspeed_config(bloom, user)["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 5e8}
    assert user["zero_optimization"]["stage"] == 0  # the caller's dict is untouched
    with pytest.raises(ValueError, match="zero_optimization.stage = 1 .* contradicts --zero-stage 0"):
        build_deepspeed_config(bloom, {"zero_optimization": {"stage": 1}})  # the JSON must say what the flag says


def test_fp32_has_neither_mixed_precision_nor_fp32_accumulation_override():
    ds = build_deepspeed_config(run_config("fp32", PrecisionConfig(zero_stage=0)))
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    assert "data_types" not in ds and ds["zero_optimization"] == {"stage": 0}


def test_fp16_dynamic_loss_scaling_defaults_and_flags():
    ds = build_deepspeed_config(run_config("fp16", PrecisionConfig(zero_stage=0)))
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "min_loss_scale": 1,
                          "loss_scale_window": 1000, "hysteresis": 2}
    scaled = PrecisionConfig(initial_loss_scale=4096, loss_scale=0, hysteresis=4, zero_stage=0)
    ds = build_deepspeed_config(run_config("fp16", scaled))
    assert (ds["fp16"]["initial_scale_power"], ds["fp16"]["loss_scale"], ds["fp16"]["hysteresis"]) == (12, 0, 4)
    static = build_deepspeed_config(run_config("fp16", PrecisionConfig(loss_scale=128.0, zero_stage=0)))
    assert static["fp16"]["loss_scale"] == 128.0


def test_user_values_for_keys_no_flag_covers_are_kept():
    user = {"steps_per_print": 2000, "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8},
            "fp16": {"enabled": False, "loss_scale_window": 500}, "train_batch_size": 16,
            "comms_logger": {"enabled": True}}
    ds = build_deepspeed_config(run_config(), user)
    assert ds["steps_per_print"] == 2000 and ds["comms_logger"] == {"enabled": True}
    assert ds["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 5e8}
    assert ds["fp16"] == {"enabled": False, "loss_scale_window": 500}
    assert user["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 5e8}  # the caller's dict is untouched


def test_fp16_json_scaling_kept_when_the_flag_is_not_given():
    fp16 = run_config("fp16", PrecisionConfig(zero_stage=0))
    ds = build_deepspeed_config(fp16, {"fp16": {"enabled": True, "initial_scale_power": 12}})
    assert ds["fp16"]["initial_scale_power"] == 12
    given = run_config("fp16", PrecisionConfig(initial_loss_scale=2.0 ** 16, zero_stage=0))
    with pytest.raises(ValueError, match=r"fp16.initial_scale_power = 12 .* contradicts --initial-loss-scale 65536"):
        build_deepspeed_config(given, {"fp16": {"initial_scale_power": 12}})


@pytest.mark.parametrize("user,words", [
    ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu = 4 (from the user config) "
                                            "contradicts --micro-batch-size 2, which gives 2"),
    ({"train_batch_size": 32}, "contradicts --global-batch-size 16"),
    ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps = 8"),
    ({"gradient_clipping": 0.5}, "gradient_clipping = 0.5 (from the user config) contradicts --clip-grad 1.0"),
    ({"bf16": {"enabled": False}}, "bf16.enabled = False"),
    ({"bfloat16": {"enabled": False}}, "bf16.enabled = False"),
    ({"fp16": {"enabled": True}}, "fp16.enabled = True (from the user config) contradicts the absence of --fp16"),
    ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage = 0 (from the user config) contradicts "
                                          "--zero-stage 1"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype = 'bf16'"),
    ({"optimizer": {"type": "AdamW"}}, "'optimizer' section; remove it"),
    ({"scheduler": {"type": "WarmupLR"}}, "'scheduler' section; remove it"),
])
def test_contradictions_name_the_key_the_json_value_and_the_flag(user, words):
    with pytest.raises(ValueError) as info:
        build_deepspeed_config(run_config(), user)
    assert words in str(info.value)


def test_activation_checkpointing_section():
    ds = build_deepspeed_config(run_config(activation_checkpointing=True),
                                {"activation_checkpointing": {"cpu_checkpointing": True}})
    assert ds["activation_checkpointing"]["number_checkpoints"] == 2
    assert ds["activation_checkpointing"]["cpu_checkpointing"] is True
    assert "activation_checkpointing" not in build_deepspeed_config(run_config())


def test_gradient_accumulation_follows_the_final_global_batch_during_rampup():
    batch = BatchConfig(micro_batch_size=2, global_batch_size=2048, rampup_batch_size=(192, 16, 9_765_625))
    ds = build_deepspeed_config(run_config(batch=batch, dp=8))
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (2048, 128)


def test_module_does_not_import_deepspeed():
    code = "import sys, megatron.config.deepspeed; assert 'deepspeed' not in sys.modules, 'deepspeed imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dtype,precision", [
    ("bf16", PrecisionConfig(zero_stage=1)), ("bf16", PrecisionConfig(zero_stage=0)),
    ("fp16", PrecisionConfig(initial_loss_scale=4096, zero_stage=0)),
    ("fp32", PrecisionConfig(zero_stage=0)), ("fp32", PrecisionConfig(zero_stage=1))],
    ids=["bf16-z1", "bf16-z0", "fp16", "fp32", "fp32-z1"])
def test_deepspeed_accepts_the_config(dtype, precision):
    """DeepSpeed's own config parser reads what we build (one process: data-parallel size 1)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    rc = run_config(dtype, precision, dp=1, activation_checkpointing=True)
    ds = build_deepspeed_config(rc)
    parsed = DeepSpeedConfig(ds)
    assert (parsed.train_batch_size, parsed.gradient_accumulation_steps) == (16, 8)
    assert (parsed.bfloat16_config.enabled, parsed.float16_config.enabled) == (rc.bf16, rc.fp16)
    assert parsed.zero_optimization_stage == rc.deepspeed_zero_stage == (1 if rc.bf16 else precision.zero_stage)
    assert parsed.optimizer_name is None and parsed.scheduler_name is None
    if rc.bf16:
        assert str(parsed.grad_accum_dtype) in ("fp32", "torch.float32")
    if rc.fp16:
        assert parsed.float16_config.initial_scale_power == 12


def test_zero2_and_zero3_sections():
    zero2 = build_deepspeed_config(run_config("bf16", PrecisionConfig(zero_stage=2)))
    # no fp32 accumulation override: that is what selects BF16_Optimizer, a stage-1 optimizer
    assert zero2["zero_optimization"] == {"stage": 2} and "data_types" not in zero2
    from megatron.config import ParallelConfig

    zero3 = build_deepspeed_config(run_config("fp32", PrecisionConfig(zero_stage=3), dp=4,
                                              parallel=ParallelConfig(data_parallel_size=4, zero_hpz_partition_size=2)))
    assert zero3["zero_optimization"] == {"stage": 3, "memory_efficient_linear": False, "zero_hpz_partition_size": 2}
    with pytest.raises(ValueError, match="zero_hpz_partition_size = 4 .* contradicts --zero-hpz-partition-size 2"):
        build_deepspeed_config(run_config("fp32", PrecisionConfig(zero_stage=3), dp=4,
                                          parallel=ParallelConfig(data_parallel_size=4, zero_hpz_partition_size=2)),
                               {"zero_optimization": {"zero_hpz_partition_size": 4}})
