"""transformers' Llama family both ways: a random tiny LlamaForCausalLM (GQA, untied head; built from a
LlamaConfig here, nothing downloaded), Qwen2 (q / k / v biases) and Mistral (no sliding window) imported
at TP=2 / PP=2 and exported again.

transformers is the independent reference: its logits within the derived fp32 tolerance (about 1e-4), its
greedy text token for token, and every one of its tensors reproduced by import -> export.
"""

import pytest
import torch
from safetensors.torch import load_file

from megatron.checkpoint.hf.families import hf_architecture
from megatron.checkpoint.hf.io import export_tokenizer
from megatron.checkpoint.single_process import load_full_state_dict
from megatron.config import TokenizerConfig
from megatron.data.tokenizers import build_tokenizer
from megatron.testing import run_distributed
from megatron.testing.tolerance import model_tolerance
from tests.helpers.checkpoint import random_state_dict, tiny_model_config, tokenizer_record
from tests.helpers.hf import generate_tool, hf_greedy, hf_logits_diff
from tests.helpers.inference import PROMPTS
from tools.convert_checkpoint import from_hf, to_hf

# Weight perturbation: logits reach about 6. (At 0.3 they reach 10, where transformers' fp32 logits and ours
# each lie up to 4e-5 from a float64 evaluation.)
SCALE = 0.15
SIZES = dict(vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, rms_norm_eps=1e-6, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
FAMILY = {"llama": dict(num_key_value_heads=2, rope_theta=5000.0, tie_word_embeddings=False),
          "llama_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
          "qwen2": dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=20000.0),
          "mistral": dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None)}


