"""A Llama-style model trained by DeepSpeed at (TP, PP, DP) = (2, 2, 2) in fp32, exported to transformers:
LlamaForCausalLM's logits equal the training engine's (within the derived fp32 tolerance), and
tools/generate.py's greedy continuations (5 prompts x 20 tokens) equal transformers' generate(do_sample=False).

One 8-rank launch trains a few iterations, saves, and evaluates a fixed batch with the pipeline engine
(test_trained_parity.py does the same for BLOOM, with the same helpers: tests/helpers/inference.py).
"""

import json

import pytest
import torch

from megatron.checkpoint.single_process import load_full_state_dict
from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import model_tolerance
from tests.helpers.inference import PROMPTS, VOCAB, fixed_tokens, train_and_evaluate

LLAMA = ("--normalization", "rmsnorm", "--swiglu", "--num-key-value-heads", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_corpus):
    from tools.convert_checkpoint import to_hf

    root = tmp_path_factory.mktemp("trained_llama")
    # A wide init (std 0.15) so that greedy continuations differ between prompts; wider would make the
    # logits so large that fp32 rounding alone reaches 1e-5.
    argv = tiny_argv(tiny_corpus, *LLAMA, train_iters=4, save=str(root / "ckpt"), save_interval=4,
                     tensor_model_parallel_size=2, pipeline_model_parallel_size=2, init_method_std=0.15,
                     position_embedding_type="rope", embed_layernorm=False)
    results = run_distributed(train_and_evaluate, world_size=8, args=(argv,), env={"OMP_NUM_THREADS": "1"}, timeout=600)
    shards = {r["tp_rank"]: torch.from_numpy(r["logits"]) for r in results if "logits" in r and r["dp_rank"] == 0}
    engine_logits = torch.cat([shards[0], shards[1]], dim=-1).transpose(0, 1)  # [b, s, vp]
    assert to_hf.main(["--load", str(root / "ckpt"), "--output-dir", str(root / "hf")]) == 0
    return {"root": root, "engine_logits": engine_logits, "iterations": results[-1]["iterations"]}


def _hf(path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path)).eval()


@pytest.mark.multiprocess
def test_exported_llama_matches_the_training_engine(trained):
    assert trained["iterations"] == [1, 2, 3, 4]
    hf = _hf(trained["root"] / "hf")
    assert (hf.config.num_key_value_heads, hf.config.tie_word_embeddings, hf.config.vocab_size) == (2, False, VOCAB)
    tokens = fixed_tokens()[:, :-1]  # [b, s]
    with torch.no_grad():
        theirs = hf(tokens).logits  # [b, s, v]
    engine = trained["engine_logits"][..., :VOCAB]
    diff = (theirs - engine).abs().max().item()
    config, _, _ = load_full_state_dict(str(trained["root"] / "ckpt"))
    assert diff <= model_tolerance(config, torch.float32, theirs), diff


@pytest.mark.multiprocess
def test_generate_tool_greedy_text_equals_transformers_generate(trained, tmp_path):
    from megatron.config import TokenizerConfig
    from megatron.data.tokenizers import build_tokenizer
    from tools import generate as generate_tool

    argv = ["--load", str(trained["root"] / "ckpt"), "--greedy", "--max-new-tokens", "20",
            "--output-json", str(tmp_path / "out.json")]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    assert generate_tool.main(argv) == 0
    ours = [r["token_ids"] for r in json.loads((tmp_path / "out.json").read_text())]
    hf = _hf(trained["root"] / "hf")
    tokenizer = build_tokenizer(TokenizerConfig("PretrainedFromHF", tokenizer_name_or_path=str(trained["root"] / "hf")))
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.tokenize(prompt)])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20, pad_token_id=0)
        expected.append(out[0, ids.shape[1]:].tolist())
    assert ours == expected
    assert len({tuple(ids) for ids in expected}) == len(PROMPTS)  # the prompts do lead to different texts
