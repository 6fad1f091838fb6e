"""Parsing flags: Megatron's derived values, the world size the launcher gives, every impossible
configuration refused by ``run_config_from_argv``, the DeepSpeed JSON checked against the flags, the
vocabulary padded, --help documenting every flag, and docs/flags.md matching the parser."""

import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron.arguments import build_parser, resolve_vocab_size, run_config_from_argv
from megatron.arguments.check import check_argv
from tests.helpers.arguments import ds_json, parse, tiny_config_argv

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_tiny_config_parses_with_megatron_derived_values(files):
    rc = parse(files, world_size=4, pipeline_model_parallel_size=2)
    assert (rc.parallel.tensor_model_parallel_size, rc.parallel.pipeline_model_parallel_size,
            rc.parallel.data_parallel_size, rc.world_size) == (1, 2, 2, 4)
    assert rc.model.padded_vocab_size is None and rc.model.original_vocab_size is None  # with_vocab=False
    assert rc.data.data_path == ((1.0, str(files / "a")),) and rc.data.split == "969, 30, 1"
    assert rc.precision.zero_stage == 0 and rc.model.params_dtype == "fp32" and not rc.bf16 and not rc.fp16
    assert rc.training.train_iters == 10 and not rc.training.sample_based
    assert rc.lr_schedule_in_samples() == (0, 80)  # Megatron: iterations x global batch size


def test_global_batch_defaults_to_one_micro_batch_per_dp_rank(files):
    assert parse(files, world_size=4, drop=["--global-batch-size"]).batch.global_batch_size == 8


def test_world_size_comes_from_the_launcher_unless_given(files, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    argv = tiny_config_argv(files)
    rc = run_config_from_argv(argv, with_vocab=False)
    assert (rc.world_size, rc.parallel.data_parallel_size) == (4, 4)
    assert run_config_from_argv(argv, world_size=2, with_vocab=False).parallel.data_parallel_size == 2
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's, under srun: it wins over SLURM_NTASKS
    assert run_config_from_argv(argv, with_vocab=False).parallel.data_parallel_size == 2
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        run_config_from_argv(argv, with_vocab=False)


def test_local_rank_accepts_both_spellings(files):
    argv = tiny_config_argv(files)
    parser = build_parser()
    assert parser.parse_args(argv + ["--local_rank", "3"]).local_rank == 3
    assert parser.parse_args(argv + ["--local-rank=1"]).local_rank == 1
    # accepted from the DeepSpeed launcher; the process's local rank is the launch's (megatron.config.launch)
    assert parse(files, local_rank=3).parallel.data_parallel_size == 2
    assert run_config_from_argv(argv + ["--local-rank=1"], world_size=2, with_vocab=False).world_size == 2


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
    (dict(zero_stage=2, pipeline_model_parallel_size=2), 2,
     "--zero-stage 2 does not combine with --pipeline-model-parallel-size 2"),
    (dict(zero_hpz_partition_size=2), 2, "--zero-hpz-partition-size 2 shards a secondary copy"),
    (dict(save="/tmp/x"), 2, "needs --save-interval"),
    (dict(data_impl="lazy"), 2, "--data-impl 'lazy' is not supported"),
    (dict(fp16=True, initial_loss_scale=1000), 2, "--initial-loss-scale 1000.0 must be a power of 2"),
    (dict(lr_warmup_fraction=0.1, lr_warmup_iters=2), 2, "give one of --lr-warmup-fraction"),
    (dict(universal_checkpoint=True), 2, "--universal-checkpoint loads a checkpoint: pass --load"),
    (dict(finetune=True), 2, "--finetune loads a checkpoint: pass --load"),
]


@pytest.mark.parametrize("overrides,world_size,words", REJECTED, ids=[r[2][:40] for r in REJECTED])
def test_impossible_configurations_are_rejected(files, overrides, world_size, words):
    with pytest.raises(ValueError) as info:
        parse(files, world_size=world_size, **overrides)
    assert words in str(info.value)


