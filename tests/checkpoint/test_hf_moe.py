"""transformers' MoE models both ways: random tiny MixtralForCausalLM and Qwen3MoeForCausalLM (a dense first layer,
top-k weights not renormalised, QK-norm) built here from their configs (nothing downloaded), imported at EP=1 and
at EP=2 x TP=2 x PP=2, and exported again.

transformers is the independent reference: its logits within the fp32 tolerance of the model's depth (the MoE
layers' routing and experts counted: tests/helpers/hf.py's logits_tolerance), its greedy text token for token, every
one of its tensors reproduced by import -> export. A training run at EP=2 loads the EP=2 import as a run at EP=1
loads the EP=1 one (their losses and grad norms within run_tolerance: EP splits the experts' sums, not the model),
and the checkpoint it saves goes back through to_hf -> from_hf into the same files.
"""

import dataclasses
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron.checkpoint.hf.families import hf_architecture
from megatron.checkpoint.hf.mixtral_qwen3 import model_config_from_moe
from megatron.checkpoint.safe_load import safe_load
from megatron.checkpoint.single_process import load_full_state_dict, save_as_training_checkpoint
from megatron.testing import run_distributed, tiny_argv
from tests.helpers.checkpoint import tiny_model_config
from tests.helpers.hf import (
    export_round_trip,
    greedy_pair,
    hf_logits_diff,
    import_hf,
    run_layers,
    save_with_tiny_tokenizer,
)
from tests.helpers.inference import PROMPTS
from tests.helpers.moe import train_moe
from tests.helpers.training import assert_same_run
from tools.convert_checkpoint import from_hf, to_hf

SCALE = 0.15  # weight perturbation, as tests/checkpoint/test_hf_llama.py's: logits reach about 6
SIZES = dict(vocab_size=400, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rms_norm_eps=1e-6, attention_dropout=0.0, tie_word_embeddings=False,
             num_experts_per_tok=2, bos_token_id=0, eos_token_id=0)
FAMILY = {"mixtral": dict(num_local_experts=4, intermediate_size=48, rope_parameters={"rope_type": "default",
                                                                                      "rope_theta": 5000.0}),
          "qwen3_moe": dict(num_experts=4, moe_intermediate_size=48, intermediate_size=96, mlp_only_layers=[0],
                            norm_topk_prob=False)}
# The Qwen3-MoE model above as training flags (what from_hf's record says; --load checks them).
QWEN3_MOE_FLAGS = ["--normalization", "rmsnorm", "--swiglu",
                   "--disable-bias-linear", "--num-key-value-heads", "2", "--untie-embeddings-and-output-weights",
                   "--ffn-hidden-size", "96", "--layernorm-epsilon", "1e-6", "--qk-layernorm", "--num-experts", "4",
                   "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-layer-freq", "[0,1]",
                   "--moe-router-pre-softmax"]


def _random_hf_model(kind):
    import transformers

    config_class, model_class = {"mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
                                 "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}[kind]
    torch.manual_seed(5)
    model = model_class(config_class(**SIZES, **FAMILY[kind]))
    with torch.no_grad():
        for param in model.parameters():  # norms start at 1: perturb every tensor, so a misplaced one shows
            param.add_(SCALE * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tiny_corpus):
    """{kind: (model, its save_pretrained directory with our tiny tokenizer)}."""
    out = {}
    for kind in FAMILY:
        path = tmp_path_factory.mktemp(kind) / "hf_in"
        model = _random_hf_model(kind)
        save_with_tiny_tokenizer(model, path, tiny_corpus)
        out[kind] = model, path
    return out


@pytest.mark.parametrize("kind,tp,pp,ep", [("mixtral", 1, 1, 1), ("mixtral", 2, 2, 2), ("qwen3_moe", 1, 1, 1),
                                           ("qwen3_moe", 2, 2, 2)])
def test_import_gives_transformers_logits_and_export_gives_every_tensor_back(hf_dirs, tmp_path, kind, tp, pp, ep):
    model, hf_in = hf_dirs[kind]
    import_hf(hf_in, tmp_path / "ckpt", tp, pp, ep)
    experts = sorted(f for f in os.listdir(tmp_path / "ckpt" / "global_step0") if f.startswith("expert_states"))
    assert len(experts) == (ep * tp * pp if ep > 1 else 0), experts
    config, state, _ = load_full_state_dict(str(tmp_path / "ckpt"))
    assert (config.moe.num_experts, config.moe.router_topk, config.qk_layernorm) == (4, 2, kind == "qwen3_moe")
    assert config.moe.layer_pattern == ((True, True) if kind == "mixtral" else (False, True))
    assert config.moe.router_pre_softmax == (kind == "qwen3_moe")  # norm_topk_prob False
    # fp32, another implementation (transformers' routing and experts): within the tolerance of the model's depth
    diff, tolerance = hf_logits_diff(model, config, state)
    assert diff <= tolerance, (diff, tolerance)

    before, changed, added = export_round_trip(tmp_path / "ckpt", hf_in, tmp_path / "hf_out")
    assert len(before) > 20 and changed == [] and added == [], (changed, added)


def test_greedy_text_from_an_ep2_import_is_transformers(hf_dirs, tmp_path):
    model, hf_in = hf_dirs["qwen3_moe"]
    import_hf(hf_in, tmp_path / "ckpt", tp=2, pp=1, ep=2)
    ours, expected = greedy_pair(model, hf_in, tmp_path / "ckpt", tmp_path / "out.json", PROMPTS, 12)
    assert ours == expected
    assert len({tuple(ids) for ids in expected}) == len(PROMPTS)  # the prompts do lead to different texts


def test_an_unmapped_deepseek_v3_is_refused_by_name_before_any_weight_is_read(tmp_path):
    import transformers

    config = transformers.DeepseekV3Config(vocab_size=400, hidden_size=64, intermediate_size=96,
                                           moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                           n_group=2, topk_group=1, rope_interleave=False)
    config.save_pretrained(str(tmp_path / "hf"))  # the config alone: it is refused before any weight is read
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM with rope_interleave False .* is not converted"):
        from_hf.main(["--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")])
    assert not (tmp_path / "ckpt").exists()


