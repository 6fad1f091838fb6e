"""Multi-head latent attention (--multi-latent-attention, DeepSeek-V3's attention) trains as one process does.

fp32, no dropout, 10 iterations of pretrain_gpt's path on a 4-layer DeepSeek-shaped model (RMSNorm, SwiGLU, rotary,
query and key-value latents with their norms): losses and grad norms within ``run_tolerance``
(megatron/testing/tolerance.py) of a single process at TP=2 x PP=2, PP=2 x DP=2 with interleaved virtual stages
(v = 2: whole layers per chunk), PP=2 x DP=2 under ZB-H1 (the replicated down-projections defer their weight
gradients like the parallel linears), Megatron's sequence parallelism (TP=2 + SP over DP=2 and x PP=2: the
down-projections on each rank's s/tp tokens, the latents gathered before the up-projections) and context
parallelism (CP=2 x DP=2, CP=2 x TP=2 + SP: ring attention with value heads narrower than the query / key heads)
and DeepSpeed-Ulysses on the model engine (SP=4, SP=2 x TP=2 + Megatron SP, SP=2 x DP=2 under ZeRO-2: heads
exchanged by all-to-all, values with their own head size), and with --recompute-modules core_attn mla_up_proj
layernorm mlp at TP=2 + SP and under ZB-H1; bf16 (BF16_Optimizer) under ZB-H1 tracks fp32. The
TP=2 + SP x PP=2 ZeRO-1 checkpoint of iteration 3 resumes loss for loss at its layout and, converted to a universal
one, in one process. DeepSeek-V3's YaRN (its recipe's --rotary-scaling-factor, --mscale, --mscale-all-dim; here the
32 tokens are 4x the original context of 8) trains at CP=2 x TP=2 + SP as one process does: the load-balanced chunks'
global positions, the rotary's attention factor and the softmax scale in ring attention. One 4-process launch trains
every layout in turn. (MLA at TP=2 + SP x PP=2 interleaved, with MoE, is tests/training/test_moe_recipes.py's
DeepSeek-V3 shape.)
"""

import os

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import run_tolerance
from tests.helpers.training import MANY_LAYOUTS, TINY_WIDTH, assert_same_run, layout, to_universal, train

pytestmark = MANY_LAYOUTS

ITERS = 10
LAYERS = 4  # two chunks of one layer on each of 2 pipeline ranks under v = 2
MLA = ("--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
       "--qk-layernorm", "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim",
       "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12")
ZBH1 = ("--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics")
VIRTUAL = ("--num-virtual-stages-per-pipeline-rank", 2)
SP, CP2 = "--sequence-parallel", ("--context-parallel-size", 2)
ULYSSES2, ULYSSES4 = ("--ds-sequence-parallel-size", 2), ("--ds-sequence-parallel-size", 4)
# DeepSeek-V3's recipe flags (MLA's rope type is yarn by default), mscale != mscale_all_dim so that both the rotary's
# attention factor and the softmax scale are not 1; an original context of 8 positions, 4x extended; init std 0.2 so
# that the attention is not near-uniform (at 0.02 the positions barely move 10 iterations' losses: plain rotary's and
# YaRN's would be within the tolerance of each other, and the check could not see YaRN)
YARN = ("--rotary-scaling-factor", "4", "--mscale", "1.0", "--mscale-all-dim", "0.707",
        "--yarn-original-max-position-embeddings", "8", "--init-method-std", "0.2")
RECOMPUTE = ("--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mla_up_proj", "layernorm",
             "mlp")


@pytest.fixture(scope="module")
def mla_argv(tiny_corpus):
    return tiny_argv(tiny_corpus, *MLA, train_iters=ITERS, num_layers=LAYERS, position_embedding_type="rope",
                     embed_layernorm=False)


@pytest.fixture(scope="module")
def references(mla_argv):
    """(plain rotary, YaRN, plain rotary with YaRN's init): one process each, one launch."""
    plain_sharp = layout(mla_argv, *YARN[-2:])
    return tuple(run_distributed(train, world_size=1, args=([mla_argv, layout(mla_argv, *YARN), plain_sharp],),
                                 timeout=300)[0])


@pytest.fixture(scope="module")
def reference(references):
    return references[0]


