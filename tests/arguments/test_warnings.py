"""Settings that are accepted but have no effect here: kept as given, and reported once at startup
(``RunConfig.startup_warnings``, logged by rank 0 only)."""

import pytest

from megatron.arguments.check import check_argv
from megatron.config.deepspeed import build_deepspeed_config
from tests.helpers.arguments import ds_json, parse, tiny_config_argv


def test_settings_without_effect_are_kept_and_reported(files):
    rc = parse(files, bf16=True, loss_scale=12, abort_on_unmet_fused_kernel_constraints=True,
               position_embedding_type="alibi", max_position_embeddings=32)
    warnings = " | ".join(rc.startup_warnings)
    assert "--abort-on-unmet-fused-kernel-constraints" in warnings
    assert "--loss-scale 12.0 ignored" in warnings
    assert "--max-position-embeddings 32 has no effect" in warnings
    assert len(rc.startup_warnings) == 3
    assert rc.precision.loss_scale == 12 and rc.model.max_position_embeddings == 32
    assert rc.model.position_embedding_type == "alibi"


def test_deepspeed_activation_checkpointing_needs_checkpoint_activations(files):
    alone = parse(files, deepspeed_activation_checkpointing=True)
    assert alone.training.deepspeed_activation_checkpointing
    assert any("has no effect without --checkpoint-activations" in w for w in alone.startup_warnings)
    both = parse(files, deepspeed_activation_checkpointing=True, checkpoint_activations=True)
    assert both.startup_warnings == ()


def test_a_plain_config_has_no_warnings(files):
    assert parse(files).startup_warnings == ()


def test_bf16_zero_stage_0_is_accepted_with_one_warning_from_the_flag_or_the_json(files):
    from_flag = parse(files, bf16=True, zero_stage=0)
    from_json = parse(files, bf16=True, deepspeed_config=ds_json(files, zero_optimization={"stage": 0}))
    for rc in (from_flag, from_json):
        assert (rc.precision.zero_stage, rc.deepspeed_zero_stage) == (0, 1)
        assert build_deepspeed_config(rc, rc.deepspeed_user_config)["zero_optimization"] == {"stage": 1}
        (warning,) = rc.startup_warnings
        assert warning.startswith("--zero-stage 0 with --bf16 runs DeepSpeed's BF16_Optimizer (ZeRO stage 1), "
                                  "BLOOM's optimizer")
    for flags in (dict(bf16=True, zero_stage=1), dict(zero_stage=0), dict(fp16=True, zero_stage=0)):
        rc = parse(files, **flags)
        assert rc.startup_warnings == () and rc.deepspeed_zero_stage == rc.precision.zero_stage, flags


@pytest.mark.parametrize("rank,expected", [("0", 1), ("3", 0)])
def test_ignored_flag_is_logged_once_on_rank_zero(files, monkeypatch, caplog, rank, expected):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "4")  # the rank is the launch's (torchrun's variables)
    with caplog.at_level("WARNING", logger="megatron.arguments"):
        parse(files, abort_on_unmet_fused_kernel_constraints=True)
    assert sum("fused-kernel" in r.getMessage() for r in caplog.records) == expected


def test_selective_recompute_with_checkpoint_activations_runs_full_with_one_warning(tokenizer_files):
    """Megatron-DeepSpeed runs both (a second recomputation of the core nested in each recomputed layer); here
    full recomputation wins, as it already recomputes the core, and the run says so once."""
    rc = parse(tokenizer_files, recompute_granularity="selective", checkpoint_activations=True)
    assert rc.training.checkpoint_activations and not rc.model.recompute_core_attention
    (warning,) = rc.startup_warnings
    assert warning.startswith("--recompute-granularity selective has no effect with --checkpoint-activations")
    check = check_argv(tiny_config_argv(tokenizer_files, recompute_granularity="selective",
                                        checkpoint_activations=True) + ["--dry-run", "--world-size", "2"])
    assert check.ok and check.warnings == (warning,)
    assert check.run_config.model.recompute_core_attention is False


def test_uniform_recompute_method_beside_checkpoint_activations_is_accepted_with_one_warning(files):
    """Megatron-DeepSpeed accepts the pair (uniform chunks are what --checkpoint-activations runs); alone, or with a
    layer count the pipeline would not use, the method flags are still refused."""
    rc = parse(files, checkpoint_activations=True, recompute_method="uniform")
    assert rc.training.checkpoint_activations and rc.training.checkpoint_num_layers == 1
    (warning,) = rc.startup_warnings
    assert warning.startswith("--recompute-method uniform changes nothing beside --checkpoint-activations")
    for flags in (dict(recompute_method="uniform"), dict(checkpoint_activations=True, recompute_num_layers=2),
                  dict(checkpoint_activations=True, recompute_method="block")):
        with pytest.raises(ValueError, match="apply to --recompute-granularity full; got granularity None"):
            parse(files, **flags)
