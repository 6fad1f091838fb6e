"""RunConfig.validate and the rules of its parts (parallel layout, optimizer, schedule, batch,
precision, loop, logging, checkpoints, exits), on runs built straight from the dataclasses."""

import dataclasses

import pytest

from megatron.config import (
    BatchConfig,
    CheckpointConfig,
    ExitConfig,
    LoggingConfig,
    LRScheduleConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainingConfig,
    check_rampup_batch_size,
)
from tests.helpers.config import run_config, tiny_model

NO_VALIDATION = dataclasses.replace(run_config().data, split="100,0,0")


def test_the_tiny_run_is_valid_and_reads_its_dtype_from_the_model():
    rc = run_config().validate()  # bf16, ZeRO-1, DP 2, 10 iterations of 16 samples
    assert rc.bf16 and not rc.fp16 and rc.model.params_dtype == "bf16"
    assert (rc.world_size, rc.batch.num_micro_batches(rc.parallel.data_parallel_size)) == (2, 4)
    assert rc.lr_schedule_in_samples() == (0, 160)
    fp16 = run_config("fp16", PrecisionConfig(zero_stage=0)).validate()
    assert (fp16.bf16, fp16.fp16) == (False, True)
    fp32 = run_config("fp32", PrecisionConfig(zero_stage=0)).validate()
    assert (fp32.bf16, fp32.fp16) == (False, False)


def test_bf16_with_zero_stage_0_runs_as_stage_1_and_keeps_what_was_asked():
    bloom = run_config("bf16", PrecisionConfig(zero_stage=0)).validate()  # BLOOM-176B's --bf16 --zero-stage 0
    assert (bloom.precision.zero_stage, bloom.deepspeed_zero_stage) == (0, 1)
    assert run_config("bf16", PrecisionConfig(zero_stage=1)).deepspeed_zero_stage == 1
    for dtype in ("fp32", "fp16"):  # their stage 0 is DeepSpeed's own (an unpartitioned optimizer)
        for stage in (0, 1):
            assert run_config(dtype, PrecisionConfig(zero_stage=stage)).validate().deepspeed_zero_stage == stage


def test_with_vocab_size_fills_the_model_and_revalidates():
    rc = run_config(model=tiny_model(padded_vocab_size=None, params_dtype="bf16")).validate()
    padded = rc.with_vocab_size(400, 512)
    assert (padded.model.original_vocab_size, padded.model.padded_vocab_size) == (400, 512)
    with pytest.raises(ValueError, match="original vocabulary size 600 is larger than the padded size 512"):
        rc.with_vocab_size(600, 512)


@pytest.mark.parametrize("parts,words", [
    (dict(parallel=ParallelConfig(pipeline_model_parallel_size=4, data_parallel_size=1),
          batch=BatchConfig(micro_batch_size=2, global_batch_size=2)),
     "--num-layers 2 gives 2 layers to partition with --pp-partition-method type:transformer, fewer than "
     "--pipeline-model-parallel-size 4"),
    (dict(batch=BatchConfig(micro_batch_size=2, global_batch_size=6)),
     "--global-batch-size 6 is not a multiple of --micro-batch-size 2 x data-parallel size 2 = 4; use a multiple of 4"),
    (dict(training=TrainingConfig(train_iters=10, train_samples=100)),
     "exactly one of --train-iters and --train-samples"),
    (dict(training=TrainingConfig()), "exactly one of --train-iters and --train-samples"),
    (dict(lr_schedule=LRScheduleConfig(lr_warmup_iters=6, lr_decay_iters=5)),
     "warmup (96 samples) is not shorter than the decay (80 samples"),
    (dict(optimizer=OptimizerConfig(lr=1e-3, min_lr=0.1)), "--min-lr 0.1 must be between 0 and --lr 0.001"),
    (dict(parallel=ParallelConfig(data_parallel_size=2, pp_partition_method="balanced")),
     "--pp-partition-method 'balanced' is not one of type:transformer, type:transformer|embedding"),
    (dict(batch=BatchConfig(micro_batch_size=2, global_batch_size=16, rampup_batch_size=(4, 4, 100))),
     "--rampup-batch-size (4, 4, 100) does not fit iteration-based (--train-iters) training"),
    (dict(lr_schedule=LRScheduleConfig(lr_decay_samples=50)), "--lr-decay-samples 50 does not fit iteration-based"),
    (dict(training=TrainingConfig(train_samples=160), lr_schedule=LRScheduleConfig(lr_decay_iters=5)),
     "--lr-decay-iters 5 does not fit sample-based (--train-samples) training"),
    (dict(data=NO_VALIDATION), "--eval-iters 100 asks for evaluation every 1000 iterations, but there is no "
                               "validation data"),
    (dict(precision=PrecisionConfig(zero_stage=4)), "--zero-stage 4 is not a ZeRO stage; use 0, 1, 2 or 3"),
    (dict(precision=PrecisionConfig(zero_stage=3),
          parallel=ParallelConfig(pipeline_model_parallel_size=2, data_parallel_size=1),
          batch=BatchConfig(micro_batch_size=2, global_batch_size=8)),
     "--zero-stage 3 does not combine with --pipeline-model-parallel-size 2: DeepSpeed's pipeline engine shards the "
     "optimizer state only (ZeRO-1). Either keep the pipeline with --zero-stage 1"),
    (dict(parallel=ParallelConfig(data_parallel_size=2, zero_hpz_partition_size=2)),
     "--zero-hpz-partition-size 2 shards a secondary copy of the parameters, which only ZeRO-3 has"),
    (dict(precision=PrecisionConfig(zero_stage=3), parallel=ParallelConfig(data_parallel_size=2,
                                                                          zero_hpz_partition_size=4)),
     "--zero-hpz-partition-size 4 does not divide the data-parallel size 2"),
    (dict(precision=PrecisionConfig(zero_stage=3), parallel=ParallelConfig(
        data_parallel_size=1, ds_sequence_parallel_size=2, zero_hpz_partition_size=4)),
     "--zero-hpz-partition-size 4 does not divide the data-parallel x sequence-parallel size 1 x 2 = 2"),
    (dict(precision=PrecisionConfig(zero_stage=2), activation_checkpointing=True),
     "--deepspeed-activation-checkpointing is for the pipeline engine; with --zero-stage 2, --checkpoint-activations "
     "alone recomputes the layers"),
    (dict(checkpoint=CheckpointConfig(save="/tmp/x")), "--save '/tmp/x' needs --save-interval"),
    (dict(precision=PrecisionConfig(initial_loss_scale=1000.0)),
     "--initial-loss-scale 1000.0 must be a power of 2 (DeepSpeed takes its exponent); e.g. 1024"),
    (dict(lr_schedule=LRScheduleConfig(lr_warmup_fraction=0.1, lr_warmup_iters=2)),
     "give one of --lr-warmup-fraction, --lr-warmup-iters, --lr-warmup-samples"),
    (dict(lr_schedule=LRScheduleConfig(override_lr_scheduler=True, use_checkpoint_lr_scheduler=True)),
     "--override-lr-scheduler and --use-checkpoint-lr-scheduler contradict each other"),
    (dict(checkpoint=CheckpointConfig(universal_checkpoint=True)),
     "--universal-checkpoint loads a checkpoint: pass --load"),
    (dict(checkpoint=CheckpointConfig(finetune=True)), "--finetune loads a checkpoint: pass --load"),
    (dict(training=TrainingConfig(train_iters=10, skip_train_iteration_range=((0, 3),))),
     "--skip-train-iteration-range 0-3: need 1 <= START <= END"),
    (dict(logging=LoggingConfig(peak_tflops=0.0)), "--peak-tflops must be positive"),
    (dict(exit=ExitConfig(exit_duration_in_mins=0)), "--exit-duration-in-mins must be positive"),
    (dict(optimizer=OptimizerConfig(adam_beta2=1.0)), "--adam-beta2 must be in [0, 1), got 1.0"),
])
def test_impossible_runs_are_rejected(parts, words):
    with pytest.raises(ValueError) as info:
        run_config(**parts).validate()
    assert words in str(info.value)