def _random_hf_model(kind):
    import transformers

    config_class, model_class = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}.get(
        kind, (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    torch.manual_seed(5)
    model = model_class(config_class(**SIZES, **FAMILY[kind]))
    with torch.no_grad():
        for param in model.parameters():  # norms start at 1 and biases at 0: perturb all (large enough that
            param.add_(SCALE * torch.randn_like(param))  # greedy continuations vary)
    return model.eval()


def _import(tmp_path, tiny_corpus, kind, tp=2, pp=2):
    model = _random_hf_model(kind)
    model.save_pretrained(str(tmp_path / "hf_in"))
    export_tokenizer({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": tiny_corpus["vocab_file"],
                      "merge_file": tiny_corpus["merge_file"]}, str(tmp_path / "hf_in"))
    assert from_hf.main(["--hf-dir", str(tmp_path / "hf_in"), "--save", str(tmp_path / "ckpt"),
                         "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                         "--seq-length", "32"]) == 0
    return model


@pytest.mark.parametrize("kind", sorted(FAMILY))
def test_import_at_tp2_pp2_gives_transformers_logits_text_and_every_tensor_back(tmp_path, tiny_corpus, kind):
    model = _import(tmp_path, tiny_corpus, kind)
    config, state, _ = load_full_state_dict(str(tmp_path / "ckpt"))
    assert (config.padded_vocab_size, config.original_vocab_size) == (512, 400)
    assert (config.num_kv_heads, config.tied_embeddings) == (FAMILY[kind]["num_key_value_heads"],
                                                             FAMILY[kind]["tie_word_embeddings"])
    assert config.qkv_bias == (kind == "qwen2") and not config.add_bias_linear
    diff, tolerance = hf_logits_diff(model, config, state)
    assert diff <= tolerance, (diff, tolerance)

    assert to_hf.main(["--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "hf_out")]) == 0
    before, after = load_file(str(tmp_path / "hf_in" / "model.safetensors")), load_file(
        str(tmp_path / "hf_out" / "model.safetensors"))
    assert set(before) == set(after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name

    # 20 greedy tokens of 5 prompts from the converted TP=2 / PP=2 checkpoint: transformers' exactly.
    results = generate_tool(tmp_path / "ckpt", tmp_path / "out.json", PROMPTS, max_new_tokens=20)
    tokenizer = build_tokenizer(TokenizerConfig("PretrainedFromHF", tokenizer_name_or_path=str(tmp_path / "hf_in")))
    expected = hf_greedy(model, tokenizer, PROMPTS, max_new_tokens=20)
    assert [r["token_ids"] for r in results] == expected
    assert len({tuple(ids) for ids in expected}) == len(PROMPTS)  # the prompts do lead to different texts


def test_multi_query_imports_at_tp1_and_is_refused_at_tp2(tmp_path, tiny_corpus):
    FAMILY["llama_mqa"] = dict(num_key_value_heads=1, tie_word_embeddings=False)
    try:
        with pytest.raises(ValueError, match="--num-key-value-heads 1 is not divisible by --tensor-model-parallel-size 2"):
            _import(tmp_path / "tp2", tiny_corpus, "llama_mqa")
        model = _import(tmp_path / "tp1", tiny_corpus, "llama_mqa", tp=1, pp=2)
    finally:
        del FAMILY["llama_mqa"]
    config, state, _ = load_full_state_dict(str(tmp_path / "tp1" / "ckpt"))
    assert config.num_kv_heads == 1
    diff, tolerance = hf_logits_diff(model, config, state)
    assert diff <= tolerance, (diff, tolerance)


def _tp2_logits_from_shards(rank, world_size, ckpt, ids):
    """A TP=2 GPTModel loaded from this rank's layer files as written (no merging); gathered logits."""
    import torch.distributed as dist

    from megatron.checkpoint.run_state import load_run_state, model_config_from_dict
    from megatron.checkpoint.safe_load import safe_load
    from megatron.checkpoint.tags import resolve_tag
    from megatron.model import GPTModel
    from megatron.model.layout import local_name_of_file_key, pipeline_items
    from megatron.parallel.state import ParallelState

    torch.set_num_threads(1)
    state = ParallelState.create(tp=2, pp=1)
    try:
        tag = resolve_tag(ckpt, None, required=True)
        config = model_config_from_dict(load_run_state(ckpt, tag)["model_config"])
        model = GPTModel(config, state).eval()
        weights = {}
        for item in pipeline_items(config):
            if item.prefix is not None:
                shard = safe_load(f"{ckpt}/{tag}/layer_{item.index:02d}-model_{rank:02d}-model_states.pt")
                weights.update({item.prefix + local_name_of_file_key(k): v for k, v in shard.items()})
        model.load_state_dict(weights)
        with torch.no_grad():
            logits = model(ids)  # [s, b, vp]
        parts = [torch.empty_like(logits) for _ in range(2)]
        dist.all_gather(parts, logits, group=state.tp_group)
        return torch.cat(parts, dim=-1).transpose(0, 1)[..., :400]  # [b, s, v]
    finally:
        state.destroy()


@pytest.mark.multiprocess
def test_tp2_shards_of_an_imported_llama_compute_transformers_logits(tmp_path, tiny_corpus):
    model = _import(tmp_path, tiny_corpus, "llama")
    config, _, _ = load_full_state_dict(str(tmp_path / "ckpt"))
    ids = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits  # [b, s, v]
    for rank, logits in enumerate(run_distributed(_tp2_logits_from_shards, world_size=2,
                                                  args=(str(tmp_path / "ckpt"), ids))):
        diff = (torch.tensor(logits) - expected).abs().max().item()  # run_distributed returns tensors as lists
        assert diff <= model_tolerance(config, torch.float32, expected), (rank, diff)


def test_a_trained_llama_checkpoint_exports_to_llama_for_causal_lm(tmp_path, tiny_corpus):
    from transformers import AutoModelForCausalLM

    from megatron.checkpoint.run_state import converted_run_state
    from megatron.checkpoint.single_process import save_as_training_checkpoint

    config = tiny_model_config(position_embedding_type="rotary", embed_layernorm=False, normalization="rmsnorm",
                               swiglu=True, num_key_value_heads=2, add_bias_linear=False,
                               untie_embeddings_and_output_weights=True, ffn_hidden_size=96, rotary_base=1000.0)
    state = random_state_dict(config, scale=SCALE)
    save_as_training_checkpoint(config, state, str(tmp_path / "ckpt"), 2, 2,
                                run_state=converted_run_state(config, 2, 2, tokenizer=tokenizer_record(tiny_corpus)))
    assert to_hf.main(["--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "hf")]) == 0
    hf_model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(hf_model).__name__ == "LlamaForCausalLM" and hf_model.config.num_key_value_heads == 2
    diff, tolerance = hf_logits_diff(hf_model.eval(), config, state)
    assert diff <= tolerance, (diff, tolerance)


@pytest.mark.parametrize("overrides,words", [
    (dict(position_embedding_type="rotary", embed_layernorm=False, num_key_value_heads=2),
     "this model lacks one key / value head per query head"),
    (dict(position_embedding_type="alibi", normalization="rmsnorm", swiglu=True),
     "Llama family cannot hold this model: position_embedding_type 'alibi' (needs rotary), an embedding LayerNorm"),
    (dict(position_embedding_type="rotary", embed_layernorm=False, normalization="rmsnorm"),
     "a GeLU MLP (needs swiglu)"),
])
def test_models_no_transformers_class_holds_are_refused(overrides, words):
    with pytest.raises(ValueError) as info:
        hf_architecture(tiny_model_config(**overrides))
    assert words in str(info.value)


def test_llama_3_1_rope_scaling_matches_transformers_both_ways():
    import dataclasses

    import transformers

    from megatron.checkpoint.hf.llama import llama_config_kwargs, llama_state_dict_to_ours, model_config_from_llama
    from megatron.model import GPTModel

    # original context 16 < seq 32, head dim 16: long waves scaled, one band interpolated, short waves kept
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, num_key_value_heads=2, rope_parameters=rope))
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(SCALE * torch.randn_like(param))
    hf.eval()
    config = model_config_from_llama(hf.config, seq_length=32, padded_vocab_size=512)
    assert (config.rope_scaling_factor, config.rope_scaling_original_max_positions) == (8.0, 16)
    assert llama_config_kwargs(config)["rope_parameters"] == rope
    state = llama_state_dict_to_ours(hf.state_dict(), config)
    diff, tolerance = hf_logits_diff(hf, config, state)
    assert diff <= tolerance, (diff, tolerance)
    unscaled = dataclasses.replace(config, rope_scaling_factor=None)
    assert hf_logits_diff(hf, unscaled, state)[0] > 100 * tolerance  # the scaling matters at these positions
    GPTModel(config)  # builds


def test_sliding_window_and_other_rope_types_are_refused():
    import transformers

    from megatron.checkpoint.hf.llama import model_config_from_llama

    with pytest.raises(ValueError, match="sliding-window attention is not implemented"):
        model_config_from_llama(transformers.MistralConfig(**SIZES, sliding_window=16), seq_length=32)
    # YaRN is mapped (tests/checkpoint/test_hf_yarn.py); dynamic NTK scaling is not
    dynamic = transformers.LlamaConfig(**SIZES, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                 "factor": 4.0})
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not implemented here; plain rotary positions, "
                                         "Llama 3.1's scaling \\(llama3\\) and YaRN \\(yarn\\) are"):
        model_config_from_llama(dynamic, seq_length=32)
