"""The YaRN flags (Megatron-LM's names and meanings) reach ModelConfig's yarn_* fields: --position-embedding-type yarn
for the fused-QKV attention, MLA's --rope-type (yarn by default: DeepSeek-V3's recipe); a YaRN number where YaRN is off,
and --rope-type yarn without MLA, are refused by name with the fix."""

import pytest

from megatron.arguments import run_config_from_argv
from tests.helpers.arguments import tiny_config_argv

DEEPSEEK = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--qk-layernorm", "--multi-latent-attention", "--q-lora-rank", "32",
            "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]

LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
YARN_FIELDS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
               "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")


def _yarn(files, extra, world_size=1):
    model = run_config_from_argv(tiny_config_argv(files) + extra, world_size=world_size, with_vocab=False).model
    return model.position_embedding_type, tuple(getattr(model, name) for name in YARN_FIELDS)


def test_qwen3_style_yarn_flags(files):
    extra = LLAMA + ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
                     "--yarn-original-max-position-embeddings", "16", "--yarn-beta-fast", "16", "--yarn-beta-slow", "2",
                     "--no-yarn-correction-range-round-to-int"]
    assert _yarn(files, extra) == ("rotary", (4.0, 16, 16.0, 2.0, 1.0, 0.0, False))
    # Megatron-LM's defaults: original 4096, betas 32 / 1, mscale 1 / 0, rounded
    defaults = LLAMA + ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "2"]
    assert _yarn(files, defaults) == ("rotary", (2.0, 4096, 32.0, 1.0, 1.0, 0.0, True))
    # factor 1 (the default) is plain rotary, as in Megatron-LM
    assert _yarn(files, LLAMA + ["--position-embedding-type", "yarn"])[1][0] is None


def test_deepseek_v3_recipe_flags_select_yarn_for_mla(files):
    """Megatron-LM's DeepSeek-V3 recipe: --position-embedding-type rope, MLA, --rotary-scaling-factor 40 --mscale 1.0
    --mscale-all-dim 1.0 and no --rope-type (MLA's default is yarn)."""
    recipe = DEEPSEEK + ["--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "1.0"]
    assert _yarn(files, recipe) == ("rotary", (40.0, 4096, 32.0, 1.0, 1.0, 1.0, True))
    assert _yarn(files, recipe + ["--rope-type", "yarn"])[1][0] == 40.0
    assert _yarn(files, DEEPSEEK + ["--rope-type", "rope"])[1][0] is None


@pytest.mark.parametrize("extra,message", [
    (LLAMA + ["--position-embedding-type", "rope", "--rotary-scaling-factor", "4"],
     "--rotary-scaling-factor: YaRN's numbers, but --position-embedding-type rotary has no YaRN; select it with "
     "--position-embedding-type yarn or drop them"),
    (LLAMA + ["--position-embedding-type", "rope", "--mscale", "1.0", "--yarn-beta-fast", "8"],
     "--yarn-beta-fast, --mscale: YaRN's numbers"),
    (DEEPSEEK + ["--rope-type", "rope", "--rotary-scaling-factor", "40"],
     "--multi-latent-attention with --rope-type rope has no YaRN; select it with --rope-type yarn"),
    (DEEPSEEK[:4] + DEEPSEEK[6:] + ["--rotary-scaling-factor", "40"],
     "--multi-latent-attention with --position-embedding-type absolute has no YaRN; select it with "
     "--position-embedding-type rope \\(MLA's rope type is yarn by default\\)"),
    (LLAMA + ["--position-embedding-type", "rope", "--rope-type", "yarn"],
     "--rope-type yarn selects YaRN for --multi-latent-attention only .* use --position-embedding-type yarn"),
    (DEEPSEEK[:4] + DEEPSEEK[6:] + ["--position-embedding-type", "yarn"],
     "--position-embedding-type yarn with --multi-latent-attention: MLA selects YaRN by --rope-type"),
    (LLAMA + ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "0.5"],
     "--rotary-scaling-factor 0.5: YaRN extends the context, the factor must be >= 1"),
    (LLAMA + ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--yarn-beta-fast", "1",
              "--yarn-beta-slow", "2"], "it needs beta_fast >= beta_slow > 0"),
    (LLAMA + ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--use-rope-scaling"],
     "YaRN .* and Llama 3.1's --use-rope-scaling are two scalings of the same frequencies; pick one"),
])
def test_bad_yarn_combinations_are_refused_with_the_fix(files, extra, message):
    with pytest.raises(ValueError, match=message):
        _yarn(files, extra)


def test_dry_run_names_the_rope_scaling(files):
    """YaRN costs nothing (the same products): --dry-run's model line says it is on, and nothing else changes."""
    from megatron.dry_run.report import build_report
    from megatron.dry_run.text import render

    argv = tiny_config_argv(files) + LLAMA + ["--dry-run", "--world-size", "1"]
    plain = build_report(argv + ["--position-embedding-type", "rope"])
    yarn = build_report(argv + ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
                                "--yarn-original-max-position-embeddings", "16"])
    assert yarn["model"]["rope_scaling"] == "YaRN x4 of 16 positions" and plain["model"]["rope_scaling"] is None
    assert ", rotary (YaRN x4 of 16 positions), " in render(yarn) and "YaRN" not in render(plain)
    assert {k: v for k, v in yarn["model"].items() if k != "rope_scaling"} == \
        {k: v for k, v in plain["model"].items() if k != "rope_scaling"}
