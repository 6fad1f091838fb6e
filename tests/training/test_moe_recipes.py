"""Two 2026 MoE recipes, shrunk to 4 layers and trained with every axis their Megatron-LM launch scripts combine,
against one process (fp32, dropless, the aux loss on, the expert bias moving, 10 iterations, ``run_tolerance``):

- DeepSeek-V3's shape: multi-head latent attention, a dense first layer then MoE layers with a shared expert,
  sigmoid group-limited routing with the expert bias (8 experts in 4 groups: the top 2 experts of the best 2
  groups); at TP = 2 + sequence parallelism x PP = 2 interleaved (two
  virtual stages per rank) x EP = 2 (8 processes).
- Qwen3-MoE's shape: grouped-query attention with QK-norm, SwiGLU experts in every layer, softmax top-k routing
  with the k weights renormalised (its ``norm_topk_prob``: Megatron's default, not ``--moe-router-pre-softmax``);
  at TP = 2 + sequence parallelism x PP = 2 x EP = 2 (8 processes).

Each resumes loss for loss at its own layout, and moves through a universal checkpoint to one process (EP = 1, no
tensor or pipeline parallelism), continuing the one-process run within tolerance."""

import os

import pytest

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.moe import MOE_FLAGS, assert_same_moe_run, train_moe
from tests.helpers.training import assert_continues, layout, to_universal

ITERS, SAVED_AT, LAYERS = 10, 5, 4

DEEPSEEK_V3 = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
               "--untie-embeddings-and-output-weights", "--qk-layernorm", "--multi-latent-attention",
               "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
               "--v-head-dim", "12", "--moe-layer-freq", "[0,1,1,1]", "--moe-shared-expert-intermediate-size", "32",
               "--num-experts", "8", "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "4",
               "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.0"]  # top-2 of the 2 best groups' 4
QWEN3_MOE = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
             "--untie-embeddings-and-output-weights", "--qk-layernorm", "--num-key-value-heads", "2",
             "--ffn-hidden-size", "96"]  # softmax top-k renormalised over the k (norm_topk_prob; no pre-softmax)
RECIPES = {
    "DeepSeek-V3": (DEEPSEEK_V3, ["--sequence-parallel", "--num-virtual-stages-per-pipeline-rank", "2"]),
    "Qwen3-MoE": (QWEN3_MOE, ["--sequence-parallel"]),
}
PARALLEL = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--expert-model-parallel-size", "2", "--zero-stage", "1"]  # ZeRO-1: its partitions make the universal


@pytest.fixture(scope="module")
def recipes(tiny_corpus):
    return {name: tiny_argv(tiny_corpus, *MOE_FLAGS, *flags, train_iters=ITERS, num_layers=LAYERS, hidden_size=32,
                            seq_length=16, lr=3e-3, embed_layernorm=False)
            for name, (flags, _) in RECIPES.items()}


@pytest.fixture(scope="module")
def references(recipes):
    records = run_distributed(train_moe, world_size=1, args=(list(recipes.values()),), timeout=600)[0]
    return dict(zip(recipes, records, strict=True))


@pytest.mark.multiprocess
def test_moe_recipes_train_resume_and_move_as_one_process(recipes, references, tmp_path):
    runs = []
    for name, argv in recipes.items():
        parallel = layout(argv, *PARALLEL, *RECIPES[name][1])
        runs += [parallel, layout(parallel, "--save", tmp_path / name, "--save-interval", 100, "--exit-interval",
                                  SAVED_AT),  # saves at SAVED_AT as it ends
                 layout(parallel, "--load", tmp_path / name)]
    results = run_distributed(train_moe, world_size=8, args=(runs,), timeout=900)
    for i, name in enumerate(recipes):  # the biases moved (a layer's +-rate steps may cancel out over 10
        # iterations: DeepSeek-V3's first MoE layer ends at 0), and some stage of the 8 ranks holds each MoE layer
        assert any(any(bias) for bias in references[name]["expert_bias"].values()), name
        held = {layer for records in results for layer in records[3 * i]["expert_bias"]}
        assert held == set(references[name]["expert_bias"]), f"{name}: {sorted(held)}"
    for rank, records in enumerate(results):
        for i, name in enumerate(recipes):
            straight, first, resumed = records[3 * i: 3 * i + 3]
            assert_same_moe_run(references[name], straight, f"rank {rank}: {name}", num_layers=LAYERS)
            assert first["iterations"] == list(range(1, SAVED_AT + 1)), f"rank {rank}, {name}"
            assert resumed["iterations"] == list(range(SAVED_AT + 1, ITERS + 1)), f"rank {rank}, {name}"
            assert_continues(straight["losses"], first["losses"] + resumed["losses"], f"rank {rank}: {name} resumed")
            assert resumed["grad_norms"] == straight["grad_norms"][SAVED_AT:], f"rank {rank}, {name}"
            assert resumed["expert_bias"] == straight["expert_bias"], f"rank {rank}, {name}"
    # the checkpoint of iteration 5 -> universal -> one process (EP = 1, no TP, no pipeline)
    moved = []
    for name, argv in recipes.items():
        to_universal(os.path.join(tmp_path / name, f"global_step{SAVED_AT}"))
        moved.append(layout(argv, "--zero-stage", 1, "--load", tmp_path / name, "--universal-checkpoint"))
    for name, run in zip(recipes, run_distributed(train_moe, world_size=1, args=(moved,), timeout=600)[0],
                         strict=True):
        reference = references[name]
        tail = dict(reference, losses=reference["losses"][SAVED_AT:], grad_norms=reference["grad_norms"][SAVED_AT:])
        assert run["iterations"] == list(range(SAVED_AT + 1, ITERS + 1)), name
        assert_same_moe_run(tail, run, f"{name}: universal -> one process", num_layers=LAYERS)
