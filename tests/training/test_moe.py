"""Mixture-of-experts training end to end: one process learns with the aux loss on and the expert bias moving;
expert parallelism (EP = 2, carved from DP) trains as one process does (fp32, within ``run_tolerance`` over 10
iterations), alone, with TP = 2, with PP = 2, with ZeRO-1, with all of EP x TP x PP x DP at once (8 processes), with
ZeRO-2 on the model engine, and in bf16 (BF16_Optimizer) close to it; bad layouts and what MoE does not
support yet are refused before any process starts."""

import os
import re

import pytest
import torch

from megatron.arguments import run_config_from_argv
from megatron.checkpoint.resume import resume_point
from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import run_tolerance
from tests.helpers.moe import MOE_FLAGS, VARIANT_FLAGS, assert_same_moe_run, train_moe
from tests.helpers.training import MANY_LAYOUTS, TINY_WIDTH, assert_same_run, layout, tensorboard_scalars, to_universal

pytestmark = MANY_LAYOUTS

ITERS = 10
# --recompute-modules inside the MoE layer, one by one (moe: the whole layer, its exchanges run again in backward)
RECOMPUTE_PARTS = ("--recompute-granularity", "selective", "--recompute-modules", "moe_act", "shared_experts",
                   "layernorm", "mlp")


@pytest.fixture(scope="module")
def moe_argv(tiny_corpus):
    return tiny_argv(tiny_corpus, *MOE_FLAGS, train_iters=ITERS, hidden_size=32, seq_length=16, lr=3e-3)


@pytest.fixture(scope="module")
def tensorboard_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_tensorboard")
    return {name: str(root / name) for name in ("plain", "variant", "ep2")}


@pytest.fixture(scope="module")
def reference_runs(moe_argv, tensorboard_dirs):
    """One process: the plain MoE run, the variant, the plain run with recomputed activations (one launch); the
    first two write tensorboard events."""
    tensorboard = lambda name: ["--tensorboard-dir", tensorboard_dirs[name]]  # noqa: E731
    runs = [moe_argv + tensorboard("plain"), moe_argv + VARIANT_FLAGS + tensorboard("variant"),
            moe_argv + ["--checkpoint-activations"], moe_argv + VARIANT_FLAGS + list(RECOMPUTE_PARTS)]
    return run_distributed(train_moe, world_size=1, args=(runs,))[0]


