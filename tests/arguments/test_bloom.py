"""BLOOM-176B's Megatron-DeepSpeed flags (bigscience/train/tr11-176B-ml/tr11-176B-ml.slurm), verbatim,
on 48 nodes x 8 GPUs: the RunConfig, the DeepSpeed config, the batch rampup and the schedule they give,
its ZeRO stage 0 running as DeepSpeed 0.19's stage 1, and the errors for its known pitfalls (a JSON
contradicting the flags, a wrong world)."""

import json
from types import SimpleNamespace

import pytest

from megatron.arguments import run_config_from_argv
from megatron.config import DatasetGroup, DatasetSplit
from megatron.config.deepspeed import build_deepspeed_config
from megatron.config.launch import detect_launch
from megatron.training.lr_schedule import LRScheduler
from megatron.training.microbatches import build_num_microbatches_calculator
from tests.helpers.arguments import bloom_setup, parse_bloom


def test_bloom_176b_flags_parse_into_the_expected_run_config(tmp_path, monkeypatch):
    # srun ... torchrun, as BLOOM was launched: torchrun's variables name the world and this process
    monkeypatch.setenv("WORLD_SIZE", "384")
    monkeypatch.setenv("RANK", "13")
    monkeypatch.setenv("LOCAL_RANK", "5")
    argv, ds_config = bloom_setup(tmp_path)
    rc = run_config_from_argv(argv, with_vocab=False)
    m, p, b = rc.model, rc.parallel, rc.batch
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (70, 14336, 112, 2048)
    assert m.position_embedding_type == "alibi" and m.embed_layernorm and m.init_method_std == 0.0048
    assert m.params_dtype == "bf16" and m.seed == 42 and m.padded_vocab_size is None
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size) == (4, 12, 8)
    assert p.pp_partition_method == "type:transformer|embedding" and p.distributed_backend == "nccl"
    assert (rc.world_size, detect_launch().local_rank, detect_launch().rank) == (384, 5, 13)
    assert (b.micro_batch_size, b.global_batch_size, b.rampup_batch_size) == (2, 2048, (192, 16, 9_765_625))
    o = rc.optimizer
    assert (o.optimizer, o.betas, o.adam_eps, o.lr, o.min_lr, o.clip_grad, o.weight_decay) == \
        ("adam", (0.9, 0.95), 1e-8, 6e-5, 6e-6, 1.0, 0.1)
    assert rc.lr_schedule.lr_decay_style == "cosine" and rc.lr_schedule_in_samples() == (183_105, 200_000_000)
    t = rc.training
    assert t.train_samples == 220_000_000 and t.train_iters is None
    assert (t.eval_interval, t.eval_iters, t.checkpoint_activations, t.deepspeed_activation_checkpointing,
            t.sync_tp_duplicated_parameters) == (1000, 1, True, True, True)
    assert rc.bf16 and not rc.fp16 and (rc.precision.zero_stage, rc.deepspeed_zero_stage) == (0, 1)
    d = rc.data
    assert d.tokenizer.tokenizer_type == "PretrainedFromHF" and d.pad_vocab_size_to == 250880 and d.data_impl == "mmap"
    assert (d.num_workers, d.valid_num_workers, d.split, d.data_path) == (2, 0, None, ())
    (train,) = d.train_weighted_split_groups
    assert train.name == "train" and [s.weight for s in train.datasets] == [0.5, 0.3, 0.2]
    assert train.datasets[0] == DatasetSplit(0.5, 0.0, 0.95, str(tmp_path / "data/roots_en_text_document"))
    assert [g.name for g in d.valid_weighted_split_groups] == ["valid_en", "valid_fr"]
    assert isinstance(d.valid_weighted_split_groups[1], DatasetGroup)
    lg, ck, ex = rc.logging, rc.checkpoint, rc.exit
    assert (lg.log_interval, lg.tensorboard_queue_size, lg.log_timers_to_tensorboard,
            lg.log_batch_size_to_tensorboard, lg.log_validation_ppl_to_tensorboard) == (1, 5, True, True, True)
    assert ck.save == ck.load == str(tmp_path / "checkpoints") and ck.save_interval == 100
    assert ex.exit_duration_in_mins == 5990 and ex.kill_switch_path.endswith("kill-switch-tr11-176B-exp1")
    assert any("abort-on-unmet-fused-kernel-constraints" in w for w in rc.startup_warnings)
    assert rc.deepspeed_config == str(ds_config) and rc.deepspeed_user_config["steps_per_print"] == 2000

    ds = build_deepspeed_config(rc, rc.deepspeed_user_config)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == \
        (2048, 2, 128)
    assert ds["bf16"] == {"enabled": True} and ds["zero_optimization"] == {"stage": 1}
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["steps_per_print"] == 2000
    assert ds["activation_checkpointing"]["number_checkpoints"] == 70
    assert "optimizer" not in ds and "scheduler" not in ds

    calculator = build_num_microbatches_calculator(b, p.data_parallel_size)
    assert (calculator.get(), calculator.get_current_global_batch_size()) == (12, 192)
    scheduler = LRScheduler.from_run_config(None, rc)
    assert scheduler.step(183_105) == 6e-5  # exact: the end of the warmup, max_lr * 183105 / 183105 = max_lr * 1.0


