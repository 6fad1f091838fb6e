"""YaRN through the Hugging Face converters, both ways: a tiny Qwen3 and a tiny DeepSeek-V3 (multi-head latent
attention, mscale / mscale_all_dim) "trained at 16 positions and extended 4x with YaRN" (transformers' classes, random
weights built here, rope_parameters yarn with original_max_position_embeddings 16) are imported with
tools/convert_checkpoint/from_hf.py and give transformers' logits at 64 positions, four times the original context,
within the fp32 tolerance of the model's depth (tests/helpers/hf.py's logits_tolerance); the same weights without
YaRN are far from them (the comparison sees it). Exporting again gives every tensor back bit for bit and the same
rope parameters. What our (Megatron-LM's) YaRN does not compute as transformers does is refused by name."""

import dataclasses
import json

import pytest
import torch

from megatron.checkpoint.hf.deepseek import model_config_from_deepseek
from megatron.checkpoint.hf.llama import llama_config_kwargs, model_config_from_llama
from megatron.checkpoint.single_process import load_full_state_dict
from tests.helpers.hf import export_round_trip, hf_logits_diff, import_hf, save_with_tiny_tokenizer

# test_hf_qwen3.py's and test_hf_deepseek.py's tiny models (a head size other than hidden / heads; MLA with a query
# latent, 8 routed experts in 2 groups, a dense first layer)
QWEN3 = dict(vocab_size=400, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, rms_norm_eps=1e-6, attention_dropout=0.0, tie_word_embeddings=False, intermediate_size=96,
             bos_token_id=0, eos_token_id=0)
DEEPSEEK_V3 = dict(vocab_size=400, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                   num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                   q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
ORIGINAL, FACTOR, SEQ = 16, 4.0, 64  # trained at 16 positions, extended 4x, run at 64
QWEN3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": FACTOR, "original_max_position_embeddings": ORIGINAL}
# DeepSeek-V3's form (mscale and mscale_all_dim both given); they differ here so that both the rotary's attention
# factor (mscale(4, 1) / mscale(4, 0.707) != 1) and MLA's softmax scale (mscale(4, 0.707)^2) are exercised
DEEPSEEK_YARN = dict(QWEN3_YARN, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707)
CASES = {"qwen3": (QWEN3, QWEN3_YARN, 2), "deepseek_v3": (DEEPSEEK_V3, DEEPSEEK_YARN, 1)}  # kind: (sizes, rope, TP)


def _random_hf_model(kind):
    import transformers

    sizes, rope, _ = CASES[kind]
    sizes = dict(sizes, rope_parameters=rope, max_position_embeddings=SEQ)
    torch.manual_seed(7)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**sizes))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**sizes))
    with torch.no_grad():
        for param in model.parameters():  # norms start at 1: perturb every tensor, so a misplaced one shows
            param.add_(0.15 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model.eval()


@pytest.mark.parametrize("kind", sorted(CASES))
def test_yarn_import_gives_transformers_logits_beyond_the_original_context_and_exports_back(kind, tmp_path,
                                                                                             tiny_corpus):
    model = _random_hf_model(kind)
    hf_in = save_with_tiny_tokenizer(model, tmp_path / "hf_in", tiny_corpus)
    import_hf(hf_in, tmp_path / "ckpt", tp=CASES[kind][2], seq_length=SEQ)
    config, state, _ = load_full_state_dict(str(tmp_path / "ckpt"))
    rope = CASES[kind][1]
    assert (config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings) == (FACTOR, ORIGINAL)
    assert (config.yarn_mscale, config.yarn_mscale_all_dim) == (rope.get("mscale", 1.0), rope.get("mscale_all_dim", 0.0))
    diff, tolerance = hf_logits_diff(model, config, state, seq=SEQ)
    assert diff <= tolerance, (diff, tolerance)
    # the same weights with plain rotary are far off: the comparison above sees YaRN
    plain, _ = hf_logits_diff(model, dataclasses.replace(config, yarn_rotary_scaling_factor=None), state, seq=SEQ)
    assert plain > 100 * tolerance, (plain, tolerance)

    before, changed, added = export_round_trip(tmp_path / "ckpt", hf_in, tmp_path / "hf_out")
    assert len(before) > 20 and changed == [] and added == [], (changed, added)
    written = json.loads((tmp_path / "hf_out" / "config.json").read_text())
    written = written.get("rope_parameters") or written["rope_scaling"]
    assert {k: written.get(k) for k in rope} == rope, written


def test_what_our_yarn_does_not_compute_as_transformers_is_refused():
    import transformers

    def qwen3(**rope):
        return transformers.Qwen3Config(**dict(QWEN3, rope_parameters=dict(QWEN3_YARN, **rope)))

    # transformers ignores mscale without mscale_all_dim (and the other way round); Megatron-LM's YaRN does not
    with pytest.raises(ValueError, match="mscale 0.5 and mscale_all_dim None: transformers ignores one without the "
                                         "other, Megatron-LM's YaRN does not; give both, or neither"):
        model_config_from_llama(qwen3(mscale=0.5), seq_length=SEQ)
    with pytest.raises(ValueError, match="an explicit attention factor is not mapped"):
        model_config_from_llama(qwen3(attention_factor=1.5), seq_length=SEQ)
    # mscale 1 alone is transformers' default factor, 0.1 ln(factor) + 1: accepted, as (1, 0)
    assert model_config_from_llama(qwen3(mscale=1.0), seq_length=SEQ).yarn_mscale_all_dim == 0.0
    # export: a pair transformers would read otherwise
    config = model_config_from_llama(qwen3(), seq_length=SEQ)
    with pytest.raises(ValueError, match="--mscale 0.5 with --mscale-all-dim 0.0: transformers takes mscale into "
                                         "account only with a nonzero mscale_all_dim"):
        llama_config_kwargs(dataclasses.replace(config, yarn_mscale=0.5))
    deepseek = transformers.DeepseekV3Config(**dict(DEEPSEEK_V3, rope_parameters=DEEPSEEK_YARN))
    assert model_config_from_deepseek(deepseek, seq_length=SEQ).yarn_mscale_all_dim == 0.707
