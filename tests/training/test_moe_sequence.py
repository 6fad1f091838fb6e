"""Mixture of experts with the axes that split the sequence, trained as one process does (fp32, dropless, aux and z
losses on, expert bias moving; 10 iterations within ``run_tolerance``, expert biases to 1e-6):

    context parallelism     CP = 2 x EP = 2 (DP = 2, ZeRO-1; bf16 close to it): each rank routes its s / cp tokens,
                            the aux and z losses are its parts of the micro-batch's, the expert-bias counts are
                            summed over dp x cp, the experts' gradients over the expert-data-parallel group that
                            now spans the CP ranks
    sequence parallelism    TP = 2 + --sequence-parallel x EP = 2: each TP rank routes its own s / tp tokens, the
                            all-to-all over EP, the rows gathered over TP for the TP-split experts and their
                            outputs reduce-scattered (Megatron-LM's order); also the variant without its capacity
                            (SwiGLU, shared expert, sigmoid group-limited routing): the capacity is per rank here;
                            and TP = 2 + SP x CP = 2 (EP = 1): each rank routes s / (tp x cp) tokens
    DeepSpeed-Ulysses       SP = 2 on DeepSpeed's model engine, at EP = 1 and at EP = 2 x DP = 2 (ZeRO-0 and ZeRO-2:
                            the experts' gradients summed over the SP ranks of their group, averaged over dp)

The all-gather dispatcher (--moe-token-dispatcher-type allgather; it gathers the TP ranks' tokens on entry) at TP = 2
+ SP x EP = 2 against the all-to-all one and one process, and at EP = 2 (DP = 4) with the variant's capacity
dropping.

DeepSeek-V2's sequence-wise balance loss (--moe-router-load-balancing-type seq_aux_loss) at CP = 2 x EP = 2: each rank's
part from the per-sequence choices summed over the CP ranks, against one process.

At CP = 2 and SP = 2 x EP = 2 the MoE statistics (load, aux and z losses per micro-batch, dropped fraction) are the
one process's too.

Each of the first two also resumes from a checkpoint saved at iteration 3 at its own layout, loss for loss, grad norm
for grad norm, bias for bias; the sequence-parallel one is converted to a universal checkpoint and continues at
EP = 1 x TP = 2 without sequence parallelism; a Ulysses 2 x EP = 2 run (model engine, ZeRO-1) saved at iteration 3
converts too and continues at EP = 2 x DP = 2 on the pipeline engine. (A universal checkpoint with CP is refused by its own row in
megatron/config/combinations.py.) One launch per world size.
"""

import os

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import run_tolerance
from tests.helpers.moe import (
    MOE_FLAGS,
    VARIANT_DROPLESS,
    VARIANT_FLAGS,
    assert_resumed_bit_for_bit,
    assert_same_moe_run,
    train_moe,
)
from tests.helpers.training import MANY_LAYOUTS, TINY_WIDTH, assert_same_run, layout, tensorboard_scalars, to_universal

pytestmark = MANY_LAYOUTS

ITERS = 10
EP2, CP2, SP2 = ("--expert-model-parallel-size", 2), ("--context-parallel-size", 2), ("--ds-sequence-parallel-size", 2)
SAVE_AT_3 = ("--save-interval", 100, "--exit-interval", 3)
SEQ_AUX = ["--moe-router-load-balancing-type", "seq_aux_loss"]  # with MOE_FLAGS' --moe-aux-loss-coeff 0.01
ALLGATHER = ("--moe-token-dispatcher-type", "allgather")


@pytest.fixture(scope="module")
def moe_argv(tiny_corpus):
    return tiny_argv(tiny_corpus, *MOE_FLAGS, train_iters=ITERS, hidden_size=32, seq_length=16, lr=3e-3)


