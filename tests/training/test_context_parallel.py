"""Context parallelism (--context-parallel-size, ring attention) trains as one process does.

fp32, no dropout, 10 iterations of pretrain_gpt's path: losses and grad norms within ``run_tolerance``
(megatron/testing/tolerance.py: two computations that sum in other orders) of a single process, for BLOOM
(ALiBi), a Llama-style model (rotary, GQA) and, at CP=2, a GPT-2-style one (learned absolute positions) with
--reset-position-ids and --eod-mask-loss. On the pipeline engine with ZeRO-1 (DeepSpeed's data axis then holds
the dp x cp ranks): CP=2, CP=4, CP=2 x PP=2, CP=2 x TP=2 (also with --sequence-parallel), CP=2 x DP=2 and
CP=2 x PP=2 x DP=2 (8 processes), CP=2 with selective recomputation (the ring recomputed in backward), also with
attention dropout (one process's mask); on
DeepSpeed's model engine: CP=2 under ZeRO-2 and ZeRO-3, and CP=2 x DP=2 under ZeRO-3 with hpZ groups of 2. A checkpoint
saved at CP=2 continues at CP=1 x DP=2 as a straight CP=1 x DP=2 run does (and CP=1 x DP=2 -> CP=2,
CP=2 x DP=2 -> CP=4), within the same tolerance, and converted to a universal checkpoint it resumes at CP=4 and
at CP=1 x DP=2 x PP=2, continuing the one-process run; bf16 (BF16_Optimizer) tracks fp32. One launch per world size
trains every layout of that size in turn. Layouts that cannot work yet are refused before launch, naming the fix.
"""

import os
from itertools import islice

import pytest
import torch

from megatron.arguments import run_config_from_argv
from megatron.config import ParallelConfig
from megatron.parallel.context_parallel import load_balanced_positions
from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import run_tolerance
from megatron.training.data_iterators import build_datasets, micro_batch_iterator
from tests.helpers.training import (
    MANY_LAYOUTS,
    TINY_LAYERS,
    TINY_WIDTH,
    assert_continues,
    assert_same_run,
    layout,
    to_universal,
    train,
)

pytestmark = MANY_LAYOUTS

