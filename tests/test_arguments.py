"""The command line: every impossible configuration is refused by parse_args, BLOOM-176B's flags parse,
--help documents every flag, and docs/flags.md matches the parser."""

import json
import pathlib
import subprocess
import sys

import pytest

from megatron.arguments import build_parser, build_run_config, merge_skip_ranges, parse_args, world_size_from_env
from megatron.config import DatasetGroup, DatasetSplit
from megatron.engine.ds_config import build_deepspeed_config
from megatron.training.lr_schedule import LRScheduler
from megatron.training.microbatches import build_num_microbatches_calculator

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def files(tmp_path):
    """A data prefix and GPT-2 tokenizer files that exist (empty: only their existence is checked)."""
    for name in ("a.bin", "a.idx", "b.bin", "b.idx", "vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    return tmp_path


def tiny_flags(d) -> dict:
    return {"--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 32,
            "--micro-batch-size": 2, "--global-batch-size": 8, "--train-iters": 10, "--lr": 1e-3,
            "--tokenizer-type": "GPT2BPETokenizer", "--vocab-file": d / "vocab.json",
            "--merge-file": d / "merges.txt", "--data-path": d / "a", "--distributed-backend": "gloo"}


def argv_of(flags: dict) -> list[str]:
    out = []
    for flag, value in flags.items():
        if value is None:
            continue
        out.append(flag)
        if value is not True:
            out += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return out


def parse(d, world_size=2, drop=(), **overrides):
    """parse_args on the tiny config; overrides use python names: lr_warmup_iters=3 -> --lr-warmup-iters 3."""
    flags = tiny_flags(d)
    for name in drop:
        flags.pop(name)
    for name, value in overrides.items():
        flags["--" + name.replace("_", "-")] = value
    return parse_args(argv_of(flags), world_size=world_size)


def test_tiny_config_parses_with_megatron_derived_values(files):
    args = parse(files, world_size=4, pipeline_model_parallel_size=2)
    rc = build_run_config(args)
    assert (rc.parallel.tensor_model_parallel_size, rc.parallel.pipeline_model_parallel_size,
            rc.parallel.data_parallel_size, rc.world_size) == (1, 2, 2, 4)
    assert rc.model.padded_vocab_size is None  # needs the tokenizer: resolve_vocab_size
    assert rc.data.data_path == ((1.0, str(files / "a")),) and rc.data.split == "969, 30, 1"
    assert rc.precision.zero_stage == 0 and rc.precision.params_dtype == "fp32"
    assert rc.training.train_iters == 10 and not rc.training.sample_based
    assert rc.lr_schedule_in_samples() == (0, 80)  # Megatron: iterations x global batch size


def test_global_batch_defaults_to_one_micro_batch_per_dp_rank(files):
    assert parse(files, world_size=4, drop=["--global-batch-size"]).global_batch_size == 8


def test_world_size_from_env_prefers_world_size_then_slurm():
    assert world_size_from_env({"WORLD_SIZE": "16", "SLURM_NTASKS": "2"}) == 16
    assert world_size_from_env({"SLURM_NTASKS": "8"}) == 8
    assert world_size_from_env({}) == 1


def test_parse_args_reads_world_size_from_the_environment(files, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert parse_args(argv_of(tiny_flags(files))).data_parallel_size == 4


def test_data_path_blend_and_skip_ranges(files):
    args = parse(files, data_path=["0.3", files / "a", "0.7", files / "b"],
                 skip_train_iteration_range=["101-200", "5-6", "150-300"])
    rc = build_run_config(args)
    assert rc.data.data_path == ((0.3, str(files / "a")), (0.7, str(files / "b")))
    assert rc.training.skip_train_iteration_range == ((5, 6), (101, 300))
    assert merge_skip_ranges(["1-5", "2-6", "8-8"]) == ((1, 6), (8, 8))


def test_local_rank_accepts_both_spellings(files, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert parse(files, local_rank=3).local_rank == 3
    assert parse_args(argv_of(tiny_flags(files)) + ["--local-rank=1"], world_size=2).local_rank == 1


def test_settings_without_effect_are_kept_and_reported(files):
    args = parse(files, bf16=True, loss_scale=12, abort_on_unmet_fused_kernel_constraints=True,
                 position_embedding_type="alibi", max_position_embeddings=32)
    warnings = " | ".join(args.startup_warnings)
    assert "--abort-on-unmet-fused-kernel-constraints" in warnings
    assert "--loss-scale 12.0 ignored" in warnings
    assert "--max-position-embeddings 32 has no effect" in warnings
    rc = build_run_config(args)
    assert rc.precision.loss_scale == 12 and rc.startup_warnings == args.startup_warnings


def _ds_json(d, **entries):
    path = d / "ds.json"
    path.write_text(json.dumps(entries))
    return path


REJECTED = [
    # (overrides, world size, words the message must contain)
    (dict(num_attention_heads=4, tensor_model_parallel_size=8, global_batch_size=2), 8,
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"),
    (dict(hidden_size=66), 2, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
    (dict(pipeline_model_parallel_size=4, global_batch_size=2), 4,
     "fewer than --pipeline-model-parallel-size 4"),
    (dict(global_batch_size=6), 2, "--global-batch-size 6 is not a multiple of --micro-batch-size 2 x "
                                   "data-parallel size 2 = 4"),
    (dict(train_iters=None, train_samples=1000, rampup_batch_size=[4, 2, 100]), 2,
     "increment 2 is not a multiple of --micro-batch-size 2 x data-parallel size 2 = 4"),
    (dict(max_position_embeddings=16), 2, "--seq-length 32 is longer than --max-position-embeddings 16"),
    (dict(tensor_model_parallel_size=2), 3, "world size 3 is not a multiple of --tensor-model-parallel-size 2 x "
                                            "--pipeline-model-parallel-size 1"),
    (dict(train_samples=100), 2, "exactly one of --train-iters and --train-samples"),
    (dict(train_iters=None), 2, "exactly one of --train-iters and --train-samples"),
    (dict(bf16=True, fp16=True), 2, "--bf16 and --fp16 are both set"),
    (dict(lr_warmup_iters=6, lr_decay_iters=5), 2, "warmup (48 samples) is not shorter than the decay (40"),
    (dict(min_lr=0.1), 2, "--min-lr 0.1 must be between 0 and --lr 0.001"),
    (dict(pp_partition_method="balanced"), 2, "--pp-partition-method 'balanced' is not one of"),
    (dict(rampup_batch_size=[4, 4, 100]), 2, "--rampup-batch-size (4, 4, 100) does not fit iteration-based"),
    (dict(lr_decay_samples=50), 2, "--lr-decay-samples 50 does not fit iteration-based"),
    (dict(split="100,0,0"), 2, "there is no validation data"),
    (dict(zero_stage=2), 2, "--zero-stage 2 is not supported"),
    (dict(save="/tmp/x"), 2, "needs --save-interval"),
    (dict(data_impl="lazy"), 2, "--data-impl 'lazy' is not supported"),
    (dict(fp16=True, initial_loss_scale=1000), 2, "--initial-loss-scale 1000.0 must be a power of 2"),
    (dict(lr_warmup_fraction=0.1, lr_warmup_iters=2), 2, "give one of --lr-warmup-fraction"),
    (dict(universal_checkpoint=True), 2, "--universal-checkpoint loads a checkpoint: pass --load"),
]


@pytest.mark.parametrize("overrides,world_size,words", REJECTED, ids=[r[2][:40] for r in REJECTED])
def test_impossible_configurations_are_rejected(files, overrides, world_size, words):
    with pytest.raises(ValueError) as info:
        parse(files, world_size=world_size, **overrides)
    assert words in str(info.value)


def test_embedding_counts_as_a_stage_layer_with_type_transformer_embedding(files):
    args = parse(files, world_size=4, pipeline_model_parallel_size=4, global_batch_size=2,
                 pp_partition_method="type:transformer|embedding")
    assert build_run_config(args).parallel.pp_partition_method == "type:transformer|embedding"


def test_eval_can_be_disabled_without_validation_data(files):
    assert build_run_config(parse(files, split="100,0,0", eval_iters=0)).training.eval_iters == 0


def test_missing_files_are_named(files):
    with pytest.raises(ValueError, match=r"data files not found: .*nope\.bin"):
        parse(files, data_path=files / "nope")
    with pytest.raises(ValueError, match=r"--vocab-file .*missing\.json.*no such file"):
        parse(files, vocab_file=files / "missing.json")
    with pytest.raises(ValueError, match="--tokenizer-model .*no such file"):
        parse(files, tokenizer_type="SentencePieceTokenizer", tokenizer_model=files / "sp.model")
    with pytest.raises(ValueError, match="hub name is not downloaded"):
        parse(files, tokenizer_type="PretrainedFromHF", tokenizer_name_or_path="bigscience/bloom")
    with pytest.raises(ValueError, match="--deepspeed_config .*no such file"):
        parse(files, deepspeed_config=files / "none.json")


@pytest.mark.parametrize("entries,words", [
    ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu = 4 (from"),
    ({"bf16": {"enabled": True}}, "bf16.enabled = True"),
    ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage = 0"),
    ({"gradient_clipping": 0.5}, "gradient_clipping = 0.5"),
    ({"train_batch_size": 16}, "contradicts --global-batch-size 8, which gives 8"),
    ({"optimizer": {"type": "Adam"}}, "has a 'optimizer' section; remove it"),
])
def test_deepspeed_json_contradicting_the_flags_is_rejected(files, entries, words):
    kwargs = {"zero_stage": 1} if "zero_optimization" in entries else {}
    with pytest.raises(ValueError) as info:
        parse(files, deepspeed_config=_ds_json(files, **entries), **kwargs)
    assert words in str(info.value)


def test_zero_stage_defaults_to_the_json_value(files):
    args = parse(files, deepspeed_config=_ds_json(files, zero_optimization={"stage": 1}))
    assert build_run_config(args).precision.zero_stage == 1
    assert build_run_config(parse(files)).precision.zero_stage == 0
    assert build_run_config(parse(files, bf16=True)).precision.zero_stage == 1


def test_every_flag_has_help_and_appears_in_help_output():
    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and action.help.strip(), action.option_strings
        for option in action.option_strings:
            assert option in text, option


def test_docs_flags_md_matches_the_parser():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gen_flags_doc
    finally:
        sys.path.pop(0)
    assert (REPO / "docs" / "flags.md").read_text() == gen_flags_doc.render(build_parser()), \
        "docs/flags.md is stale: run python tools/gen_flags_doc.py"


def test_gen_flags_doc_check_mode_exits_zero():
    result = subprocess.run([sys.executable, str(REPO / "tools" / "gen_flags_doc.py"), "--check"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------------------------
# BLOOM-176B (bigscience/train/tr11-176B-ml/tr11-176B-ml.slurm), its flags verbatim, on 48 nodes x 8
# ------------------------------------------------------------------------------------------------

def bloom_setup(d: pathlib.Path, zero_stage: int = 1) -> tuple[list[str], pathlib.Path]:
    """BLOOM-176B's flags. Its script said ZeRO stage 0 for bigscience's DeepSpeed fork; the same
    optimizer (BF16_Optimizer) is stage 1 in DeepSpeed 0.19, hence the default here."""
    prefixes = [d / f"data/{name}_text_document" for name in ("roots_en", "roots_fr", "roots_code")]
    for prefix in prefixes:
        prefix.parent.mkdir(exist_ok=True)
        for ext in (".bin", ".idx"):
            pathlib.Path(str(prefix) + ext).write_text("")
    (d / "train-splits.txt").write_text(
        f'"train: 0.5 0:0.95 {prefixes[0]}, 0.3 0:0.95 {prefixes[1]}, 0.2 0:0.95 {prefixes[2]}"\n')
    (d / "valid-splits.txt").write_text(
        f'"valid_en: 1 0.95:1.0 {prefixes[0]}" "valid_fr: 1 0.95:1.0 {prefixes[1]}"\n')
    (d / "tokenizer").mkdir()
    ds_config = d / "ds_config.json"
    ds_config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2048, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zero_stage}, "bf16": {"enabled": True}, "steps_per_print": 2000,
        "wall_clock_breakdown": False}))
    argv = f"""
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 12
    --pp-partition-method type:transformer|embedding
    --num-layers 70 --hidden-size 14336 --num-attention-heads 112 --seq-length 2048 --max-position-embeddings 2048
    --micro-batch-size 2 --rampup-batch-size 192 16 9_765_625 --global-batch-size 2048 --train-samples 220_000_000
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path {d}/tokenizer
    --init-method-std 0.0048 --embed-layernorm --sync-tp-duplicated-parameters --bf16 --seed 42
    --position-embedding-type alibi --checkpoint-activations --abort-on-unmet-fused-kernel-constraints
    --kill-switch-path {d}/kill-switch-tr11-176B-exp1 --pad-vocab-size-to 250880
    --optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --lr 6e-5 --min-lr 6e-6
    --lr-decay-style cosine --lr-decay-samples 200_000_000 --lr-warmup-samples 183_105 --clip-grad 1.0
    --weight-decay 1e-1 --exit-duration-in-mins 5990
    --log-interval 1 --save-interval 100 --eval-interval 1000 --eval-iters 1 --tensorboard-dir {d}/tensorboard
    --tensorboard-queue-size 5 --log-timers-to-tensorboard --log-batch-size-to-tensorboard
    --log-validation-ppl-to-tensorboard
    --save {d}/checkpoints --load {d}/checkpoints
    --train-weighted-split-paths-path {d}/train-splits.txt --valid-weighted-split-paths-path {d}/valid-splits.txt
    --num-workers 2 --valid-num-workers 0 --data-impl mmap --distributed-backend nccl
    --deepspeed --deepspeed_config {ds_config} --zero-stage {zero_stage} --deepspeed-activation-checkpointing
    """.split()
    return argv, ds_config


def test_bloom_176b_flags_parse_into_the_expected_run_config(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")
    argv, ds_config = bloom_setup(tmp_path)
    args = parse_args(argv, world_size=384)
    rc = build_run_config(args)
    m, p, b = rc.model, rc.parallel, rc.batch
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (70, 14336, 112, 2048)
    assert m.position_embedding_type == "alibi" and m.embed_layernorm and m.init_method_std == 0.0048
    assert m.params_dtype == "bf16" and m.seed == 42 and m.padded_vocab_size is None
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size) == (4, 12, 8)
    assert p.pp_partition_method == "type:transformer|embedding" and p.distributed_backend == "nccl"
    assert args.local_rank == 5
    assert (b.micro_batch_size, b.global_batch_size, b.rampup_batch_size) == (2, 2048, (192, 16, 9_765_625))
    o = rc.optimizer
    assert (o.optimizer, o.betas, o.adam_eps, o.lr, o.min_lr, o.clip_grad, o.weight_decay) == \
        ("adam", (0.9, 0.95), 1e-8, 6e-5, 6e-6, 1.0, 0.1)
    assert rc.lr_schedule.lr_decay_style == "cosine" and rc.lr_schedule_in_samples() == (183_105, 200_000_000)
    t = rc.training
    assert t.train_samples == 220_000_000 and t.train_iters is None
    assert (t.eval_interval, t.eval_iters, t.checkpoint_activations, t.deepspeed_activation_checkpointing,
            t.sync_tp_duplicated_parameters) == (1000, 1, True, True, True)
    assert rc.precision.bf16 and rc.precision.zero_stage == 1
    d = rc.data
    assert d.tokenizer_type == "PretrainedFromHF" and d.pad_vocab_size_to == 250880 and d.data_impl == "mmap"
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
    assert scheduler.step(183_105) == pytest.approx(6e-5)


def test_bloom_176b_resumed_from_a_universal_checkpoint_with_zero_1(tmp_path):
    argv, ds_config = bloom_setup(tmp_path)
    rc = build_run_config(parse_args(argv + ["--universal-checkpoint"], world_size=384))
    assert rc.checkpoint.universal_checkpoint and rc.precision.zero_stage == 1
    config = json.loads(ds_config.read_text())
    config["zero_optimization"]["stage"] = 0
    ds_config.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="zero_optimization.stage = 0 .* contradicts --zero-stage 1"):
        parse_args(argv, world_size=384)


def test_bloom_176b_original_zero_stage_0_is_refused_with_the_fix(tmp_path):
    argv, _ = bloom_setup(tmp_path, zero_stage=0)
    with pytest.raises(ValueError, match="--bf16 with --zero-stage 0 is not supported .* use --zero-stage 1"):
        parse_args(argv, world_size=384)


def test_bloom_176b_on_the_wrong_world_size_names_the_sizes(tmp_path):
    argv, _ = bloom_setup(tmp_path)
    with pytest.raises(ValueError, match="world size 380 is not a multiple of --tensor-model-parallel-size 4 x "
                                         "--pipeline-model-parallel-size 12 = 48"):
        parse_args(argv, world_size=380)


def test_finetune_needs_a_checkpoint(files):
    with pytest.raises(ValueError, match="--finetune loads a checkpoint: pass --load"):
        parse(files, finetune=True)


def test_weighted_split_file_format_errors_name_the_file(tmp_path):
    argv, _ = bloom_setup(tmp_path)
    (tmp_path / "valid-splits.txt").write_text('"valid_en: 1 0.95:1.0"\n')
    with pytest.raises(ValueError, match=r"valid-splits.txt: '1 0.95:1.0' in group 'valid_en' is not"):
        parse_args(argv, world_size=384)
    (tmp_path / "valid-splits.txt").write_text("no quotes here\n")
    with pytest.raises(ValueError, match="expected one line of double-quoted groups"):
        parse_args(argv, world_size=384)


def test_data_modes_are_exclusive(files):
    group = f"g: 1 0:1 {files / 'a'}"
    with pytest.raises(ValueError, match="--data-path and --\\(train\\|valid\\|test\\)-weighted-split-paths"):
        parse(files, train_weighted_split_paths=[group])
    ok = build_run_config(parse(files, drop=["--data-path"], train_weighted_split_paths=[group],
                                valid_weighted_split_paths=[f"v: 1 0:1 {files / 'b'}"]))
    assert ok.data.train_weighted_split_groups[0].datasets == (DatasetSplit(1.0, 0.0, 1.0, str(files / "a")),)


def test_tokenizer_choices_match_the_data_package():
    tokenizers = pytest.importorskip("megatron.data.tokenizers")
    from megatron.config import TOKENIZER_TYPES

    assert set(TOKENIZER_TYPES) == set(tokenizers.TOKENIZER_TYPES)


def test_resolve_vocab_size_pads_as_megatron(files):
    pytest.importorskip("megatron.data.tokenizers")
    from types import SimpleNamespace

    from megatron.arguments import resolve_vocab_size

    rc = build_run_config(parse(files, world_size=2, tensor_model_parallel_size=2, global_batch_size=2))
    padded = resolve_vocab_size(rc, tokenizer=SimpleNamespace(vocab_size=50257))
    assert (padded.model.original_vocab_size, padded.model.padded_vocab_size) == (50257, 50432)  # 256 x 197
    bloom = build_run_config(parse(files, pad_vocab_size_to=250880))
    assert resolve_vocab_size(bloom, tokenizer=SimpleNamespace(vocab_size=250680)).model.padded_vocab_size == 250880


@pytest.mark.parametrize("rank,expected", [("0", 1), ("3", 0)])
def test_ignored_flag_is_logged_once_on_rank_zero(files, monkeypatch, caplog, rank, expected):
    monkeypatch.setenv("RANK", rank)
    with caplog.at_level("WARNING", logger="megatron.arguments"):
        parse(files, abort_on_unmet_fused_kernel_constraints=True)
    assert sum("fused-kernel" in r.getMessage() for r in caplog.records) == expected
