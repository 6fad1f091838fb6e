"""The multi-head latent attention flags (Megatron-LM's names) reach ModelConfig.mla; what MLA does not run with is
refused by name before launch, the parallelisms and backends it trains with are accepted."""

import pytest

from megatron.arguments import run_config_from_argv
from megatron.config.mla import MLAConfig
from tests.helpers.arguments import tiny_config_argv

DEEPSEEK = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--qk-layernorm", "--multi-latent-attention", "--q-lora-rank", "32",
            "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]


def _model(files, extra, world_size=1):
    return run_config_from_argv(tiny_config_argv(files) + extra, world_size=world_size, with_vocab=False).model


def test_megatron_lm_mla_flags_give_the_latent_sizes(files):
    model = _model(files, DEEPSEEK, world_size=2)
    assert model.mla == MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12)
    assert model.qk_layernorm and model.mla.q_head_dim == 24
    assert _model(files, DEEPSEEK[:-12]).mla is None  # without --multi-latent-attention: the fused-QKV attention


@pytest.mark.parametrize("extra,world_size,message", [
    (["--attention-backend", "flash"], 1, "--multi-latent-attention is not implemented with --attention-backend flash "
                                          "\\(FlashAttention-2's flash_attn_func needs one head size"),
    (["--position-embedding-type", "alibi"], 1, "with --position-embedding-type alibi \\(needs rope\\)"),
    (["--kv-lora-rank", "0"], 1, "--kv-lora-rank must be a positive integer, got 0"),
])
def test_what_mla_does_not_implement_is_refused_before_launch(files, extra, world_size, message):
    with pytest.raises(ValueError, match=message):
        _model(files, DEEPSEEK + extra, world_size=world_size)


@pytest.mark.parametrize("extra", [
    ["--pipeline-model-parallel-size", "2", "--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"],
    ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2", "--num-layers", "4"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--context-parallel-size", "2", "--attention-dropout", "0"],
    ["--ds-sequence-parallel-size", "2"],
    ["--attention-backend", "flex", "--attention-dropout", "0"],
    ["--attention-backend", "unfused"],
])
def test_what_mla_trains_with_is_accepted(files, extra):
    """ZB-H1, interleaved virtual stages, sequence and context parallelism, DeepSpeed-Ulysses (trained in
    tests/training/test_mla.py),
    the flex and unfused attention backends (tests/model/test_attention_backends.py)."""
    assert _model(files, DEEPSEEK + extra, world_size=2).mla is not None
