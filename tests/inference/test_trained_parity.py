"""A DeepSpeed-trained checkpoint at (TP, PP, DP) = (2, 2, 2) against transformers, and back into training.

One 8-rank launch trains a tiny BLOOM a few iterations, saves, and evaluates a fixed batch with the
pipeline engine (its logits are the reference for the merged, exported weights). Then:
- to_hf (run as a process) -> BloomForCausalLM: logits equal the engine's and our merged GPTModel's;
- transformers' own BLOOM converter (4.46.3) on the same checkpoint gives the same model;
  tools/generate.py's greedy continuations equal transformers' generate(do_sample=False);
- from_hf at TP 2 / PP 2 then to_hf reproduces every exported tensor exactly;
- a 4-rank pretrain() --load of the from_hf checkpoint continues training; its first loss equals the
  loss transformers' model gives the same first batch (with our 112 zero-padded vocabulary logits).
"""

import json
import math
import subprocess
import sys

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import model_tolerance, tolerance
from tests.helpers.inference import PADDED, PROMPTS, VOCAB, fixed_tokens, train_and_evaluate
from tests.helpers.paths import REPO_ROOT
from tests.helpers.training import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_corpus):
    root = tmp_path_factory.mktemp("trained")
    # A wide init (std 0.3) so that greedy continuations differ between prompts instead of repeating
    # the one token a near-uniform model prefers.
    argv = tiny_argv(tiny_corpus, train_iters=4, save=str(root / "ckpt"), save_interval=4, tensor_model_parallel_size=2,
                     pipeline_model_parallel_size=2, init_method_std=0.3)
    results = run_distributed(train_and_evaluate, world_size=8, args=(argv,), env={"OMP_NUM_THREADS": "1"}, timeout=600)
    shards = {r["tp_rank"]: torch.from_numpy(r["logits"]) for r in results if "logits" in r and r["dp_rank"] == 0}
    engine_logits = torch.cat([shards[0], shards[1]], dim=-1).transpose(0, 1)  # [b, s, vp]
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "convert_checkpoint" / "to_hf.py"), "--load",
                    str(root / "ckpt"), "--output-dir", str(root / "hf")], check=True, cwd=REPO_ROOT)
    return {"root": root, "engine_logits": engine_logits, "history": results[-1]["history"]}


def _hf(path):
    from transformers import BloomForCausalLM

    return BloomForCausalLM.from_pretrained(str(path)).eval()


@pytest.mark.multiprocess
def test_exported_bloom_matches_the_training_engine_and_our_model(trained):
    from megatron.checkpoint.single_process import load_full_state_dict
    from megatron.model import GPTModel

    hf = _hf(trained["root"] / "hf")
    assert hf.config.pretraining_tp == 2 and hf.config.vocab_size == VOCAB
    config, state, _ = load_full_state_dict(str(trained["root"] / "ckpt"))
    ours = GPTModel(config).eval()
    ours.load_state_dict(state)
    ids = fixed_tokens()[:, :-1]  # [b, s]
    with torch.no_grad():
        theirs = hf(ids).logits  # [b, s, v]
        mine = ours(ids).transpose(0, 1)  # [b, s, vp]
    engine = trained["engine_logits"]
    assert engine.shape == (2, 32, PADDED)
    engine_diff = (theirs - engine[..., :VOCAB]).abs().max().item()
    ours_diff = (theirs - mine[..., :VOCAB]).abs().max().item()
    print(f"max |logits| diff vs transformers: engine {engine_diff:.3g}, merged GPTModel {ours_diff:.3g} "
          f"(logits up to {theirs.abs().max().item():.3g})")
    tolerance = model_tolerance(config, torch.float32, theirs)
    assert engine_diff <= tolerance and ours_diff <= tolerance, (engine_diff, ours_diff, tolerance)
    assert torch.equal(mine, ours(ids).transpose(0, 1))


@pytest.mark.multiprocess
def test_generate_tool_greedy_text_equals_transformers_generate(trained, tmp_path):
    from megatron.config import TokenizerConfig
    from megatron.data.tokenizers import build_tokenizer
    from tools import generate as generate_tool

    argv = ["--load", str(trained["root"] / "ckpt"), "--greedy", "--max-new-tokens", "32", "--output-json",
            str(tmp_path / "out.json")]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    assert generate_tool.main(argv) == 0
    results = json.loads((tmp_path / "out.json").read_text())
    hf = _hf(trained["root"] / "hf")
    tokenizer = build_tokenizer(TokenizerConfig("PretrainedFromHF", tokenizer_name_or_path=str(trained["root"] / "hf")))
    for prompt, result in zip(PROMPTS, results):
        ids = torch.tensor([tokenizer.tokenize(prompt)])
        assert result["prompt_token_ids"] == ids[0].tolist()
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32)
        assert result["token_ids"] == expected[0, ids.shape[1]:].tolist(), prompt
    assert len({tuple(r["token_ids"]) for r in results}) == len(PROMPTS)
    assert len({t for r in results for t in r["token_ids"]}) > 10  # not one token repeated everywhere


BLOOM_CONVERTER = REPO_ROOT / ".venv" / "external" / "convert_bloom_original_checkpoint_to_pytorch.py"


