"""--kv-channels: a head size other than hidden / heads (every Qwen3's), against transformers' Qwen3ForCausalLM and
Qwen3MoeForCausalLM built here with random weights (hidden 64, 4 heads of 32: the attention is 128 wide, twice the
hidden size).

Each is imported at TP=2 x PP=2 and exported again (every tensor back bit for bit, the head size in the config);
transformers is the independent reference for the logits (within the fp32 tolerance of the model's depth,
tests/helpers/hf.py's logits_tolerance) of the model merged to one process and of the pipeline engine running the
import at TP=2 x PP=2, and for tools/generate.py's greedy text, token for token. Training such a model at
TP=2 x PP=2, TP=2 x CP=2 and Ulysses SP=2 gives the one-process run's losses and grad norms (assert_same_run).
"""

import pytest
import torch

from megatron.checkpoint.hf.llama import model_config_from_llama
from megatron.checkpoint.single_process import load_full_state_dict
from megatron.testing import run_distributed, tiny_argv
from tests.helpers.hf import (
    export_round_trip,
    greedy_pair,
    hf_logits_diff,
    import_hf,
    logits_tolerance,
    run_layers,
    save_with_tiny_tokenizer,
)
from tests.helpers.inference import PROMPTS, VOCAB, fixed_tokens, train_and_evaluate
from tests.helpers.training import assert_same_run, layout, train

SCALE = 0.15  # weight perturbation, as test_hf_moe.py's: every tensor moved, so a misplaced one shows
HEAD_DIM = 32  # != 64 / 4
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=HEAD_DIM, max_position_embeddings=64, rms_norm_eps=1e-6, attention_dropout=0.0,
             tie_word_embeddings=False, intermediate_size=96, bos_token_id=0, eos_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
FAMILY = {"qwen3": {}, "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         mlp_only_layers=[0], norm_topk_prob=False)}
# The models above as training flags (what from_hf's record says; --load checks them, the head size included).
QWEN3_FLAGS = ["--normalization", "rmsnorm", "--swiglu", "--disable-bias-linear", "--num-key-value-heads", "2",
               "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96", "--layernorm-epsilon", "1e-6",
               "--qk-layernorm", "--kv-channels", str(HEAD_DIM)]
MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-layer-freq", "[0,1]",
             "--moe-router-pre-softmax"]