ITERS = 10
LLAMA = ("--normalization", "rmsnorm", "--swiglu", "--num-attention-heads", "8", "--num-key-value-heads", "4",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96")
CP2, CP4 = ("--context-parallel-size", 2), ("--context-parallel-size", 4)


def _models(corpus):
    bloom = tiny_argv(corpus, train_iters=ITERS, zero_stage=1)
    llama = tiny_argv(corpus, *LLAMA, train_iters=ITERS, zero_stage=1, position_embedding_type="rope",
                      embed_layernorm=False)
    # learned positions restarting at each document, no loss on the eod inputs (Megatron's document flags)
    documents = tiny_argv(corpus, train_iters=ITERS, zero_stage=1, position_embedding_type="absolute",
                          embed_layernorm=False, reset_position_ids=True, eod_mask_loss=True)
    # attention dropout (Megatron's default 0.1): the ring draws the mask one process draws
    dropout = layout(llama, "--attention-dropout", 0.1)
    return {"bloom": bloom, "llama": llama, "documents": documents, "llama dropout": dropout}


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    models = _models(tiny_corpus)
    save, save_dp2, save_cp2dp2 = (str(tmp_path_factory.mktemp(name)) for name in ("cp2", "dp2", "cp2dp2"))
    half = ("--save-interval", 100, "--exit-interval", 5)
    references = dict(zip(models, run_distributed(train, world_size=1, timeout=300,
                                                  args=(list(models.values()),))[0]))
    bloom, llama = models["bloom"], models["llama"]
    two = {"bloom cp2": (layout(bloom, *CP2), "bloom"), "llama cp2": (layout(llama, *CP2), "llama"),
           "documents cp2": (layout(models["documents"], *CP2), "documents"),
           "bloom cp2 bf16": (layout(bloom, *CP2, "--bf16"), "bloom"),
           # saved at CP=2, resumed at CP=1 x DP=2: the same two ZeRO-1 shards, the same weights
           "first half": (layout(bloom, *CP2, "--save", save, *half), "bloom"),
           "resumed cp1 dp2": (layout(bloom, "--load", save), "bloom"),
           # and the other way: saved at CP=1 x DP=2, resumed at CP=2; the straight CP=1 x DP=2 run to compare with
           "bloom dp2": (layout(bloom), "bloom"),
           "first half dp2": (layout(bloom, "--save", save_dp2, *half), "bloom"),
           "resumed cp2": (layout(bloom, *CP2, "--load", save_dp2), "bloom"),
           # DeepSpeed's model engine: ZeRO-2 and ZeRO-3 shard over dp x cp
           "bloom cp2 zero2": (layout(bloom, *CP2, "--zero-stage", 2), "bloom"),
           "llama cp2 zero3": (layout(llama, *CP2, "--zero-stage", 3), "llama"),
           # the ring recomputed in backward (--recompute-granularity selective), with ALiBi's slopes
           "bloom cp2 selective": (layout(bloom, *CP2, "--recompute-granularity", "selective"), "bloom"),
           # dropout inside the ring, its mask drawn again when the ring is recomputed in backward
           "llama cp2 dropout selective": (layout(models["llama dropout"], *CP2, "--recompute-granularity",
                                                  "selective"), "llama dropout")}
    four = {"bloom cp2 pp2": (layout(bloom, *CP2, pp=2), "bloom"), "llama cp2 pp2": (layout(llama, *CP2, pp=2), "llama"),
            "bloom cp4": (layout(bloom, *CP4), "bloom"), "llama cp2 tp2": (layout(llama, *CP2, tp=2), "llama"),
            "bloom cp2 dp2": (layout(bloom, *CP2), "bloom"),
            # saved at CP=2 x DP=2, resumed at CP=4 (dp x cp = 4 ZeRO-1 shards either way)
            "first half cp2 dp2": (layout(bloom, *CP2, "--save", save_cp2dp2, *half), "bloom"),
            "resumed cp4": (layout(bloom, *CP4, "--load", save_cp2dp2), "bloom"),
            # Megatron's --sequence-parallel inside each TP group, on this rank's s / cp tokens
            "bloom cp2 tp2 megatron sp": (layout(bloom, *CP2, "--sequence-parallel", tp=2), "bloom"),
            # ZeRO-3 over dp x cp = 4 with hpZ's secondary weight shard within pairs of ranks (a CP pair)
            "llama cp2 dp2 zero3 hpz2": (layout(llama, *CP2, "--zero-stage", 3, "--zero-hpz-partition-size", 2),
                                         "llama")}
    # every axis at once on 8 processes (measured alone: about 10 s)
    eight = {"bloom cp2 pp2 dp2": (layout(bloom, *CP2, pp=2), "bloom")}
    # the CP=2 checkpoint of "first half", converted by ds_to_universal.py after the 2-process launch, resumed by
    # the 4-process one at CP=4 and at CP=1 x DP=2 (x PP=2)
    universal = {"universal cp4": (layout(bloom, *CP4, "--load", save, "--universal-checkpoint"), "bloom"),
                 "universal cp1 dp2 pp2": (layout(bloom, "--load", save, "--universal-checkpoint", pp=2), "bloom")}
    out = {}
    for world, layouts in ((2, two), (4, four), (8, eight)):
        if world == 4:
            to_universal(os.path.join(save, "global_step5"))  # and points latest_universal at it
            layouts = dict(layouts, **universal)
        results = run_distributed(train, world_size=world, args=([argv for argv, _ in layouts.values()],),
                                  timeout=600)
        for rank, per_rank in enumerate(results):
            for (label, (_, model)), result in zip(layouts.items(), per_rank):
                out.setdefault(label, {})[rank] = (model, result)
    return references, out


EXACT = ["bloom cp2", "llama cp2", "documents cp2", "bloom cp2 pp2", "llama cp2 pp2", "bloom cp4", "llama cp2 tp2",
         "bloom cp2 dp2", "bloom cp2 tp2 megatron sp", "bloom cp2 zero2", "llama cp2 zero3", "bloom cp2 pp2 dp2",
         "bloom cp2 selective", "llama cp2 dp2 zero3 hpz2", "llama cp2 dropout selective"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", EXACT)
def test_context_parallel_matches_single_process_in_fp32(runs, label):
    references, out = runs
    for rank, (model, result) in out[label].items():
        assert len(result["losses"]) == ITERS, (label, rank)
        assert_same_run(references[model], result, f"rank {rank}: {label}")


def test_each_rank_reads_its_tokens_document_positions_and_loss_mask(tiny_corpus):
    """What "documents cp2" trains on: many of the 80 samples of its 10 iterations start a document after their
    first token (30 on the tiny corpus), so the reset and the mask act on both ranks' tokens; and each CP rank's
    micro-batches hold the whole sample's per-document positions and loss mask at its load-balanced tokens."""
    rc = run_config_from_argv(layout(_models(tiny_corpus)["documents"], *CP2), world_size=2)
    dataset, count = build_datasets(rc).train, ITERS * rc.batch.global_batch_size // rc.batch.micro_batch_size

    def micro_batches(cp_rank, cp_size):  # the run's: one data-parallel rank (dp x cp = 2 reads as dp 1)
        return list(islice(micro_batch_iterator(dataset, rc, consumed_samples=0, dp_rank=0, dp_size=1, num_workers=0,
                                                cp_rank=cp_rank, cp_size=cp_size), count))

    wholes = micro_batches(0, 1)
    positions = torch.cat([whole[0][1] for whole in wholes])  # [samples, s]
    masks = torch.cat([whole[1][1] for whole in wholes])  # [samples, s]
    s = positions.shape[1]
    restarts = (positions != torch.arange(s)).any(dim=1)  # samples with a document start after token 0
    assert len(positions) == 80 and int(restarts.sum()) >= 20 and int((masks == 0).sum()) >= 20, \
        (len(positions), int(restarts.sum()), int((masks == 0).sum()))
    for cp_rank in (0, 1):
        mine = load_balanced_positions(s, 2, cp_rank)  # [s/2]
        assert (positions[:, mine] != mine).any() and (masks[:, mine] == 0).any(), cp_rank
        for whole, part in zip(wholes, micro_batches(cp_rank, 2), strict=True):
            (whole_ids, whole_positions), (whole_labels, whole_mask) = whole
            (input_ids, position_ids), (labels, loss_mask) = part
            assert torch.equal(position_ids, whole_positions[:, mine]), cp_rank
            assert torch.equal(loss_mask, whole_mask[:, mine]) and torch.equal(input_ids, whole_ids[:, mine])
            assert torch.equal(labels, whole_labels[:, mine]), cp_rank


@pytest.mark.multiprocess
def test_context_parallel_engine_and_optimizers(runs):
    """The pipeline engine, its data axis dp x cp (where DeepSpeed reduces gradients and shards ZeRO-1)."""
    _, out = runs
    expected = {"bloom cp2": (2, "DeepSpeedZeroOptimizer"), "bloom cp2 bf16": (2, "BF16_Optimizer"),
                "bloom cp2 pp2": (2, "DeepSpeedZeroOptimizer"), "bloom cp4": (4, "DeepSpeedZeroOptimizer"),
                "llama cp2 tp2": (2, "DeepSpeedZeroOptimizer"), "bloom cp2 dp2": (4, "DeepSpeedZeroOptimizer"),
                "bloom cp2 pp2 dp2": (4, "DeepSpeedZeroOptimizer")}
    for label, (dp_cp, optimizer) in expected.items():
        for rank, (_, result) in out[label].items():
            assert result["engine"] == "PipelineEngine", (label, rank, result["engine"])
            assert (result["dp_size"], result["optimizer"]) == (dp_cp, optimizer), (label, rank, result)
    for label, optimizer in {"bloom cp2 zero2": "DeepSpeedZeroOptimizer",
                             "llama cp2 zero3": "DeepSpeedZeroOptimizer_Stage3",
                             "llama cp2 dp2 zero3 hpz2": "DeepSpeedZeroOptimizer_Stage3"}.items():
        for rank, (_, result) in out[label].items():
            assert (result["engine"], result["optimizer"]) == ("ModelEngine", optimizer), (label, rank, result)
            hpz = [rank - rank % 2, rank - rank % 2 + 1] if "hpz2" in label else None  # hpZ's groups of 2 ranks
            assert result["hpz_ranks"] == hpz, (label, rank, result["hpz_ranks"])


@pytest.mark.multiprocess
def test_context_parallel_bf16_tracks_fp32(runs):
    references, out = runs
    for rank, (model, result) in out["bloom cp2 bf16"].items():
        assert_same_run(references[model], result, f"rank {rank}: bf16", dtype=torch.bfloat16)


@pytest.mark.multiprocess
def test_checkpoint_saved_at_cp2_continues_at_cp1(runs):
    """The weights are not sharded by CP: a CP=2 checkpoint of iteration 5 resumes at CP=1 x DP=2 (the ZeRO-1
    state is sharded over dp x cp = 2 ranks either way) and continues the straight CP=2 run's losses within
    ``run_tolerance``: the second half runs at another layout. Its first half is the straight run's, bit for bit."""
    _, out = runs
    for rank in (0, 1):
        first, resumed = out["first half"][rank][1], out["resumed cp1 dp2"][rank][1]
        straight = out["bloom cp2"][rank][1]
        assert first["iterations"] == [1, 2, 3, 4, 5] and resumed["iterations"] == [6, 7, 8, 9, 10], rank
        assert first["losses"] == straight["losses"][:5], rank
        assert_continues(straight["losses"], resumed["losses"], f"rank {rank}: CP=2 -> CP=1 x DP=2", dtype=torch.float32)


@pytest.mark.multiprocess
@pytest.mark.parametrize("saved,resumed,straight,world", [("first half", "resumed cp1 dp2", "bloom dp2", 2),
                                                         ("first half dp2", "resumed cp2", "bloom cp2", 2),
                                                         ("first half cp2 dp2", "resumed cp4", "bloom cp4", 4)])
def test_resume_across_cp_sizes_continues_the_straight_run(runs, saved, resumed, straight, world):
    """CP=2 -> CP=1 x DP=2, CP=1 x DP=2 -> CP=2 and CP=2 x DP=2 -> CP=4: the resumed run's losses and grad norms
    continue the straight run of the layout it resumes at (the checkpoint holds everything, whatever CP wrote
    it), within ``run_tolerance``: its first half ran at the other layout, which reduces in another order. Bit
    for bit where the orders happen to agree (AVX2 kernels); one loss of 6.125 differed by 4.8e-7 on an AVX-512
    machine (docs/parallelism.md)."""
    _, out = runs
    for rank in range(world):
        first, tail, whole = out[saved][rank][1], out[resumed][rank][1], out[straight][rank][1]
        assert first["iterations"] == [1, 2, 3, 4, 5] and tail["iterations"] == [6, 7, 8, 9, 10], rank
        assert_same_run({key: whole[key][5:] for key in ("losses", "grad_norms")}, tail,
                        f"rank {rank}: {resumed} vs {straight}")


@pytest.mark.multiprocess
def test_attention_dropout_is_what_the_runs_agree_on(runs):
    """The CP=2 run with --attention-dropout 0.1 equals one process's (test_context_parallel_matches_single_process_
    in_fp32); the run without dropout differs from it by more than 10 tolerances in its grad norms: the ring drew
    and applied one process's mask, not none. (Its first loss moves by only about 0.6 tolerances: at initialization
    the tiny model's attention is nearly uniform, so dropping 10% of it changes the mean little.)"""
    references, _ = runs
    dropped, plain = references["llama dropout"]["grad_norms"], references["llama"]["grad_norms"]
    apart = [abs(a - b) / (run_tolerance(torch.float32, TINY_LAYERS, TINY_WIDTH, it) * abs(a))
             for it, (a, b) in enumerate(zip(dropped, plain, strict=True), start=1)]
    assert max(apart) > 10, apart


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", ["universal cp4", "universal cp1 dp2 pp2"])
def test_universal_checkpoint_of_cp2_continues_the_one_process_run(runs, label):
    """The CP=2 run's iteration-5 checkpoint, converted by ds_to_universal.py (the ZeRO-1 state of its dp x cp = 2
    ranks merged per parameter), resumes at CP=4 and at CP=1 x DP=2 x PP=2 with --universal-checkpoint: iterations
    6-10's losses and grad norms within ``run_tolerance`` of the one-process run's."""
    references, out = runs
    tail = {key: references["bloom"][key][5:] for key in ("losses", "grad_norms")}
    for rank, (_, result) in out[label].items():
        assert result["iterations"] == [6, 7, 8, 9, 10], (label, rank)
        assert_same_run(tail, result, f"rank {rank}: {label} vs one process")


@pytest.mark.parametrize("flags,world,message", [
    (("--seq-length", 36, "--max-position-embeddings", 64), 4,
     r"--seq-length 36 is not divisible by 2 x --context-parallel-size 4 = 8"),
    (("--ds-sequence-parallel-size", 2), 8, "both split the sequence"),
])
def test_impossible_context_parallel_layouts_are_refused_before_launch(tiny_corpus, flags, world, message):
    argv = layout(tiny_argv(tiny_corpus, zero_stage=1), *CP4, *flags)
    with pytest.raises(ValueError, match=message):
        run_config_from_argv(argv, world_size=world)


def test_only_the_p2p_ring_is_implemented():
    with pytest.raises(ValueError, match=r"--cp-comm-type 'a2a\+p2p' is not implemented; use one of p2p"):
        ParallelConfig(context_parallel_size=2, cp_comm_type="a2a+p2p").validate()