def test_no_validation_data_is_fine_when_evaluation_is_off():
    assert run_config().data.has_validation_data  # --data-path without --split: Megatron's 969, 30, 1
    rc = run_config(data=NO_VALIDATION, training=TrainingConfig(train_iters=10, eval_iters=0)).validate()
    assert rc.training.eval_iters == 0 and not rc.data.has_validation_data


def test_the_embedding_counts_as_a_stage_layer_with_type_transformer_embedding():
    parallel = ParallelConfig(pipeline_model_parallel_size=4, data_parallel_size=1,
                              pp_partition_method="type:transformer|embedding")
    rc = run_config(parallel=parallel, batch=BatchConfig(micro_batch_size=2, global_batch_size=2)).validate()
    assert rc.world_size == 4  # 2 layers + the tied embedding on the first and last stage: 4 items
    with pytest.raises(ValueError, match="gives 2 layers to partition"):
        run_config(parallel=dataclasses.replace(parallel, pp_partition_method="type:transformer"),
                   batch=BatchConfig(micro_batch_size=2, global_batch_size=2)).validate()


def test_schedule_lengths_in_samples_follow_megatron():
    iters = run_config(lr_schedule=LRScheduleConfig(lr_warmup_iters=2, lr_decay_iters=8))
    assert iters.lr_schedule_in_samples() == (32, 128)  # iterations x global batch 16
    samples = run_config(lr_schedule=LRScheduleConfig(lr_warmup_samples=10),
                         training=TrainingConfig(train_samples=200))
    assert samples.lr_schedule_in_samples() == (10, 200)
    fraction = run_config(lr_schedule=LRScheduleConfig(lr_warmup_fraction=0.25))
    assert fraction.lr_schedule_in_samples() == (40.0, 160)


@pytest.mark.parametrize("rampup,words", [
    ((4, 2, 100), "increment 2 is not a multiple of --micro-batch-size 2 x data-parallel size 2 = 4"),
    ((2, 4, 100), "start 2 is not a multiple of --micro-batch-size 2 x data-parallel size 2 = 4"),
    ((16, 4, 100), "start 16 must be smaller than --global-batch-size 16"),
    ((4, 8, 100), "--global-batch-size 16 minus the rampup start 4 = 12 is not a multiple of the increment 8"),
    ((4, 4), "takes 3 values"),
])
def test_rampup_batch_sizes_must_split_into_micro_batches(rampup, words):
    with pytest.raises(ValueError) as info:
        check_rampup_batch_size(rampup, global_batch_size=16, micro_batch_size=2, data_parallel_size=2)
    assert words in str(info.value)
    check_rampup_batch_size((4, 4, 100), global_batch_size=16, micro_batch_size=2, data_parallel_size=2)
