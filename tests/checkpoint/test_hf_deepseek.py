"""transformers' DeepseekV3ForCausalLM both ways: a random tiny model (3 layers, the first dense, 8 routed experts in
2 groups of which each token may use 1, top-2 sigmoid routing with a random expert bias and a scaling factor, one
shared expert, multi-head latent attention with and without a query latent) built here from its config (nothing
downloaded), imported at EP=1 and at EP=2 x TP=2, and exported again.

transformers is the independent reference: its logits within the fp32 tolerance of the model's depth (the MoE
layers' routing and experts and the latent attention counted: tests/helpers/hf.py's logits_tolerance), its greedy
text token for token, every one of its tensors (the expert biases among them) reproduced by import -> export.
"""

import os

import pytest
import torch
from safetensors.torch import load_file

from megatron.checkpoint.hf.deepseek import deepseek_state_dict_to_ours, model_config_from_deepseek
from megatron.checkpoint.hf.families import hf_architecture
from megatron.checkpoint.single_process import load_full_state_dict
from megatron.testing import run_distributed, tiny_argv
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

# The model above as training flags (what from_hf's record says; --load checks them).
DEEPSEEK_FLAGS = ["--normalization", "rmsnorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                  "--ffn-hidden-size", "96", "--layernorm-epsilon", "1e-6", "--qk-layernorm", "--num-experts", "8",
                  "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0,1,1]",
                  "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "2", "--moe-router-group-topk",
                  "1", "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
                  "--moe-router-bias-update-rate", "0.01", "--moe-shared-expert-intermediate-size", "32",
                  "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
                  "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"]
SCALE = 0.15  # weight perturbation, as the other HF tests': every tensor differs from its neighbours
SIZES = dict(vocab_size=400, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
             num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
             q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _random_hf_model(q_lora_rank):
    import transformers

    torch.manual_seed(7)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**dict(SIZES, q_lora_rank=q_lora_rank)))
    with torch.no_grad():
        for param in model.parameters():  # norms start at 1: perturb every tensor, so a misplaced one shows
            param.add_(SCALE * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a bias that changes some choices
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tiny_corpus):
    """{q_lora_rank: (model, its save_pretrained directory with our tiny tokenizer)}."""
    out = {}
    for q_lora_rank in (32, None):
        path = tmp_path_factory.mktemp(f"deepseek_q{q_lora_rank}") / "hf_in"
        model = _random_hf_model(q_lora_rank)
        save_with_tiny_tokenizer(model, path, tiny_corpus)
        out[q_lora_rank] = model, path
    return out


@pytest.mark.parametrize("q_lora_rank,tp,ep", [(32, 1, 1), (32, 2, 2), (None, 1, 2)])
def test_import_gives_transformers_logits_and_export_gives_every_tensor_back(hf_dirs, tmp_path, q_lora_rank, tp, ep):
    model, hf_in = hf_dirs[q_lora_rank]
    import_hf(hf_in, tmp_path / "ckpt", tp=tp, ep=ep)
    experts = [f for f in os.listdir(tmp_path / "ckpt" / "global_step0") if f.startswith("expert_states")]
    assert len(experts) == (ep * tp if ep > 1 else 0), experts
    config, state, _ = load_full_state_dict(str(tmp_path / "ckpt"))
    assert hf_architecture(config) == "deepseek_v3"
    assert config.moe.layer_pattern == (False, True, True) and config.mla.q_lora_rank == q_lora_rank
    assert (config.moe.router_num_groups, config.moe.router_group_topk, config.moe.router_topk_scaling_factor) == \
        (2, 1, 2.5)
    bias = model.model.layers[2].mlp.gate.e_score_correction_bias
    assert torch.equal(state["layers.2.mlp.router.expert_bias"], bias) and bias.abs().max() > 0.05
    # fp32, another implementation (transformers' MLA, routing and experts): within the tolerance of the model's depth
    diff, tolerance = hf_logits_diff(model, config, state)
    assert diff <= tolerance, (diff, tolerance)

    before, changed, added = export_round_trip(tmp_path / "ckpt", hf_in, tmp_path / "hf_out")
    assert len(before) > 60 and changed == [] and added == [], (changed, added)


def test_greedy_text_from_an_ep2_tp2_import_is_transformers(hf_dirs, tmp_path):
    model, hf_in = hf_dirs[32]
    import_hf(hf_in, tmp_path / "ckpt", tp=2, ep=2)
    ours, expected = greedy_pair(model, hf_in, tmp_path / "ckpt", tmp_path / "out.json", PROMPTS, 8)
    assert ours == expected
    assert len({tuple(ids) for ids in expected}) == len(PROMPTS)  # the prompts do lead to different texts


def _with_mtp_layer(hf_state):
    """DeepSeek-V3's on-disk MTP layer (its layer 61; here 3, after the 3 decoder layers): a decoder layer's tensors
    (random, an MoE layer's as DeepSeek's), enorm, hnorm, eh_proj [h, 2h], shared_head.norm, and copies of the
    embedding and head (embed_tokens, shared_head.head)."""
    g = torch.Generator().manual_seed(11)
    out = dict(hf_state)
    for name, tensor in hf_state.items():
        if name.startswith("model.layers.2."):
            out["model.layers.3." + name[len("model.layers.2."):]] = tensor + 0.1 * torch.randn(tensor.shape, generator=g)
    for name, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("eh_proj.weight", (64, 128)),
                        ("shared_head.norm.weight", (64,))):
        out["model.layers.3." + name] = torch.randn(shape, generator=g)
    out["model.layers.3.embed_tokens.weight"] = hf_state["model.embed_tokens.weight"].clone()
    out["model.layers.3.shared_head.head.weight"] = hf_state["lm_head.weight"].clone()
    return out


