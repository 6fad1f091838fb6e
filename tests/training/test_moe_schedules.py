"""Mixture-of-experts layers under the other pipeline schedules, interleaved virtual stages (v = 2) and ZB-H1, each at
PP = 2 x EP = 2 (world 4), and under ZeRO-3 and hpZ (EP = 1), train as one process does; the fp32 ZB-H1 run with its
expert-parallel all-to-all overlapped (--overlap-moe-expert-parallel-comm: the tokens in two parts, one part's
exchange in flight while the other's experts compute, their weight gradients deferred by ZB-H1).

A 4-layer MoE model (every layer MoE: dropless, aux and z losses, the expert bias moving; fp32, 10 iterations, 4
micro-batches of 2): one process is the reference. One 4-process launch trains PP = 2 v = 2 x EP = 2 (ZeRO-1),
PP = 2 ZB-H1 x EP = 2 (fp32, no ZeRO: ZB-H1's fp32 rule) and the same ZB-H1 layout in bf16 (BF16_Optimizer), each
saving at iteration 5: their losses, grad norms and expert biases are the reference's within ``run_tolerance``
(the biases to 1e-6; bf16 within bf16's tolerance, losses and grad norms only). A second 4-process launch resumes
each fp32 layout from its own iteration-5 checkpoint (losses, grad norms and biases the straight run's bit for bit),
and moves the interleaved run (fp32 ZeRO-1) and the bf16 ZB-H1 run through a universal checkpoint to EP = 1 (the
same schedule, DP = 2), continuing the reference within tolerance. (A ZeRO-0 checkpoint has no optimizer partitions
for ds_to_universal.py: ZB-H1's universal move is the bf16 run's.) The first launch also trains ZeRO-3 at EP = 1 x
TP = 2 x DP = 2 and ZeRO-3 + hpZ 2 at DP = 4 recomputing activations, every parameter partitioned (no persistence
threshold): the one-process run within tolerance, expert biases included.
"""

import json
import os

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.moe import MOE_FLAGS, train_moe
from tests.helpers.training import assert_same_run, layout, to_universal

ITERS, HALF, LAYERS = 10, 5, 4
EP = ("--expert-model-parallel-size", 2)
VIRTUAL = ("--num-virtual-stages-per-pipeline-rank", 2, "--zero-stage", 1)
ZBH1 = ("--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics")
ZBH1_BF16 = ZBH1 + ("--bf16",)
OVERLAP = ("--overlap-moe-expert-parallel-comm",)  # the fp32 ZB-H1 run's all-to-all in flight beside the experts


@pytest.fixture(scope="module")
def moe_argv(tiny_corpus):
    return tiny_argv(tiny_corpus, *MOE_FLAGS, train_iters=ITERS, hidden_size=32, seq_length=16, lr=3e-3,
                     num_layers=LAYERS)


@pytest.fixture(scope="module")
def reference(moe_argv):
    return run_distributed(train_moe, world_size=1, args=([moe_argv],))[0][0]


@pytest.fixture(scope="module")
def runs(moe_argv, tmp_path_factory):
    """{rank: {name: record}}: the three layouts straight (saving at 5 and 10), then each fp32 one resumed from its
    iteration 5 and the interleaved and bf16 ZB-H1 ones through universal checkpoints at EP = 1."""
    root = tmp_path_factory.mktemp("moe_schedules")
    layouts = {"interleaved": VIRTUAL, "zbh1": ZBH1 + OVERLAP, "zbh1 bf16": ZBH1_BF16}
    saved = {name: str(root / name.replace(" ", "_")) for name in layouts}
    straight = {name: layout(moe_argv, *EP, *flags, "--save", saved[name], "--save-interval", HALF, pp=2)
                for name, flags in layouts.items()}
    # DeepSpeed keeps parameters under 1e5 elements gathered (stage3_param_persistence_threshold), all of this tiny
    # model's: 0 makes every parameter live in partitions only, as a large model's do
    no_persistence = root / "zero3.json"
    no_persistence.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    zero3 = ("--zero-stage", 3, "--deepspeed_config", no_persistence)
    straight |= {"zero3 tp2": layout(moe_argv, *zero3, tp=2),
                 "zero3 hpz2": layout(moe_argv, *zero3, "--zero-hpz-partition-size", 2, "--checkpoint-activations")}
    first = run_distributed(train_moe, world_size=4, args=(list(straight.values()),), timeout=900)
    for name, folder in saved.items():
        if name != "zbh1":  # ZeRO-0: no optimizer partitions to convert
            to_universal(os.path.join(folder, f"global_step{HALF}"))  # and points latest_universal at it
        with open(os.path.join(folder, "latest"), "w") as latest:  # the regular pointer back to iteration 5
            latest.write(f"global_step{HALF}")
    second = {
        "interleaved resumed": layout(moe_argv, *EP, *VIRTUAL, "--load", saved["interleaved"], pp=2),
        "zbh1 resumed": layout(moe_argv, *EP, *ZBH1, *OVERLAP, "--load", saved["zbh1"], pp=2),
        "interleaved universal ep1": layout(moe_argv, *VIRTUAL, "--load", saved["interleaved"],
                                            "--universal-checkpoint", pp=2),
        "zbh1 bf16 universal ep1": layout(moe_argv, *ZBH1_BF16, "--load", saved["zbh1 bf16"],
                                          "--universal-checkpoint", pp=2),
    }
    then = run_distributed(train_moe, world_size=4, args=(list(second.values()),), timeout=900)
    return {rank: dict(zip(straight, a)) | dict(zip(second, b)) for rank, (a, b) in enumerate(zip(first, then))}