@pytest.fixture(scope="module")
def reference_run(reference_runs):
    return reference_runs[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("moe_checkpoints")


# The 4-process launch's runs, in order: the COMPOSED layouts', then each RESUMED layout's three (straight, 3 + save,
# resumed), then the save the universal checkpoint is converted from.
COMPOSED = 5
RESUMED = ("tp2", "bf16", "pp2")


@pytest.fixture(scope="module")
def four_process_runs(moe_argv, checkpoints):
    """One 4-process launch: the layouts EP = 2 composes with (test_expert_parallel_composes_with_tp_pp_zero1_and_bf16),
    each resumed layout straight, 3 + save and 3 resumed (test_expert_parallel_checkpoints_resume_loss_for_loss),
    and the run saved for the universal checkpoint (test_a_universal_checkpoint_moves_an_moe_run_between_layouts)."""
    ep = ["--expert-model-parallel-size", 2]
    runs = [layout(moe_argv, *ep, tp=2), layout(moe_argv, *ep, pp=2), layout(moe_argv, *ep, "--zero-stage", 1),
            layout(moe_argv, *ep, "--bf16"), layout(moe_argv, *ep, "--bf16", tp=2)]
    assert len(runs) == COMPOSED
    for name, flags in zip(RESUMED, (["--expert-model-parallel-size", 2, "--tensor-model-parallel-size", 2],
                                     ["--expert-model-parallel-size", 2, "--bf16"],
                                     ["--pipeline-model-parallel-size", 2])):
        argv = layout(moe_argv, *flags, "--train-iters", 6)
        save = ["--save", str(checkpoints / name), "--save-interval", "100"]
        runs += [argv, argv + save + ["--exit-interval", "3"], argv + save + ["--load", str(checkpoints / name)]]
    runs.append(layout(moe_argv, "--expert-model-parallel-size", 2, "--zero-stage", 1, "--save",
                       checkpoints / "universal", "--save-interval", 100, "--exit-interval", 3, tp=2))
    return run_distributed(train_moe, world_size=4, args=(runs,), timeout=900)


def test_one_process_learns_and_moves_the_expert_bias(reference_run):
    losses = reference_run["losses"]
    assert len(losses) == ITERS and losses[-1] < losses[0] - 0.05, losses
    biases = reference_run["expert_bias"]
    assert sorted(biases) == ["3.mlp", "4.mlp"], biases  # both layers are MoE (pipeline items 3 and 4)
    assert any(abs(b) > 0 for bias in biases.values() for b in bias), biases
    # every bias entry is a whole number of updates of 0.01, at most one per iteration
    for bias in biases.values():
        assert all(abs(round(b / 0.01) * 0.01 - b) < 1e-6 and abs(b) <= ITERS * 0.01 + 1e-6 for b in bias), bias


def test_recomputed_activations_train_the_same(reference_runs):
    """The recomputed forward routes as the first did; it counts the choices twice, which leaves the sign of each
    expert's deviation from the mean load, hence the bias, unchanged."""
    reference, variant, recomputed, parts = reference_runs
    assert_same_run(reference, recomputed, "--checkpoint-activations")
    assert recomputed["expert_bias"] == reference["expert_bias"]
    # --recompute-modules moe_act shared_experts layernorm mlp: the same computations, rebuilt in backward
    assert_same_moe_run(variant, parts, "--recompute-modules moe_act shared_experts layernorm mlp")


@pytest.mark.parametrize("flags,world_size,match", [
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2,
     "--num-experts 3 is not divisible by --expert-model-parallel-size 2"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"], 2,
     "--expert-model-parallel-size 4 does not divide the data-parallel size 2"),
    (["--num-experts", "4", "--moe-router-topk", "5"], 1, "--moe-router-topk 5 is larger than --num-experts 4"),
    (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 needs experts"),
    (["--num-experts", "4", "--mlp-type", "residual"], 1, "--moe-shared-expert-intermediate-size"),
    (["--num-experts", "1", "8"], 1, "per-layer expert counts"),
    (["--num-experts", "4", "--expert-interval", "2"], 1, "--expert-interval is not supported: choose the MoE layers "
                                                          "with --moe-layer-freq"),
    (["--num-experts", "4", "--disable-moe-token-dropping", "--moe-train-capacity-factor", "1"], 1,
     "--disable-moe-token-dropping contradicts --moe-expert-capacity-factor 1.0"),
    (["--num-experts", "4", "--moe-layer-freq", "[0]*3+[1]*1"], 1, "gives 4 layers but --num-layers is 2"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--zero-stage", "3"], 2,
     "with --expert-model-parallel-size 2 does not work with --zero-stage 3: DeepSpeed's ZeRO-3 takes expert-parallel "
     "layers only from its AutoEP"),
])
def test_bad_layouts_are_refused_before_launch(tiny_corpus, tmp_path, flags, world_size, match):
    flags = [flag.replace("{tmp}", str(tmp_path / "checkpoints")) for flag in flags]
    with pytest.raises(ValueError, match=re.escape(match)):
        run_config_from_argv(tiny_argv(tiny_corpus, *flags), world_size=world_size)


def test_megatron_deepspeed_spellings_map_onto_megatron_lm_flags(tiny_corpus):
    rc = run_config_from_argv(tiny_argv(tiny_corpus, "--num-experts", "4", "--moe-expert-parallel-size", "2", "--topk",
                                        "1", "--moe-loss-coeff", "0.1", "--moe-train-capacity-factor", "1.5",
                                        "--moe-layer-freq", "([0]*1+[1]*1)"), world_size=2)
    moe = rc.model.moe
    assert (moe.num_experts, moe.router_topk, moe.aux_loss_coeff, moe.expert_capacity_factor) == (4, 1, 0.1, 1.5)
    assert moe.layer_pattern == (False, True) and rc.parallel.expert_model_parallel_size == 2


@pytest.mark.multiprocess
def test_expert_parallel_trains_as_one_process(moe_argv, reference_runs, tensorboard_dirs):
    """EP = 2 over DP = 2: each rank holds 2 of the 4 experts, tokens go by all-to-all, expert gradients are
    averaged over the expert-data-parallel group (one rank here) and the grad norm sums both ranks' experts.
    Then the variant: SwiGLU experts, sigmoid group-limited routing, a shared expert, capacity dropping."""
    runs = [layout(moe_argv, "--expert-model-parallel-size", 2, "--tensorboard-dir", tensorboard_dirs["ep2"]),
            layout(moe_argv + VARIANT_FLAGS, "--expert-model-parallel-size", 2),
            layout(moe_argv + VARIANT_FLAGS, "--expert-model-parallel-size", 2, "--moe-layer-recompute")]
    results = run_distributed(train_moe, world_size=2, args=(runs,), timeout=600)
    reference, variant, *_ = reference_runs
    assert sorted(variant["expert_bias"]) == ["4.mlp"], "--moe-layer-freq [0,1]: layer 0 stays dense"
    for rank, (run, variant_run, recomputed) in enumerate(results):
        assert_same_moe_run(reference, run, f"rank {rank} of EP=2")
        assert_same_moe_run(variant, variant_run, f"rank {rank} of EP=2, variant")
        # --moe-layer-recompute (= --recompute-modules core_attn moe): the backward replays each MoE layer, its
        # all-to-alls included, and counts nothing twice (the expert bias moves as without recomputation)
        assert_same_moe_run(variant, recomputed, f"rank {rank} of EP=2, variant, MoE layers recomputed")
        assert run["expert_numel"] * 2 == reference["expert_numel"], f"rank {rank}"
    # the MoE statistics, summed over both data-parallel ranks, are the one process's
    one, ep2 = tensorboard_scalars(tensorboard_dirs["plain"]), tensorboard_scalars(tensorboard_dirs["ep2"])
    moe_tags = sorted(tag for tag in one if tag.startswith("moe/"))
    assert moe_tags == sorted(tag for tag in ep2 if tag.startswith("moe/")) and len(moe_tags) == 5, moe_tags
    for tag in moe_tags:  # sums over both ranks of what one process sums at once: run_tolerance
        for (step, a), (ep2_step, b) in zip(one[tag], ep2[tag], strict=True):
            rel = run_tolerance(torch.float32, 2, TINY_WIDTH, step)
            assert step == ep2_step and abs(a - b) <= rel * abs(a), f"{tag} at {step}: EP=2 {b} vs {a}"


def test_moe_statistics_reach_tensorboard_per_iteration(reference_runs, tensorboard_dirs):
    """Per iteration: each MoE layer's load (busiest expert over the mean), the aux and z losses per micro-batch
    (summed over layers) and the dropped fraction; the variant's first layer is dense and it drops for capacity."""
    plain, variant = tensorboard_scalars(tensorboard_dirs["plain"]), tensorboard_scalars(tensorboard_dirs["variant"])
    layers = ["moe/layer0/load-max-over-mean", "moe/layer1/load-max-over-mean"]
    assert sorted(t for t in plain if t.startswith("moe/")) == sorted(
        layers + ["moe/aux-loss", "moe/z-loss", "moe/dropped-fraction"]), sorted(plain)
    assert sorted(t for t in variant if t.startswith("moe/layer")) == layers[1:], sorted(variant)
    for tag in ["moe/aux-loss", "moe/z-loss", "moe/dropped-fraction"] + layers:
        assert [step for step, _ in plain[tag]] == list(range(1, ITERS + 1)), tag
    for tag in layers:  # 4 experts: between perfectly balanced (1) and all on one expert (4)
        assert all(1.0 <= v <= 4.0 for _, v in plain[tag]) and any(v > 1.0 for _, v in plain[tag]), plain[tag]
    assert all(v == 0.0 for _, v in plain["moe/dropped-fraction"])  # dropless
    assert all(v > 0 for _, v in plain["moe/aux-loss"] + plain["moe/z-loss"])
    # capacity factor 1: an expert keeps at most its even share of each micro-batch (T * k / E = 16 choices), so a
    # load above the mean over the iteration means some micro-batch dropped choices
    pairs = list(zip(variant["moe/layer1/load-max-over-mean"], variant["moe/dropped-fraction"], strict=True))
    assert all(0 <= dropped < 1 and (load == 1.0 or dropped > 0) for (_, load), (_, dropped) in pairs), pairs
    assert any(dropped > 0 for _, (_, dropped) in pairs), pairs


@pytest.mark.multiprocess
def test_expert_parallel_composes_with_tp_pp_zero1_and_bf16(four_process_runs, reference_run):
    """One 4-process launch: EP = 2 x TP = 2 (DP = 2), EP = 2 x PP = 2 (DP = 2), EP = 2 with ZeRO-1 over DP = 4
    (fp32: DeepSpeedZeroOptimizer), the BLOOM path (bf16, BF16_Optimizer) at EP = 2 x TP = 2 (its grad norm), and
    at EP = 2 over DP = 4, whose fp32
    master weights are sharded over DP = 4 for the dense parameters and over the expert-data-parallel group
    (2 ranks) for the experts."""
    results = [records[:COMPOSED] for records in four_process_runs]
    # BF16_Optimizer at EP = 2 x TP = 2: the experts' grad norm summed over TP, each expert's output bias (the same
    # on both TP ranks) counted once (deepspeed_compat.count_expert_grads_once). Before that, the TP ranks
    # disagreed on the norm (by ~1e-6 relative; their bias gradients differ in bf16's last bits).
    bf16_tp_norms = [run[4]["grad_norms"] for run in results]
    assert all(norms == bf16_tp_norms[0] for norms in bf16_tp_norms), bf16_tp_norms
    assert_same_run(reference_run, results[0][4], "bf16 EP=2 x TP=2 vs fp32 one process", dtype=torch.bfloat16)
    for rank, (tp_run, pp_run, zero_run, bf16_run, _) in enumerate(results):
        assert_same_moe_run(reference_run, tp_run, f"rank {rank} of EP=2 x TP=2")
        assert_same_moe_run(reference_run, pp_run, f"rank {rank} of EP=2 x PP=2")
        assert_same_moe_run(reference_run, zero_run, f"rank {rank} of EP=2, ZeRO-1, DP=4")
        assert tp_run["expert_numel"] < reference_run["expert_numel"] / 2, f"rank {rank}: TP splits the experts too"
        assert zero_run["optimizer"] == "DeepSpeedZeroOptimizer" and bf16_run["optimizer"] == "BF16_Optimizer"
        assert [name for name, _ in bf16_run["groups"]] == ["decay", "no_decay"] + ["megatron_ep_size_2"] * 2
        experts, dense = bf16_run["expert_numel"], bf16_run["held_numel"] - bf16_run["expert_numel"]
        assert experts * 2 == reference_run["expert_numel"], f"rank {rank}"
        # each rank's fp32 masters: a quarter of the dense parameters, half of its experts (up to alignment padding)
        assert abs(bf16_run["master_numel"] - (dense / 4 + experts / 2)) <= 16, f"rank {rank}: {bf16_run['master_numel']}"
        assert_same_run(reference_run, bf16_run, f"rank {rank}: bf16 EP=2 vs fp32 one process", dtype=torch.bfloat16)


@pytest.mark.multiprocess
def test_expert_parallel_checkpoints_resume_loss_for_loss(moe_argv, four_process_runs, checkpoints):
    """One 4-process launch, each layout trained 6 iterations straight, then 3 + save and 3 more resumed:
    EP = 2 x TP = 2 without ZeRO (the experts' Adam state in the expert files), EP = 2 over DP = 4 in bf16
    (BF16_Optimizer: the experts' fp32 master and optimizer shards in DeepSpeed's per-rank files), and EP = 1 x
    PP = 2 (DeepSpeed's files only). The resumed losses and grad norms are the straight ones bit for bit, and so
    are the expert biases (router buffers, outside the gradient). A resume at another EP size is refused by
    name. (The runs: ``four_process_runs``.)"""
    results = [records[COMPOSED:COMPOSED + 3 * len(RESUMED)] for records in four_process_runs]
    for rank, records in enumerate(results):
        for i, name in enumerate(("EP=2 x TP=2", "EP=2 bf16", "EP=1 x PP=2")):
            straight, first, resumed = records[3 * i: 3 * i + 3]
            assert first["iterations"] == [1, 2, 3] and resumed["iterations"] == [4, 5, 6], f"rank {rank}, {name}"
            assert first["losses"] + resumed["losses"] == straight["losses"], f"rank {rank}, {name}"
            assert resumed["grad_norms"] == straight["grad_norms"][3:], f"rank {rank}, {name}"
            assert resumed["expert_bias"] == straight["expert_bias"], f"rank {rank}, {name}"
    other_ep = run_config_from_argv(layout(moe_argv, "--tensor-model-parallel-size", 2, "--load", checkpoints / "tp2"),
                                    world_size=4)
    with pytest.raises(ValueError, match=re.escape("saved with --expert-model-parallel-size 2 (this run: 1)")):
        resume_point(other_ep)


@pytest.mark.multiprocess
def test_expert_parallel_composes_with_every_axis_and_zero2(moe_argv, reference_run):
    """One 8-process launch: EP = 2 x TP = 2 x PP = 2 x DP = 2 in fp32 (dropless, aux loss on, expert bias moving)
    trains as one process; the BLOOM path (bf16, BF16_Optimizer) on the same layout tracks it; and ZeRO-2 on the
    model engine at EP = 2 x TP = 2 over DP = 4 (DeepSpeedZeroOptimizer reduce-scattering each expert's
    gradient over its 2-rank expert-data-parallel group) trains as one process too."""
    ep = ["--expert-model-parallel-size", 2]
    runs = [layout(moe_argv, *ep, tp=2, pp=2), layout(moe_argv, *ep, "--bf16", tp=2, pp=2),
            layout(moe_argv, *ep, "--zero-stage", 2, tp=2)]
    results = run_distributed(train_moe, world_size=8, args=(runs,), timeout=600)
    for rank, (full, bf16, zero2) in enumerate(results):
        assert full["dp_size"] == 2 and full["optimizer"] != "BF16_Optimizer", f"rank {rank}: {full['optimizer']}"
        assert_same_moe_run(reference_run, full, f"rank {rank} of EP=2 x TP=2 x PP=2 x DP=2")
        assert len(full["expert_bias"]) == 1, f"rank {rank}: one MoE layer per stage, {full['expert_bias']}"
        assert bf16["optimizer"] == "BF16_Optimizer", f"rank {rank}"
        assert_same_run(reference_run, bf16, f"rank {rank}: bf16 EP=2 x TP=2 x PP=2 vs fp32", dtype=torch.bfloat16)
        assert (zero2["engine"], zero2["engine_stage"], zero2["optimizer"]) == (
            "ModelEngine", 2, "DeepSpeedZeroOptimizer"), f"rank {rank}"
        assert [name for name, _ in zero2["groups"]] == ["decay", "no_decay"] + ["megatron_ep_size_2"] * 2
        assert_same_moe_run(reference_run, zero2, f"rank {rank} of ZeRO-2, EP=2 x TP=2 x DP=4")
        assert sorted(zero2["expert_bias"]) == ["3.mlp", "4.mlp"], f"rank {rank}"
        assert zero2["expert_numel"] < reference_run["expert_numel"] / 2, f"rank {rank}: half the experts, TP-split"


@pytest.mark.multiprocess
def test_a_universal_checkpoint_moves_an_moe_run_between_layouts(moe_argv, reference_run, four_process_runs,
                                                                 checkpoints):
    """Saved after 3 iterations at EP = 2 x TP = 2 (DP = 2, fp32 ZeRO-1), converted by ds_to_universal.py (each
    expert parameter's folder then holds all 4 experts: the EP ranks' shards joined, the TP slices of each
    joined along the parameter's own split dim; the routers' expert biases beside them), and resumed in one
    2-process launch at EP = 1 x TP = 2, EP = 1 x PP = 2 and EP = 2 x DP = 2: each continues the one-process run
    within ``run_tolerance`` to iteration 10, and ends with its expert biases. (The save: ``four_process_runs``'
    last run.)"""
    save = str(checkpoints / "universal")
    assert all(records[-1]["iterations"] == [1, 2, 3] for records in four_process_runs)
    universal = to_universal(os.path.join(save, "global_step3"))
    assert sorted(n for n in os.listdir(os.path.join(universal, "zero")) if ".experts." in n) == [
        f"{layer}.mlp.experts.{p}" for layer in (3, 4) for p in ("fc1_bias", "fc2_bias", "w1", "w2")]
    load = ["--zero-stage", 1, "--load", save, "--universal-checkpoint"]
    runs = [layout(moe_argv, *load, tp=2), layout(moe_argv, *load, pp=2),
            layout(moe_argv, *load, "--expert-model-parallel-size", 2)]
    results = run_distributed(train_moe, world_size=2, args=(runs,), timeout=600)
    tail = dict(reference_run, losses=reference_run["losses"][3:], grad_norms=reference_run["grad_norms"][3:])
    for rank, records in enumerate(results):
        for name, run in zip(("EP=1 x TP=2", "EP=1 x PP=2", "EP=2 x DP=2"), records, strict=True):
            assert run["iterations"] == list(range(4, ITERS + 1)), f"rank {rank}, {name}: {run['iterations']}"
            assert_same_moe_run(tail, run, f"rank {rank}, EP=2 x TP=2 -> universal -> {name}")