@pytest.fixture(scope="module")
def runs(moe_argv, tmp_path_factory):
    """{label: [record per rank]}; the one-process references under "plain" and "variant"."""
    root = tmp_path_factory.mktemp("moe_sequence")
    save = {name: str(root / name) for name in ("cp", "sp", "ulysses")}
    board = {name: ["--tensorboard-dir", str(root / "tensorboard" / name)] for name in ("plain", "cp", "sp")}
    plain, variant, dropless, seq_aux = run_distributed(
        train_moe, world_size=1, timeout=300,
        args=([moe_argv + board["plain"], moe_argv + VARIANT_FLAGS, moe_argv + VARIANT_DROPLESS,
               moe_argv + SEQ_AUX],))[0]
    sp = ("--sequence-parallel", "--zero-stage", 1)  # ZeRO-1: its optimizer shards make the universal checkpoint
    four = {
        # ZeRO-1: the experts' optimizer state sharded over their expert-data-parallel group (the 2 CP ranks)
        "cp2 ep2": layout(moe_argv, *CP2, *EP2, "--zero-stage", 1, *board["cp"]),
        "cp2 ep2 first": layout(moe_argv, *CP2, *EP2, "--zero-stage", 1, "--save", save["cp"], *SAVE_AT_3),
        "cp2 ep2 resumed": layout(moe_argv, *CP2, *EP2, "--zero-stage", 1, "--load", save["cp"]),
        # BF16_Optimizer: the experts' fp32 masters sharded over the same 2-rank group
        "cp2 ep2 bf16": layout(moe_argv, *CP2, *EP2, "--bf16"),
        "cp2 ep2 seq_aux": layout(moe_argv + SEQ_AUX, *CP2, *EP2),
        "sp2 ep2": layout(moe_argv, *SP2, *EP2, *board["sp"]),
        # ZeRO-2: DeepSpeedZeroOptimizer reduce-scatters the experts' gradients over the SP ranks of their group
        "sp2 ep2 zero2": layout(moe_argv, *SP2, *EP2, "--zero-stage", 2),
        # DeepSpeed's model engine at ZeRO-1: the universal checkpoint's source (the ZeRO ranks are dp x sp)
        "sp2 ep2 first": layout(moe_argv, *SP2, *EP2, "--zero-stage", 1, "--save", save["ulysses"], *SAVE_AT_3),
        "tp2 sp ep2": layout(moe_argv, *sp, *EP2, tp=2),
        # both splits (EP = 1): each rank routes its s / (tp x cp) tokens, the losses' parts over the 4 ranks
        "tp2 sp cp2": layout(moe_argv, *sp, *CP2, tp=2),
        # dropless: each TP rank routes its own s / tp tokens, and a capacity would be per rank (Megatron-LM's)
        "tp2 sp ep2 variant": layout(moe_argv + VARIANT_DROPLESS, *sp, *EP2, tp=2),
        "tp2 sp ep2 first": layout(moe_argv, *sp, *EP2, "--save", save["sp"], *SAVE_AT_3, tp=2),
        "tp2 sp ep2 resumed": layout(moe_argv, *sp, *EP2, "--load", save["sp"], tp=2),
        # the all-gather dispatcher: beside the all-to-all one at the same layout, and with capacity dropping
        "tp2 sp ep2 allgather": layout(moe_argv, *sp, *EP2, *ALLGATHER, tp=2),
        "ep2 allgather variant": layout(moe_argv + VARIANT_FLAGS, *EP2, *ALLGATHER),
    }
    out = {"plain": [plain], "variant": [variant], "variant dropless": [dropless], "seq_aux": [seq_aux],
           "tensorboard": {name: flags[1] for name, flags in board.items()}}
    results = run_distributed(train_moe, world_size=4, args=(list(four.values()),), timeout=600)
    for i, label in enumerate(four):
        out[label] = [per_rank[i] for per_rank in results]
    to_universal(os.path.join(save["sp"], "global_step3"))
    to_universal(os.path.join(save["ulysses"], "global_step3"), None, "--target-engine", "pipeline")
    two = {
        "sp2": layout(moe_argv, *SP2),
        "universal tp2": layout(moe_argv, "--zero-stage", 1, "--load", save["sp"], "--universal-checkpoint", tp=2),
        "universal from ulysses": layout(moe_argv, "--zero-stage", 1, "--load", save["ulysses"],
                                         "--universal-checkpoint", *EP2),
    }
    results = run_distributed(train_moe, world_size=2, args=(list(two.values()),), timeout=600)
    for i, label in enumerate(two):
        out[label] = [per_rank[i] for per_rank in results]
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("label,reference", [("cp2 ep2", "plain"), ("tp2 sp ep2", "plain"), ("tp2 sp cp2", "plain"),
                                             ("tp2 sp ep2 variant", "variant dropless"), ("sp2", "plain"),
                                             ("sp2 ep2", "plain"), ("sp2 ep2 zero2", "plain"),
                                             ("cp2 ep2 seq_aux", "seq_aux"), ("tp2 sp ep2 allgather", "plain"),
                                             ("ep2 allgather variant", "variant")])
