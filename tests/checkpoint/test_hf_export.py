"""Export to / import from transformers on random tiny models: logits, greedy text, exact round trips.

transformers' BloomForCausalLM and GPT2LMHeadModel are the independent references. Checkpoints
are written at TP=2 / PP=2 by save_as_training_checkpoint so that the tools merge real shards.
"""

import pytest
import torch
from safetensors.torch import load_file

from megatron.config import TokenizerConfig
from megatron.data.tokenizers import build_tokenizer
from tests.helpers.checkpoint import write_random_checkpoint
from tests.helpers.hf import generate_tool, hf_greedy, hf_logits_diff
from tests.helpers.inference import PROMPTS
from tools.convert_checkpoint import from_hf, to_hf

ARCHITECTURES = {"BloomForCausalLM": {},
                 "GPT2LMHeadModel": dict(position_embedding_type="absolute", embed_layernorm=False,
                                         max_position_embeddings=96),
                 "GPTNeoXForCausalLM": dict(position_embedding_type="rotary", embed_layernorm=False, rotary_base=500.0)}


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_export_matches_transformers_logits_and_greedy_text(tmp_path, tiny_corpus, architecture):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, state = write_random_checkpoint(tmp_path / "ckpt", tiny_corpus, tp=2, pp=2, **ARCHITECTURES[architecture])
    # 0.1 MB shards: the ~0.5 MB model is written in transformers' sharded layout.
    assert to_hf.main(["--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "hf"),
                       "--max-shard-size-mb", "0.1"]) == 0
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) >= 3
    hf_model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    hf_model.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(hf_model).__name__ == architecture
    assert hf_model.config.vocab_size == 400
    if architecture == "BloomForCausalLM":
        assert hf_model.config.pretraining_tp == 2 and hf_model.config.slow_but_exact is False
    diff, tolerance = hf_logits_diff(hf_model, config, state)
    assert diff <= tolerance, (diff, tolerance)

    ours_tok = build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=tiny_corpus["vocab_file"],
                                               merge_file=tiny_corpus["merge_file"]))
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "The river was north of the city. Music  data!"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours_tok.tokenize(text)
    assert hf_tok.eos_token_id == ours_tok.eod

    results = generate_tool(tmp_path / "ckpt", tmp_path / "out.json", PROMPTS)
    expected = hf_greedy(hf_model, ours_tok, PROMPTS)
    assert [r["prompt"] for r in results] == PROMPTS
    assert [r["token_ids"] for r in results] == expected
    assert len({tuple(ids) for ids in expected}) == len(PROMPTS)  # the prompts do lead to different texts
    for r in results:
        ids = r["token_ids"][:-1] if r["finish_reason"] == "eod" else r["token_ids"]
        assert r["text"] == ours_tok.detokenize(ids)

    # And back from the sharded directory: our weights exactly, the padding rows now zero.
    from megatron.checkpoint.single_process import load_full_state_dict

    assert from_hf.main(["--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "back"),
                         "--tensor-model-parallel-size", "2", "--seq-length", "32"]) == 0
    back_config, back, _ = load_full_state_dict(str(tmp_path / "back"))
    assert back_config.position_embedding_type == config.position_embedding_type
    words = "embedding.word_embeddings.weight"
    assert torch.equal(back[words][:400], state[words][:400]) and not back[words][400:].any()
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items() if name != words)


def test_unmapped_architectures_are_refused_with_a_reason(tmp_path, tiny_corpus):
    write_random_checkpoint(tmp_path / "ckpt", tiny_corpus, position_embedding_type="rotary", embed_layernorm=True)
    with pytest.raises(ValueError, match="no transformers architecture maps position_embedding_type 'rotary'"):
        to_hf.main(["--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "hf")])


def _random_hf_model(kind):
    import transformers

    torch.manual_seed(5)
    if kind == "bloom":
        model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=400, hidden_size=64, n_layer=2,
                                                                       n_head=4, hidden_dropout=0.0,
                                                                       attention_dropout=0.0, bos_token_id=0,
                                                                       eos_token_id=0))
    elif kind == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            vocab_size=400, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
            hidden_act="gelu_new", use_parallel_residual=False, tie_word_embeddings=True, attention_dropout=0.0,
            hidden_dropout=0.0, attention_bias=True, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0}))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=400, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, activation_function="gelu_new", bos_token_id=0, eos_token_id=0))
    with torch.no_grad():
        for param in model.parameters():  # LayerNorms start at (1, 0) and biases at 0: perturb all
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()


@pytest.mark.parametrize("kind", ["bloom", "gpt2", "gpt_neox"])
def test_hf_to_ours_tp2_pp2_to_hf_reproduces_every_tensor(tmp_path, tiny_corpus, kind):
    from megatron.checkpoint.hf.io import export_tokenizer
    from megatron.checkpoint.single_process import load_full_state_dict

    model = _random_hf_model(kind)
    model.save_pretrained(str(tmp_path / "hf_in"))
    export_tokenizer({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": tiny_corpus["vocab_file"],
                      "merge_file": tiny_corpus["merge_file"]}, str(tmp_path / "hf_in"))
    argv = ["--hf-dir", str(tmp_path / "hf_in"), "--save", str(tmp_path / "ckpt"),
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--seq-length", "32"]
    assert from_hf.main(argv) == 0
    config, state, client = load_full_state_dict(str(tmp_path / "ckpt"))
    assert (config.padded_vocab_size, config.original_vocab_size) == (512, 400)  # 128 x TP 2 = 256 | 512
    assert torch.equal(state["embedding.word_embeddings.weight"][400:], torch.zeros(112, 64))
    assert client["tokenizer"]["tokenizer_type"] == "PretrainedFromHF"

    assert to_hf.main(["--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "hf_out")]) == 0
    before = {k: v for k, v in load_file(str(tmp_path / "hf_in" / "model.safetensors")).items() if k != "lm_head.weight"}
    after = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    if kind == "gpt2":  # old transformers versions saved the causal-mask buffers as tensors too
        before = {k: v for k, v in before.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert set(before) == set(after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name

    # The converted checkpoint generates exactly what the original transformers model does.
    results = generate_tool(tmp_path / "ckpt", tmp_path / "out.json", PROMPTS[:2])
    tokenizer = build_tokenizer(TokenizerConfig("PretrainedFromHF", tokenizer_name_or_path=str(tmp_path / "hf_in")))
    assert [r["token_ids"] for r in results] == hf_greedy(model, tokenizer, PROMPTS[:2])