@pytest.mark.parametrize("overrides,world_size,words", REJECTED, ids=[r[2][:40] for r in REJECTED])
def test_the_dry_run_finds_first_what_a_launch_refuses(files, overrides, world_size, words):
    """One list of steps, two modes: the dry run's first problem is the launch's ValueError, word for word."""
    argv = tiny_config_argv(files, **overrides) + ["--dry-run", "--world-size", str(world_size)]
    with pytest.raises(ValueError) as info:
        run_config_from_argv(argv, world_size=world_size, with_vocab=False)
    assert check_argv(argv).problems[0] == str(info.value)


def test_embedding_counts_as_a_stage_layer_with_type_transformer_embedding(files):
    # 2 layers + the tied embedding on the first and the last stage = 4 items for 4 stages
    rc = parse(files, world_size=4, pipeline_model_parallel_size=4, global_batch_size=2,
               pp_partition_method="type:transformer|embedding")
    assert rc.parallel.pp_partition_method == "type:transformer|embedding"
    assert (rc.parallel.pipeline_model_parallel_size, rc.parallel.data_parallel_size) == (4, 1)


def test_missing_tokenizer_and_deepspeed_files_are_named(files, monkeypatch):
    with pytest.raises(ValueError, match=r"--vocab-file .*missing\.json.*no such file"):
        parse(files, vocab_file=files / "missing.json")
    with pytest.raises(ValueError, match="--tokenizer-model .*no such file"):
        parse(files, tokenizer_type="SentencePieceTokenizer", tokenizer_model=files / "sp.model")
    monkeypatch.setenv("HF_HUB_CACHE", str(files / "hub"))  # an empty cache (tests/data/test_hf_cache.py: a full one)
    with pytest.raises(ValueError, match="'bigscience/bloom' is not a local path and not in the local Hugging Face "
                                         "cache"):
        parse(files, tokenizer_type="PretrainedFromHF", tokenizer_name_or_path="bigscience/bloom")
    with pytest.raises(ValueError, match="no such file or directory, and not a hub name"):
        parse(files, tokenizer_type="PretrainedFromHF", tokenizer_name_or_path=files / "no" / "tokenizer")
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
        parse(files, deepspeed_config=ds_json(files, **entries), **kwargs)
    assert words in str(info.value)


def test_zero_stage_defaults_to_the_json_value(files):
    rc = parse(files, deepspeed_config=ds_json(files, zero_optimization={"stage": 1}))
    assert rc.precision.zero_stage == 1 and rc.deepspeed_user_config == {"zero_optimization": {"stage": 1}}
    assert rc.deepspeed_config == str(files / "ds.json")
    assert parse(files).precision.zero_stage == 0
    bf16 = parse(files, bf16=True)
    assert bf16.precision.zero_stage == 1 and bf16.bf16 and bf16.model.params_dtype == "bf16"


def test_the_vocabulary_is_padded_as_megatron(files):
    pytest.importorskip("megatron.data.tokenizers")
    gpt2 = SimpleNamespace(vocab_size=50257)
    argv = tiny_config_argv(files, tensor_model_parallel_size=2, global_batch_size=2)
    rc = run_config_from_argv(argv, world_size=2, tokenizer=gpt2)
    assert (rc.model.original_vocab_size, rc.model.padded_vocab_size) == (50257, 50432)  # 256 x 197
    unpadded = run_config_from_argv(argv, world_size=2, with_vocab=False)
    assert resolve_vocab_size(unpadded, tokenizer=gpt2) == rc
    bloom = run_config_from_argv(tiny_config_argv(files, pad_vocab_size_to=250880), world_size=2,
                                 tokenizer=SimpleNamespace(vocab_size=250680))
    assert (bloom.model.original_vocab_size, bloom.model.padded_vocab_size) == (250680, 250880)


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
    from tools import gen_flags_doc

    assert (REPO / "docs" / "flags.md").read_text() == gen_flags_doc.render(build_parser()), \
        "docs/flags.md is stale: run python tools/gen_flags_doc.py"


def test_gen_flags_doc_check_mode_exits_zero():
    result = subprocess.run([sys.executable, str(REPO / "tools" / "gen_flags_doc.py"), "--check"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