def assert_same_moe_run(reference, run, label):
    """Losses and grad norms within ``run_tolerance`` of the reference's, and every expert bias this rank holds
    (its stage's layers) within 1e-6 (an update moves a bias by 0.01: a different one would be off by that)."""
    assert_same_run(reference, run, label, num_layers=LAYERS)
    assert run["expert_bias"] and set(run["expert_bias"]) <= set(reference["expert_bias"]), label
    for name, bias in run["expert_bias"].items():
        assert bias == pytest.approx(reference["expert_bias"][name], abs=1e-6), f"{label}: {name} bias"


def _tail(run):
    return dict(run, losses=run["losses"][HALF:], grad_norms=run["grad_norms"][HALF:])


def test_the_reference_learns_with_four_moe_layers(reference):
    assert reference["losses"][-1] < reference["losses"][0] - 0.05, reference["losses"]
    assert sorted(reference["expert_bias"]) == [f"{i}.mlp" for i in range(3, 3 + LAYERS)]
    assert any(abs(b) > 0 for bias in reference["expert_bias"].values() for b in bias)


@pytest.mark.multiprocess
def test_interleaved_and_zbh1_train_moe_as_one_process(reference, runs):
    for rank, results in runs.items():
        interleaved, zbh1, bf16 = results["interleaved"], results["zbh1"], results["zbh1 bf16"]
        assert interleaved["engine"] == "InterleavedPipelineEngine", (rank, interleaved["engine"])
        assert zbh1["engine"] == bf16["engine"] == "ZeroBubblePipelineEngine", (rank, zbh1["engine"])
        assert bf16["optimizer"] == "BF16_Optimizer", (rank, bf16["optimizer"])
        assert interleaved["expert_numel"] * 4 == reference["expert_numel"], rank  # half the layers, half the experts
        assert len(interleaved["expert_bias"]) == 2 and len(zbh1["expert_bias"]) == 2, rank  # its two layers
        assert_same_moe_run(reference, interleaved, f"rank {rank}: PP=2 v=2 x EP=2")
        assert_same_moe_run(reference, zbh1, f"rank {rank}: PP=2 ZB-H1 x EP=2, all-to-all overlapped")
        assert_same_run(reference, bf16, f"rank {rank}: bf16 PP=2 ZB-H1 x EP=2", dtype=torch.bfloat16,
                        num_layers=LAYERS)


@pytest.mark.multiprocess
def test_each_layout_resumes_its_own_checkpoint_loss_for_loss(runs):
    for rank, results in runs.items():
        for name in ("interleaved", "zbh1"):
            straight, resumed = results[name], results[f"{name} resumed"]
            assert resumed["iterations"] == list(range(HALF + 1, ITERS + 1)), (rank, name, resumed["iterations"])
            assert resumed["losses"] == straight["losses"][HALF:], (rank, name)
            assert resumed["grad_norms"] == straight["grad_norms"][HALF:], (rank, name)
            assert resumed["expert_bias"] == straight["expert_bias"], (rank, name)


@pytest.mark.multiprocess
def test_a_universal_checkpoint_moves_each_schedule_to_ep1(reference, runs):
    for rank, results in runs.items():
        interleaved, bf16 = results["interleaved universal ep1"], results["zbh1 bf16 universal ep1"]
        assert interleaved["engine"] == "InterleavedPipelineEngine" and bf16["engine"] == "ZeroBubblePipelineEngine"
        for run in (interleaved, bf16):
            assert run["iterations"] == list(range(HALF + 1, ITERS + 1)), (rank, run["iterations"])
            assert run["expert_numel"] * 2 == reference["expert_numel"], rank  # all 4 experts of its 2 layers
        assert_same_moe_run(_tail(reference), interleaved, f"rank {rank}: PP=2 v=2 x EP=2 -> universal -> EP=1")
        assert_same_run(_tail(reference), bf16, f"rank {rank}: bf16 ZB-H1 EP=2 -> universal -> EP=1",
                        dtype=torch.bfloat16, num_layers=LAYERS)


@pytest.mark.multiprocess
def test_zero3_and_hpz_train_moe_at_ep1_as_one_process(reference, runs):
    """EP = 1: the experts are plain parameters, partitioned by ZeRO-3 like any other (over DP = 2 at TP = 2, and
    over DP = 4 with hpZ's secondary copy within pairs of ranks, the layers recomputed in the backward); each MoE layer
is one ZeRO-3 leaf module."""
    for rank, results in runs.items():
        zero3, hpz = results["zero3 tp2"], results["zero3 hpz2"]
        for run in (zero3, hpz):
            assert (run["engine"], run["engine_stage"]) == ("ModelEngine", 3), (rank, run["engine"])
            assert run["held_numel"] == 0 and run["partition_numel"] < run["full_numel"], rank  # partitioned
        assert hpz["hpz_ranks"] == [rank - rank % 2, rank - rank % 2 + 1] and zero3["hpz_ranks"] is None, rank
        assert sorted(zero3["expert_bias"]) == sorted(reference["expert_bias"]), rank  # the whole model
        assert_same_moe_run(reference, zero3, f"rank {rank}: ZeRO-3, EP=1 x TP=2 x DP=2")
        assert_same_moe_run(reference, hpz, f"rank {rank}: ZeRO-3 + hpZ 2, EP=1 x DP=4")