def test_bad_expert_parallel_sizes_and_unmappable_routing_are_refused(hf_dirs, tmp_path):
    with pytest.raises(ValueError, match="--expert-model-parallel-size 3 does not divide the 4 experts"):
        import_hf(hf_dirs["mixtral"][1], tmp_path / "ckpt", ep=3)
    dense = tiny_model_config(position_embedding_type="rotary", embed_layernorm=False, normalization="rmsnorm",
                              swiglu=True, add_bias_linear=False)
    with pytest.raises(ValueError, match="--expert-model-parallel-size 2 needs an MoE model"):
        save_as_training_checkpoint(dense, {}, str(tmp_path / "dense"), 1, 1, ep=2)
    config = model_config_from_moe(hf_dirs["mixtral"][0].config, seq_length=32)
    assert hf_architecture(config) == "mixtral"
    sigmoid = dataclasses.replace(config, moe=dataclasses.replace(config.moe, router_score_function="sigmoid",
                                                                  router_enable_expert_bias=True))
    with pytest.raises(ValueError, match="cannot hold this MoE model: --moe-router-score-function sigmoid "
                                         r"\(needs softmax\), an expert bias"):
        hf_architecture(sigmoid)
    assert hf_architecture(dataclasses.replace(dense, qk_layernorm=True)) == "qwen3"  # dense Qwen3, not Qwen3-MoE


def _tensors(tag_dir):
    """{file: {key: tensor}} of a checkpoint's layer files and expert files' parameters."""
    out = {}
    for name in sorted(os.listdir(tag_dir)):
        if name.startswith("layer_"):
            out[name] = safe_load(os.path.join(tag_dir, name))
        elif name.startswith("expert_states"):
            out[name] = safe_load(os.path.join(tag_dir, name))["params"]
    return out


@pytest.mark.multiprocess
def test_training_loads_the_ep2_import_as_the_ep1_one_and_its_checkpoint_converts_back(hf_dirs, tmp_path,
                                                                                       tiny_corpus):
    """Two runs on 2 ranks (one launch): EP=1 from the EP=1 import, EP=2 from the EP=2 import; the same losses show
    the experts where training expects them. The EP=2 run's own checkpoint -> to_hf -> from_hf at EP=2: the same
    layer and expert files, tensor for tensor (the vocabulary's padding rows aside: exports drop them)."""
    _, hf_in = hf_dirs["qwen3_moe"]
    runs = []
    for ep in (1, 2):
        import_hf(hf_in, tmp_path / f"import_ep{ep}", ep=ep)
        runs.append(tiny_argv(tiny_corpus, *QWEN3_MOE_FLAGS, position_embedding_type="rotary", embed_layernorm=False,
                              train_iters=2, lr_warmup_iters=1, lr=1e-3,
                              load=str(tmp_path / f"import_ep{ep}"), finetune=True, expert_model_parallel_size=ep,
                              save=str(tmp_path / f"trained_ep{ep}"), save_interval=2))
    ep1, ep2 = run_distributed(train_moe, world_size=2, args=(runs,), env={"OMP_NUM_THREADS": "1"}, timeout=300)[0]
    assert ep1["iterations"] == ep2["iterations"] == [1, 2]
    # EP=2 computes the experts' tokens in other batches and sums their gradients over other ranks: two fp32 runs
    # of a model as deep as run_layers' dense ones (the MoE layer's routing counted), within run_tolerance. (They
    # came out bit-identical on the AVX-512, AVX2 and scalar kernels, but not by construction: an expert's weight
    # gradient sums both ranks' tokens in one product at EP=2, two products and an all-reduce at EP=1.)
    config = model_config_from_moe(hf_dirs["qwen3_moe"][0].config, seq_length=32)
    assert_same_run(ep1, ep2, "EP=2 vs EP=1", num_layers=run_layers(config))

    trained = tmp_path / "trained_ep2"
    assert to_hf.main(["--load", str(trained), "--output-dir", str(tmp_path / "hf_trained")]) == 0
    moved = load_file(str(tmp_path / "hf_trained" / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # an expert of EP rank 1 that training moved
    assert not torch.equal(moved[name], load_file(str(hf_in / "model.safetensors"))[name])
    import_hf(tmp_path / "hf_trained", tmp_path / "again", ep=2)
    saved, converted = _tensors(trained / "global_step2"), _tensors(tmp_path / "again" / "global_step0")
    assert set(saved) == set(converted) and sum(n.startswith("expert_states") for n in saved) == 2, sorted(saved)
    for file, tensors in saved.items():
        assert set(tensors) == set(converted[file]), file
        for key, tensor in tensors.items():
            # the vocabulary's padding rows (400..511) are ours only: the trained head's are not zero any more
            rows = slice(None, 400) if tensor.shape[0] == 512 else slice(None)
            assert torch.equal(tensor[rows], converted[file][key][rows]), (file, key)