def test_bloom_176b_vocabulary_is_padded_to_250880(tmp_path):
    pytest.importorskip("megatron.data.tokenizers")
    argv, _ = bloom_setup(tmp_path)
    rc = run_config_from_argv(argv, world_size=384, tokenizer=SimpleNamespace(vocab_size=250680))
    assert (rc.model.original_vocab_size, rc.model.padded_vocab_size) == (250680, 250880)  # 4 x 62720 rows


def test_bloom_176b_resumed_from_a_universal_checkpoint_with_zero_1(tmp_path):
    argv, ds_config = bloom_setup(tmp_path, zero_stage=1)
    rc = parse_bloom(argv + ["--universal-checkpoint"])
    assert rc.checkpoint.universal_checkpoint and rc.precision.zero_stage == 1
    config = json.loads(ds_config.read_text())
    config["zero_optimization"]["stage"] = 0
    ds_config.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="zero_optimization.stage = 0 .* contradicts --zero-stage 1"):
        parse_bloom(argv)


def test_bloom_176b_zero_stage_0_runs_bf16_optimizer_as_stage_1_with_one_warning(tmp_path):
    for name in ("z0", "z1"):
        (tmp_path / name).mkdir()
    original, _ = bloom_setup(tmp_path / "z0")  # --zero-stage 0 and the JSON's zero_optimization.stage 0
    stage_1, _ = bloom_setup(tmp_path / "z1", zero_stage=1)
    rc, rc1 = parse_bloom(original), parse_bloom(stage_1)
    assert (rc.precision.zero_stage, rc.deepspeed_zero_stage, rc1.deepspeed_zero_stage) == (0, 1, 1)
    ds, ds1 = build_deepspeed_config(rc, rc.deepspeed_user_config), build_deepspeed_config(rc1, rc1.deepspeed_user_config)
    assert ds == ds1 and ds["zero_optimization"] == {"stage": 1} and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    notes = [w for w in rc.startup_warnings if "--zero-stage" in w]
    assert notes == ["--zero-stage 0 with --bf16 runs DeepSpeed's BF16_Optimizer (ZeRO stage 1), BLOOM's optimizer: "
                     "fp32 master weights and Adam states sharded over the data-parallel ranks, what bigscience's "
                     "DeepSpeed ran under stage 0 (DeepSpeed selects it by stage 1)"]
    assert not [w for w in rc1.startup_warnings if "--zero-stage" in w]


def test_bloom_176b_on_the_wrong_world_size_names_the_sizes(tmp_path):
    argv, _ = bloom_setup(tmp_path)
    with pytest.raises(ValueError, match="world size 380 is not a multiple of --tensor-model-parallel-size 4 x "
                                         "--pipeline-model-parallel-size 12 = 48"):
        parse_bloom(argv, world_size=380)