def test_moe_with_a_split_sequence_trains_as_one_process(runs, label, reference):
    ref = runs[reference][0]
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, ref["losses"]
    for rank, run in enumerate(runs[label]):
        assert_same_moe_run(ref, run, f"rank {rank} of {label}")
        assert sorted(run["expert_bias"]) == sorted(ref["expert_bias"]), f"rank {rank} of {label}"


@pytest.mark.multiprocess
def test_the_allgather_dispatcher_trains_as_the_alltoall_one(runs):
    """The same layout (TP = 2 + SP x EP = 2) with either dispatcher: the same outputs summed in another order."""
    for rank, (alltoall, allgather) in enumerate(zip(runs["tp2 sp ep2"], runs["tp2 sp ep2 allgather"])):
        assert_same_moe_run(alltoall, allgather, f"rank {rank}: allgather vs alltoall at TP=2 + SP x EP=2")


@pytest.mark.multiprocess
def test_the_sequence_wise_aux_loss_is_its_own_objective(runs):
    """The seq_aux_loss reference trains otherwise than the aux_loss one (the test above compares against it)."""
    assert runs["seq_aux"][0]["losses"][1:] != runs["plain"][0]["losses"][1:]
    assert runs["seq_aux"][0]["losses"][0] == runs["plain"][0]["losses"][0]  # the same start


@pytest.mark.multiprocess
def test_moe_with_context_parallelism_in_bf16_tracks_fp32(runs):
    for rank, run in enumerate(runs["cp2 ep2 bf16"]):
        assert run["optimizer"] == "BF16_Optimizer", f"rank {rank}"
        assert [name for name, _ in run["groups"]] == ["decay", "no_decay"] + ["megatron_ep_size_2"] * 2
        assert_same_run(runs["plain"][0], run, f"rank {rank}: bf16 CP=2 x EP=2 vs fp32 one process",
                        dtype=torch.bfloat16)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["cp", "sp"])
def test_moe_statistics_of_a_split_sequence_are_the_one_process_ones(runs, name):
    """Each sequence rank counts 1 / 2 of a forward and its parts of the aux and z losses: summed over the dp x seq
    ranks, every MoE statistic is the one process's (within run_tolerance: sums in other orders)."""
    one, split = (tensorboard_scalars(runs["tensorboard"][key]) for key in ("plain", name))
    tags = sorted(tag for tag in one if tag.startswith("moe/"))
    assert len(tags) == 5 and tags == sorted(tag for tag in split if tag.startswith("moe/")), tags
    for tag in tags:
        for (step, a), (split_step, b) in zip(one[tag], split[tag], strict=True):
            rel = run_tolerance(torch.float32, 2, TINY_WIDTH, step)
            assert step == split_step and abs(a - b) <= rel * abs(a), f"{tag} at {step}: {name} {b} vs {a}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["cp2 ep2", "tp2 sp ep2"])
def test_moe_with_a_split_sequence_resumes_loss_for_loss(runs, name):
    for rank, (straight, first, resumed) in enumerate(zip(runs[name], runs[f"{name} first"], runs[f"{name} resumed"])):
        assert_resumed_bit_for_bit(straight, first, resumed, f"rank {rank} of {name}", 3, ITERS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("label,source,target", [
    ("universal tp2", "TP=2 + SP x EP=2", "EP=1 x TP=2"),
    # the model engine's ZeRO files (ZeRO rank = data rank x 2 + Ulysses rank) and its router-bias buffers
    ("universal from ulysses", "Ulysses 2 x EP=2 (model engine)", "EP=2 x DP=2 (pipeline engine)")])
def test_a_sequence_parallel_moe_run_continues_from_a_universal_checkpoint(runs, label, source, target):
    """Saved at the source layout, converted by ds_to_universal.py, resumed at the target."""
    ref = runs["plain"][0]
    tail = dict(ref, losses=ref["losses"][3:], grad_norms=ref["grad_norms"][3:])
    for rank, run in enumerate(runs[label]):
        assert run["iterations"] == list(range(4, ITERS + 1)), f"rank {rank}: {run['iterations']}"
        assert_same_moe_run(tail, run, f"rank {rank}, {source} -> universal -> {target}")