@pytest.mark.multiprocess
def test_transformers_own_bloom_converter_reads_our_checkpoint(trained, tmp_path):
    """transformers 4.46.3's convert_bloom_original_checkpoint_to_pytorch.py (BLOOM's own route from a
    Megatron-DeepSpeed checkpoint to transformers; `make test` extracts it from the wheel) on our
    TP=2, PP=2 checkpoint gives the model our to_hf.py exports: every tensor exactly (the TP shards
    concatenated, the replicated ones averaged: (a + a) / 2 is a), so the same logits exactly, same greedy
    text."""
    if not BLOOM_CONVERTER.is_file():
        pytest.skip(f"{BLOOM_CONVERTER} is missing: `make test` extracts it from PyPI's transformers 4.46.3 wheel, "
                    f"which could not be fetched here")
    from transformers import AutoTokenizer, BloomConfig, BloomForCausalLM

    ours = _hf(trained["root"] / "hf")
    padded = json.loads((trained["root"] / "hf" / "config.json").read_text())
    padded["vocab_size"] = PADDED  # the layer files hold the padded rows; trimmed below
    (tmp_path / "config.json").write_text(json.dumps(padded))
    subprocess.run([sys.executable, str(BLOOM_CONVERTER), "--bloom_checkpoint_path",
                    str(trained["root"] / "ckpt" / "global_step4"), "--bloom_config_file", str(tmp_path / "config.json"),
                    "--pytorch_dump_folder_path", str(tmp_path / "converted"), "--pretraining_tp", "2"],
                   check=True, cwd=tmp_path, capture_output=True)
    state = torch.load(tmp_path / "converted" / "pytorch_model.bin", map_location="cpu", weights_only=True)
    state["word_embeddings.weight"] = state["word_embeddings.weight"][:VOCAB]
    theirs = BloomForCausalLM(BloomConfig.from_pretrained(str(trained["root"] / "hf"))).eval()
    theirs.transformer.load_state_dict(state, strict=True)  # every tensor, no more, no fewer
    theirs.tie_weights()
    mine = ours.state_dict()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(tensor, mine[name]), name
    tokens = fixed_tokens()[:, :-1]
    with torch.no_grad():  # the same class on the same weights, in one process: the same operations
        assert torch.equal(theirs(tokens).logits, ours(tokens).logits)
    tokenizer = AutoTokenizer.from_pretrained(str(trained["root"] / "hf"))
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")
        a = theirs.generate(**ids, do_sample=False, max_new_tokens=20, min_new_tokens=20)
        b = ours.generate(**ids, do_sample=False, max_new_tokens=20, min_new_tokens=20)
        assert a.shape[1] == ids["input_ids"].shape[1] + 20 and torch.equal(a, b), prompt


@pytest.mark.multiprocess
def test_from_hf_round_trip_is_exact_and_training_continues_from_it(trained, tiny_corpus, tmp_path):
    from safetensors.torch import load_file

    from megatron.arguments import run_config_from_argv
    from megatron.training.data_iterators import build_datasets
    from tools.convert_checkpoint import from_hf, to_hf

    assert from_hf.main(["--hf-dir", str(trained["root"] / "hf"), "--save", str(tmp_path / "ckpt"),
                         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                         "--seq-length", "32"]) == 0
    assert to_hf.main(["--load", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "hf")]) == 0
    before = load_file(str(trained["root"] / "hf" / "model.safetensors"))
    after = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(before) == set(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name

    argv = tiny_argv(tiny_corpus, train_iters=2, lr_warmup_iters=1, load=str(tmp_path / "ckpt"), no_load_optim=True,
                     tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    results = run_distributed(train, world_size=4, args=([argv],), env={"OMP_NUM_THREADS": "1"}, timeout=600)
    history = [(iteration, loss) for iteration, loss, *_ in results[-1][0]["history"]]
    assert [i for i, _ in history] == [1, 2] and all(math.isfinite(loss) for _, loss in history)

    # The first step's loss is the model's loss on samples 0..7 (one global batch), before any update.
    rc = run_config_from_argv(argv, world_size=4)
    train_set = build_datasets(rc).train
    tokens = torch.stack([torch.from_numpy(train_set[i]["text"]) for i in range(8)])  # [8, s + 1]
    with torch.no_grad():
        logits = _hf(trained["root"] / "hf")(tokens[:, :-1]).logits  # [8, s, v]
    padded = torch.cat((logits, torch.zeros(8, 32, PADDED - VOCAB)), dim=-1)  # the zero rows' logits
    expected = torch.nn.functional.cross_entropy(padded.reshape(-1, PADDED), tokens[:, 1:].reshape(-1)).item()
    unpadded = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()
    print(f"first loss {history[0][1]:.6f}, transformers with padding {expected:.6f}, without {unpadded:.6f}")
    # TP 2 x PP 2 against one process: a token's loss moves by at most twice its logits' difference (the model's
    # depth); the cross entropy's own shift, exp, sum over the padded vocabulary, log and the mean's sum over
    # the batch's tokens and division (depth 6) add theirs.
    bound = (2 * model_tolerance(rc.model, torch.float32, logits)
             + tolerance(torch.float32, 6, max(PADDED, tokens[:, 1:].numel()), expected))
    assert abs(history[0][1] - expected) <= bound, (history[0][1], expected)