def _random_hf_model(kind):
    import transformers

    config_class, model_class = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                                 "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}[kind]
    torch.manual_seed(7)
    model = model_class(config_class(**SIZES, **FAMILY[kind]))
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * HEAD_DIM, 64)  # the head size is theirs
    with torch.no_grad():
        for param in model.parameters():  # norms start at 1
            param.add_(SCALE * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module")
def imports(tmp_path_factory, tiny_corpus):
    """{kind: (transformers' model, its save_pretrained directory, its import at TP=2 x PP=2)}."""
    out = {}
    for kind in FAMILY:
        root = tmp_path_factory.mktemp(kind)
        model = _random_hf_model(kind)
        save_with_tiny_tokenizer(model, root / "hf_in", tiny_corpus)
        import_hf(root / "hf_in", root / "ckpt", tp=2, pp=2)
        out[kind] = model, root / "hf_in", root / "ckpt"
    return out


@pytest.mark.parametrize("kind", sorted(FAMILY))
def test_tp2_pp2_import_has_their_head_size_gives_their_logits_and_exports_every_tensor_back(imports, tmp_path,
                                                                                              kind):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model, hf_in, ckpt = imports[kind]
    config, state, _ = load_full_state_dict(str(ckpt))
    assert (config.kv_channels, config.head_dim, config.qk_layernorm) == (HEAD_DIM, HEAD_DIM, True)
    assert (config.moe is not None) == (kind == "qwen3_moe")
    assert state["layers.0.self_attention.query_key_value.weight"].shape == ((4 + 2 * 2) * HEAD_DIM, 64)
    assert state["layers.0.self_attention.dense.weight"].shape == (64, 4 * HEAD_DIM)
    diff, tolerance = hf_logits_diff(model, config, state)
    assert diff <= tolerance, (diff, tolerance)

    before, changed, added = export_round_trip(ckpt, hf_in, tmp_path / "hf_out")
    assert len(before) > 20 and changed == [] and added == [], (changed, added)
    exported = AutoConfig.from_pretrained(str(tmp_path / "hf_out"))
    assert (exported.model_type, exported.head_dim) == (kind, HEAD_DIM)
    assert load_file(str(tmp_path / "hf_out" / "model.safetensors"))[
        "model.layers.1.self_attn.o_proj.weight"].shape == (64, 4 * HEAD_DIM)


@pytest.mark.parametrize("kind", sorted(FAMILY))
def test_greedy_text_of_the_tp2_pp2_import_is_transformers(imports, tmp_path, kind):
    model, hf_in, ckpt = imports[kind]
    ours, expected = greedy_pair(model, hf_in, ckpt, tmp_path / "out.json", PROMPTS, 12)
    assert ours == expected
    assert len({tuple(ids) for ids in expected}) == len(PROMPTS)  # the prompts do lead to different texts


def evaluate_then_train(rank, world_size, evaluated, trained):
    """On each rank: ``train_and_evaluate`` every argv of ``evaluated`` (pipeline runs: their records, and on the last
    stage their logits of ``fixed_tokens()``), then ``train`` every argv of ``trained`` (their records)."""
    return [train_and_evaluate(rank, world_size, argv) for argv in evaluated] + train(rank, world_size, trained)


def _engine_logits(results, index):
    """Run ``index``'s logits of the last stage's two TP ranks, joined: [b, s, vp]."""
    shards = {r[index]["tp_rank"]: torch.from_numpy(r[index]["logits"]) for r in results if "logits" in r[index]}
    return torch.cat([shards[0], shards[1]], dim=-1).transpose(0, 1)


@pytest.mark.multiprocess
def test_pipeline_engine_at_tp2_pp2_gives_their_logits_and_trains_as_one_process(imports, tiny_corpus):
    """One 4-rank launch: each import loaded and run by the pipeline engine at TP=2 x PP=2 (its one iteration skipped:
    no update) gives transformers' logits; a model with the same head size trained from our own init for 10
    iterations at TP=2 x PP=2, TP=2 x CP=2 (ring attention) and Ulysses SP=2 gives the one-process run's losses and
    grad norms."""
    base = tiny_argv(tiny_corpus, *QWEN3_FLAGS, position_embedding_type="rotary", embed_layernorm=False)
    runs = [layout(base, *(MOE_FLAGS if kind == "qwen3_moe" else []), "--load", imports[kind][2], "--finetune",
                   "--train-iters", "1", "--lr-warmup-iters", "0", "--skip-train-iteration-range", "1-1", tp=2,
                   pp=2) for kind in sorted(FAMILY)]
    training = layout(base, "--train-iters", "10")
    trained = {"TP=2 x PP=2": layout(training, tp=2, pp=2),  # the ring and Ulysses' all-to-all on hn-wide heads too
               "TP=2 x CP=2": layout(training, "--context-parallel-size", 2, tp=2),
               "Ulysses SP=2 x DP=2": layout(training, "--ds-sequence-parallel-size", 2)}

    (reference,) = run_distributed(train, world_size=1, args=([training],), env={"OMP_NUM_THREADS": "1"},
                                   timeout=300)[0]
    results = run_distributed(evaluate_then_train, world_size=4, args=(runs, list(trained.values())),
                              env={"OMP_NUM_THREADS": "1"}, timeout=600)

    tokens = fixed_tokens()[:, :-1]  # [b, s]
    for index, kind in enumerate(sorted(FAMILY)):
        model = imports[kind][0]
        with torch.no_grad():
            theirs = model(tokens).logits  # [b, s, v]
        engine = _engine_logits(results, index)[..., :VOCAB]
        config = model_config_from_llama(model.config, 32) if kind == "qwen3" else \
            load_full_state_dict(str(imports[kind][2]))[0]
        diff = (theirs - engine).abs().max().item()
        assert diff <= logits_tolerance(config, theirs), (kind, diff, logits_tolerance(config, theirs))

    config = model_config_from_llama(imports["qwen3"][0].config, 32)
    assert reference["iterations"] == list(range(1, 11))
    for rank, result in enumerate(results):
        for label, run in zip(trained, result[len(FAMILY):], strict=True):
            assert_same_run(reference, run, f"rank {rank} of a --kv-channels 32 model at {label}",
                            num_layers=run_layers(config))