@pytest.fixture(scope="module")
def runs(mla_argv, tmp_path_factory):
    """label -> the records of every rank, from one 4-process launch."""
    layouts = {
        "tp2 pp2": layout(mla_argv, tp=2, pp=2),
        "pp2 interleaved": layout(mla_argv, *VIRTUAL, pp=2),
        "pp2 zbh1": layout(mla_argv, *ZBH1, pp=2),
        "tp2 sp": layout(mla_argv, SP, tp=2),
        # ZeRO-1: its checkpoint also goes through a universal one below
        "tp2 sp pp2": layout(mla_argv, SP, "--zero-stage", 1, tp=2, pp=2),
        "cp2 dp2": layout(mla_argv, *CP2),
        "cp2 tp2 sp": layout(mla_argv, *CP2, SP, tp=2),
        "cp2 tp2 sp yarn": layout(mla_argv, *CP2, SP, *YARN, tp=2),
        "ulysses sp4": layout(mla_argv, *ULYSSES4),
        "ulysses sp2 tp2 sp": layout(mla_argv, *ULYSSES2, SP, tp=2),
        "ulysses sp2 dp2 zero2": layout(mla_argv, *ULYSSES2, "--zero-stage", 2),
        # BLOOM's path (bf16, BF16_Optimizer): ZB-H1's deferred products into the bf16 gradients
        "pp2 zbh1 bf16": layout(mla_argv, *ZBH1, "--bf16", pp=2),
        # --recompute-modules: the up-projections' outputs freed and rebuilt with their TP / SP collectives, the
        # norms' outputs too (ZB-H1: the deferred weight gradients read the rebuilt storages)
        "tp2 sp recompute": layout(mla_argv, SP, *RECOMPUTE, tp=2),
        "pp2 zbh1 recompute": layout(mla_argv, *ZBH1, *RECOMPUTE, pp=2),
    }
    # TP=2 + SP x PP=2 saved after 3 iterations, resumed to 10 (against the straight run above, bit for bit)
    saved = str(tmp_path_factory.mktemp("mla_sp"))
    layouts["sp first half"] = layout(layouts["tp2 sp pp2"], "--save", saved, "--save-interval", 100, "--exit-interval",
                                      3)
    layouts["sp resumed"] = layout(layouts["tp2 sp pp2"], "--load", saved)
    results = run_distributed(train, world_size=4, args=(list(layouts.values()),), timeout=900)
    out = {label: [per_rank[i] for per_rank in results] for i, label in enumerate(layouts)}
    to_universal(os.path.join(saved, "global_step3"))
    out["universal tp1"] = run_distributed(train, world_size=1, timeout=300, args=([layout(
        mla_argv, "--zero-stage", 1, "--load", saved, "--universal-checkpoint")],))
    return out


def test_one_process_learns(reference):
    losses = reference["losses"]
    assert len(losses) == ITERS and losses[-1] < losses[0] - 0.05, losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("label,engine", [
    ("tp2 pp2", "PipelineEngine"), ("pp2 interleaved", None), ("pp2 zbh1", "ZeroBubblePipelineEngine"),
    ("tp2 sp", "PipelineEngine"), ("tp2 sp pp2", "PipelineEngine"),
    ("cp2 dp2", "PipelineEngine"), ("cp2 tp2 sp", "PipelineEngine"),
    ("ulysses sp4", "ModelEngine"), ("ulysses sp2 tp2 sp", "ModelEngine"), ("ulysses sp2 dp2 zero2", "ModelEngine"),
    ("tp2 sp recompute", "PipelineEngine"), ("pp2 zbh1 recompute", "ZeroBubblePipelineEngine")])
def test_mla_trains_as_one_process(reference, runs, label, engine):
    for rank, result in enumerate(runs[label]):
        assert engine is None or result["engine"] == engine, (label, rank, result["engine"])
        assert_same_run(reference, result, f"rank {rank}: {label}", num_layers=LAYERS)
    if label.endswith(" sp") or " sp " in label:
        assert all(result["model_sp"] for result in runs[label]), label


@pytest.mark.multiprocess
def test_mla_with_deepseek_v3_yarn_trains_as_one_process_at_cp2_tp2_sp(references, runs):
    _, yarn, plain = references
    # YaRN changes the run (the comparison below sees it): the last loss and grad norm differ from plain rotary's
    # (the same init) by far more than the tolerance (measured: 150 and 240 times it)
    for key in ("losses", "grad_norms"):
        bound = run_tolerance(torch.float32, LAYERS, TINY_WIDTH, ITERS) * abs(plain[key][-1])
        assert abs(yarn[key][-1] - plain[key][-1]) > 10 * bound, (key, yarn[key], plain[key])
    for rank, result in enumerate(runs["cp2 tp2 sp yarn"]):
        assert_same_run(yarn, result, f"rank {rank}: cp2 tp2 sp yarn", num_layers=LAYERS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", ["pp2 zbh1 bf16"])
def test_mla_in_bf16_tracks_fp32(reference, runs, label):
    for rank, result in enumerate(runs[label]):
        assert result["optimizer"] == "BF16_Optimizer", (label, rank, result["optimizer"])
        assert_same_run(reference, result, f"rank {rank}: {label}", dtype=torch.bfloat16, num_layers=LAYERS)


@pytest.mark.multiprocess
def test_mla_with_sequence_parallelism_resumes_loss_for_loss(runs):
    """TP=2 + SP x PP=2: saved after 3 of 10 iterations and resumed, the losses and grad norms are the straight
    run's bit for bit (the same layout: the same operations)."""
    for rank in range(4):
        straight, first, resumed = (runs[label][rank] for label in ("tp2 sp pp2", "sp first half", "sp resumed"))
        assert first["iterations"] == [1, 2, 3] and resumed["iterations"] == list(range(4, ITERS + 1)), rank
        assert first["losses"] + resumed["losses"] == straight["losses"], rank
        assert resumed["grad_norms"] == straight["grad_norms"][3:], rank


@pytest.mark.multiprocess
def test_a_universal_checkpoint_moves_an_mla_run_from_tp2_sp_pp2_to_one_process(reference, runs):
    """Saved after 3 iterations at TP=2 + SP x PP=2 (ZeRO-1), converted by ds_to_universal.py (the column-parallel
    up-projections' TP slices joined, the replicated down-projections and latent norms kept once) and resumed by
    one process: iterations 4-10 continue the one-process run within ``run_tolerance``."""
    (resumed,) = runs["universal tp1"][0]
    assert resumed["iterations"] == list(range(4, ITERS + 1)), resumed["iterations"]
    tail = {key: reference[key][3:] for key in ("losses", "grad_norms")}
    assert_same_run(tail, resumed, "TP=2 + SP x PP=2 -> universal -> one process", num_layers=LAYERS)
