"""Llama-style flags (issue 15): Megatron-DeepSpeed's and Megatron-LM's spellings reach one ModelConfig, and
every combination that cannot work is refused before launch, by the real path and by --dry-run alike."""


import pytest

from megatron.arguments import run_config_from_argv
from megatron.arguments.check import check_argv
from tests.helpers.arguments import tiny_config_argv

LLAMA = ["--normalization", "rmsnorm", "--swiglu", "--num-key-value-heads", "2", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--position-embedding-type", "rope", "--rotary-base", "500000", "--norm-epsilon",
         "1e-6", "--ffn-hidden-size", "96"]


def _model(files, extra, world_size=1):
    return run_config_from_argv(tiny_config_argv(files) + extra, world_size=world_size, with_vocab=False).model


def test_megatron_deepspeed_spelling_of_a_llama_model(files):
    m = _model(files, LLAMA, world_size=2)
    assert (m.normalization, m.swiglu, m.num_kv_heads, m.tied_embeddings, m.add_bias_linear, m.qkv_bias) == \
        ("rmsnorm", True, 2, False, False, False)
    assert (m.position_embedding_type, m.rotary_base, m.layernorm_epsilon, m.ffn_size) == ("rotary", 500000.0, 1e-6, 96)


def test_megatron_lm_spellings_give_the_same_model(files):
    lm = ["--normalization", "RMSNorm", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
          "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--use-rotary-position-embeddings",
          "--rotary-position-embeddings-theta", "500000", "--layernorm-epsilon", "1e-6", "--ffn-hidden-size", "96"]
    assert _model(files, lm) == _model(files, LLAMA)


@pytest.mark.parametrize("extra,position", [
    ([], "absolute"), (["--position-embedding-type", "learned_absolute"], "absolute"),
    (["--no-position-embedding"], "none"), (["--no-position-embedding", "--position-embedding-type", "rope"], "rotary"),
    (["--position-embedding-type", "alibi", "--no-position-embedding"], "alibi"),
])
def test_position_spellings(files, extra, position):
    assert _model(files, extra).position_embedding_type == position


def test_swiglu_default_width_is_megatrons_two_thirds_of_4h_in_multiples_of_64(files):
    m = _model(files, ["--swiglu", "--hidden-size", "4096", "--num-attention-heads", "32"])
    assert m.ffn_size == 10880  # int(4 * 4096 * 2 / 3 / 64) * 64; Llama-2-7B sets 11008 explicitly
    assert _model(files, ["--hidden-size", "128"]).ffn_size == 512


def test_llama_3_1_rope_scaling_flags(files):
    m = _model(files, ["--position-embedding-type", "rope", "--use-rope-scaling"])
    assert (m.rope_scaling_factor, m.rope_scaling_original_max_positions) == (8.0, 8192)
    assert _model(files, ["--use-rotary-position-embeddings", "--use-rope-scaling", "--rope-scaling-factor", "4"]
                  ).rope_scaling_factor == 4.0
    assert _model(files, ["--position-embedding-type", "rope"]).rope_scaling_factor is None
    with pytest.raises(ValueError, match="--use-rope-scaling scales rotary frequencies"):
        _model(files, ["--use-rope-scaling"])
    config = run_config_from_argv(tiny_config_argv(files) + ["--rope-scaling-factor", "4"], world_size=1,
                                  with_vocab=False)
    assert any("--rope-scaling-factor 4.0 has no effect" in w for w in config.startup_warnings)


def test_qkv_bias_alone(files):
    m = _model(files, ["--disable-bias-linear", "--add-qkv-bias"])
    assert (m.add_bias_linear, m.qkv_bias) == (False, True)


@pytest.mark.parametrize("extra,world,words", [
    (["--num-key-value-heads", "3"], 1, "--num-key-value-heads 3 does not divide --num-attention-heads 4"),
    (["--num-key-value-heads", "0"], 1, "--num-key-value-heads must be a positive integer, got 0"),
    (["--num-key-value-heads", "1", "--tensor-model-parallel-size", "2"], 2,
     "--num-key-value-heads 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--num-query-groups", "2"], 1, "--num-query-groups 2 needs --group-query-attention"),
    (["--group-query-attention"], 1, "--group-query-attention needs --num-query-groups N"),
    (["--group-query-attention", "--num-query-groups", "2", "--num-key-value-heads", "4"], 1,
     "--num-query-groups 2 and --num-key-value-heads 4 are two names for the same count"),
    (["--use-rotary-position-embeddings", "--position-embedding-type", "alibi"], 1,
     "--use-rotary-position-embeddings contradicts --position-embedding-type alibi"),
    (["--no-position-embedding", "--position-embedding-type", "absolute"], 1,
     "--no-position-embedding contradicts --position-embedding-type absolute"),
    (["--swiglu", "--ffn-hidden-size", "90", "--tensor-model-parallel-size", "4"], 4,
     "ffn hidden size 90 is not divisible by --tensor-model-parallel-size 4"),
    (["--swiglu", "--hidden-size", "16"], 1, "ffn hidden size 0 must be positive: set --ffn-hidden-size"),
])
def test_impossible_llama_settings_are_refused_naming_the_fix(files, extra, world, words):
    with pytest.raises(ValueError) as info:
        _model(files, extra, world_size=world)
    assert words in str(info.value)


def test_megatrons_behaviour_is_named_when_tp_exceeds_the_kv_heads(files):
    with pytest.raises(ValueError) as info:
        _model(files, ["--num-key-value-heads", "2", "--tensor-model-parallel-size", "4"], world_size=4)
    message = str(info.value)
    assert "Megatron-DeepSpeed refuses this too" in message and "Megatron-LM instead replicates" in message
    assert "Use a TP size dividing 2" in message


def test_add_qkv_bias_without_disable_bias_linear_warns(files):
    config = run_config_from_argv(tiny_config_argv(files) + ["--add-qkv-bias"], world_size=1, with_vocab=False)
    assert any("--add-qkv-bias has no effect" in w for w in config.startup_warnings)


def test_dry_run_knows_the_llama_flags(tokenizer_files):
    argv = tiny_config_argv(tokenizer_files) + LLAMA + ["--dry-run", "--world-size", "2",
                                                       "--tensor-model-parallel-size", "2"]
    check = check_argv(argv)
    assert check.ok, check.problems
    assert check.run_config.model == run_config_from_argv(argv, world_size=2).model


def test_dry_run_lists_llama_problems_beside_others(tokenizer_files):
    argv = tiny_config_argv(tokenizer_files, micro_batch_size=None) + [
        "--num-query-groups", "2", "--dry-run", "--world-size", "1"]
    problems = check_argv(argv).problems
    assert any("--num-query-groups 2 needs --group-query-attention" in p for p in problems), problems
    assert any("--micro-batch-size" in p for p in problems), problems
    argv = tiny_config_argv(tokenizer_files) + ["--num-key-value-heads", "1", "--tensor-model-parallel-size", "2",
                                               "--dry-run", "--world-size", "2"]
    assert any("--num-key-value-heads 1 is not divisible" in p for p in check_argv(argv).problems)