def test_deepseek_mtp_layer_round_trips_from_the_checkpoint_layout(hf_dirs):
    """DeepSeek-V3's MTP layer (num_mtp_layers 1, transformers' config field) imports into our depth (the decoder
    layer with its experts and expert bias, the MTP norms and projection) and exports back to the same tensors."""
    import dataclasses

    from megatron.checkpoint.hf.deepseek import ours_to_deepseek_state_dict
    from megatron.model.layout import parameter_layout

    model, hf_in = hf_dirs[32]
    config = model_config_from_deepseek(model.config, seq_length=32, padded_vocab_size=400)
    assert config.mtp_num_layers == 1  # transformers' DeepseekV3Config says 1 by default, as DeepSeek-V3's does
    hf_state = _with_mtp_layer(load_file(str(hf_in / "model.safetensors")))
    ours = deepseek_state_dict_to_ours(hf_state, config)
    assert set(parameter_layout(config)) <= set(ours)
    assert torch.equal(ours["mtp.layers.0.eh_proj.weight"], hf_state["model.layers.3.eh_proj.weight"])
    assert torch.equal(ours["mtp.layers.0.final_layernorm.weight"], hf_state["model.layers.3.shared_head.norm.weight"])
    assert torch.equal(ours["mtp.layers.0.transformer_layer.mlp.router.expert_bias"],
                       hf_state["model.layers.3.mlp.gate.e_score_correction_bias"])
    assert not any(name.startswith("layers.3.") for name in ours)
    back = ours_to_deepseek_state_dict(ours, config)
    assert sorted(back) == sorted(hf_state)
    changed = [name for name in hf_state if not torch.equal(back[name], hf_state[name])]
    assert changed == []
    # a copy of the embedding that is not the model's is refused: our depths share it
    bad = dict(hf_state, **{"model.layers.3.embed_tokens.weight": hf_state["model.embed_tokens.weight"] + 1})
    with pytest.raises(ValueError, match="embed_tokens.weight differs from model.embed_tokens.weight"):
        deepseek_state_dict_to_ours(bad, config)
    # a config announcing the layer without it in the checkpoint imports without MTP, saying so
    from megatron.checkpoint.hf.deepseek import fit_config

    plain = load_file(str(hf_in / "model.safetensors"))
    with pytest.warns(UserWarning, match="announces 1 multi-token-prediction layer"):
        assert fit_config(config, plain) == dataclasses.replace(config, mtp_num_layers=0)


def test_unmapped_routing_is_refused(hf_dirs):
    import transformers

    for change, message in ((dict(num_experts_per_tok=4, topk_group=1), "num_experts_per_tok 4 / topk_group 1 != 2"),
                            (dict(norm_topk_prob=False), "norm_topk_prob False with num_experts_per_tok 2"),
                            (dict(rope_interleave=False), "rope_interleave False")):
        with pytest.raises(ValueError, match=message):
            model_config_from_deepseek(transformers.DeepseekV3Config(**dict(SIZES, **change)), seq_length=32)


@pytest.mark.multiprocess
def test_training_from_the_import_at_ep2_equals_tp2_and_moves_the_expert_bias(hf_dirs, tmp_path, tiny_corpus):
    """Two runs on 2 ranks (one launch), from the import at EP=2 (x DP 2) and at TP=2: the same losses (MLA's
    tensor parallelism and the experts where training expects them); the trained checkpoint's export carries the
    expert bias training moved."""
    _, hf_in = hf_dirs[32]
    runs = []
    for tp, ep in ((1, 2), (2, 1)):
        import_hf(hf_in, tmp_path / f"import_tp{tp}_ep{ep}", tp=tp, ep=ep)
        runs.append(tiny_argv(tiny_corpus, *DEEPSEEK_FLAGS, num_layers=3, position_embedding_type="rotary",
                              embed_layernorm=False, train_iters=3, lr_warmup_iters=1, lr=1e-3,
                              load=str(tmp_path / f"import_tp{tp}_ep{ep}"), finetune=True,
                              tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                              save=str(tmp_path / f"trained_tp{tp}"), save_interval=3))
    ep2, tp2 = run_distributed(train_moe, world_size=2, args=(runs,), env={"OMP_NUM_THREADS": "1"}, timeout=300)[0]
    assert ep2["iterations"] == tp2["iterations"] == [1, 2, 3]
    # TP=2 splits the attention's and the MLPs' products over the ranks, EP=2 the experts' tokens: two fp32 runs of a
    # model as deep as run_layers' dense ones (MLA and the MoE layers' routing counted), within run_tolerance.
    config = model_config_from_deepseek(hf_dirs[32][0].config, seq_length=32)
    assert_same_run(ep2, tp2, "TP=2 vs EP=2", num_layers=run_layers(config))
    before, changed, added = export_round_trip(tmp_path / "trained_tp2", hf_in, tmp_path / "hf_trained")
    assert added == [] and "model.layers.2.mlp.gate.e_score_correction_bias" in changed, changed
