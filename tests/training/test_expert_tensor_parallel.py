"""--expert-tensor-parallel-size 1 under TP = 2 + --sequence-parallel (Qwen3-235B's layout in small): whole experts,
each TP rank routing its own s / tp tokens, expert parallelism folded over the stage's TP x DP ranks in Megatron-LM's
expert order (tp-ep-dp), trained as one process does (fp32, dropless, aux and z losses on, expert bias moving; 10
iterations within ``run_tolerance``, expert biases to 1e-6):

    EP = 4 over TP = 2 x DP = 2    every rank of the world holds one expert
    EP = 2 (ZeRO-1)                the EP groups are the TP pairs, the experts' gradients and optimizer shards go
                                   over the expert-data-parallel group (the two DP ranks of one TP rank)
    EP = 2 in bf16                 BF16_Optimizer, close to the fp32 reference (bf16's run_tolerance)
    EP = 2 x CP = 2, x Ulysses 2   the sequence split too (DP = 1): each rank routes its s / (tp x seq) tokens, the
                                   losses' parts and counts over the seq x TP ranks of the micro-batch

The EP = 2 run resumes from a checkpoint saved at iteration 3 at its own layout, loss for loss, grad norm for grad
norm, bias for bias, and its checkpoint converted to a universal one continues at EP = 1 on one process. One launch
per world size. The layout rules are refused before any process starts.
"""

import os
import re

import pytest
import torch

from megatron.arguments import run_config_from_argv
from megatron.checkpoint.resume import _check_same_layout
from megatron.checkpoint.single_process import load_full_state_dict
from megatron.parallel.state import group_layout
from megatron.testing import run_distributed, tiny_argv
from tests.helpers.moe import MOE_FLAGS, assert_resumed_bit_for_bit, assert_same_moe_run, train_moe
from tests.helpers.training import MANY_LAYOUTS, assert_same_run, layout, to_universal

pytestmark = MANY_LAYOUTS

ITERS = 10
ETP1 = ("--sequence-parallel", "--expert-tensor-parallel-size", 1)
SAVE_AT_3 = ("--save-interval", 100, "--exit-interval", 3)


@pytest.fixture(scope="module")
def moe_argv(tiny_corpus):
    return tiny_argv(tiny_corpus, *MOE_FLAGS, train_iters=ITERS, hidden_size=32, seq_length=16, lr=3e-3)


@pytest.fixture(scope="module")
def runs(moe_argv, tmp_path_factory):
    """{label: [record per rank]}; the one-process reference under "plain"."""
    save = str(tmp_path_factory.mktemp("etp") / "ep2")
    ep2 = (*ETP1, "--expert-model-parallel-size", 2, "--zero-stage", 1)  # ZeRO-1: the universal checkpoint's source
    four = {
        "etp1 ep4": layout(moe_argv, *ETP1, "--expert-model-parallel-size", 4, tp=2),
        # BF16_Optimizer: its grad norm over the experts, whole on every TP rank
        "etp1 ep2 bf16": layout(moe_argv, *ETP1, "--expert-model-parallel-size", 2, "--bf16", tp=2),
        "etp1 ep2": layout(moe_argv, *ep2, tp=2),
        "etp1 ep2 first": layout(moe_argv, *ep2, "--save", save, *SAVE_AT_3, tp=2),
        "etp1 ep2 resumed": layout(moe_argv, *ep2, "--load", save, tp=2),
        # the sequence split too: the aux and z losses' parts over the seq x TP ranks of a micro-batch
        "etp1 ep2 cp2": layout(moe_argv, *ETP1, "--expert-model-parallel-size", 2, "--context-parallel-size", 2,
                               tp=2),
        "etp1 ep2 ulysses2": layout(moe_argv, *ETP1, "--expert-model-parallel-size", 2,
                                    "--ds-sequence-parallel-size", 2, tp=2),
    }
    out = {"save": save}
    results = run_distributed(train_moe, world_size=4, args=(list(four.values()),), timeout=600)
    for i, label in enumerate(four):
        out[label] = [per_rank[i] for per_rank in results]
    to_universal(os.path.join(save, "global_step3"))
    one = [moe_argv, layout(moe_argv, "--zero-stage", 1, "--load", save, "--universal-checkpoint")]
    out["plain"], out["universal"] = ([run] for run in run_distributed(train_moe, world_size=1, timeout=300,
                                                                         args=(one,))[0])
    return out


def test_the_expert_groups_fold_the_stage_in_megatron_lm_order():
    """rank = (pp * dp + dp_rank) * tp + tp_rank; stage-local l: etp_rank = l % etp, ep_rank = (l // etp) % ep."""
    four = group_layout(tp=2, pp=1, dp=2, ep=4, etp=1)
    assert four.expert == [[0, 1, 2, 3]] and four.expert_data == [[0], [1], [2], [3]]
    two = group_layout(tp=2, pp=2, dp=2, ep=2, etp=1)  # stages {0..3}, {4..7}
    assert two.expert == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert two.expert_data == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [two.expert_coords(r) for r in range(4, 8)] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
    # the default (etp = tp): expert parallelism within the data-parallel ranks of one TP rank, as before
    same = group_layout(tp=2, pp=1, dp=2, ep=2)
    assert same == group_layout(tp=2, pp=1, dp=2, ep=2, etp=2) and same.expert == [[0, 2], [1, 3]]


@pytest.mark.parametrize("flags,world_size,match", [
    (["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"],
     4, "--expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2 needs --sequence-parallel"),
    (["--tensor-model-parallel-size", "4", "--sequence-parallel", "--expert-tensor-parallel-size", "2"], 4,
     "--expert-tensor-parallel-size 2: only 1"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"], 2,
     "--expert-model-parallel-size 1 must be above 1 and divide the 2 ranks"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
      "--expert-model-parallel-size", "4"], 2, "--expert-model-parallel-size 4 must be above 1 and divide the 2 ranks"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
      "--context-parallel-size", "2"], 4,
     "--expert-model-parallel-size 1 must be above 1 and divide the 4 ranks of a pipeline stage (TP 2 x CP / "
     "Ulysses 2 x DP 1)"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
      "--expert-model-parallel-size", "2", "--load", "{tmp}", "--universal-checkpoint"], 4,
     "--universal-checkpoint with --expert-tensor-parallel-size 1 below the TP size is not built yet"),
])
def test_bad_expert_tensor_parallel_layouts_are_refused(tiny_corpus, tmp_path, flags, world_size, match):
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    with pytest.raises(ValueError, match=re.escape(match)):
        run_config_from_argv(tiny_argv(tiny_corpus, *MOE_FLAGS, *flags), world_size=world_size)


def test_expert_tensor_parallel_needs_experts(tiny_corpus):
    argv = tiny_argv(tiny_corpus, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                     "--expert-tensor-parallel-size", "1")
    with pytest.raises(ValueError, match=re.escape("--expert-tensor-parallel-size 1 needs experts")):
        run_config_from_argv(argv, world_size=2)


def test_a_checkpoint_loads_only_at_its_expert_tensor_parallel_size(tiny_corpus, tmp_path):
    argv = tiny_argv(tiny_corpus, *MOE_FLAGS, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                     "--expert-model-parallel-size", "2")
    rc = run_config_from_argv(argv, world_size=4)  # ETP = TP = 2
    saved = {"parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "data_parallel_size": 2,
                          "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}}
    with pytest.raises(ValueError, match=re.escape("saved with --expert-tensor-parallel-size 1 (this run: 2)")):
        _check_same_layout(rc, str(tmp_path), saved)
    etp1 = run_config_from_argv(argv + ["--expert-tensor-parallel-size", "1"], world_size=4)
    del saved["parallel"]["expert_tensor_parallel_size"]  # a record without it: ETP = its TP
    with pytest.raises(ValueError, match=re.escape("saved with --expert-tensor-parallel-size 2 (this run: 1)")):
        _check_same_layout(etp1, str(tmp_path), saved)


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", ["etp1 ep4", "etp1 ep2", "etp1 ep2 cp2", "etp1 ep2 ulysses2"])
def test_whole_experts_over_the_tp_ranks_train_as_one_process(runs, label):
    ref = runs["plain"][0]
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, ref["losses"]
    ep = int(label.split("ep")[1].split()[0])
    for rank, run in enumerate(runs[label]):
        assert_same_moe_run(ref, run, f"rank {rank} of TP=2 + SP, ETP=1, {label}")
        assert sorted(run["expert_bias"]) == sorted(ref["expert_bias"]), f"rank {rank} of {label}"
        assert run["expert_numel"] * ep == ref["expert_numel"], f"rank {rank} of {label}: whole experts, E / ep"


@pytest.mark.multiprocess
def test_the_dry_run_counts_the_whole_experts_each_rank_holds(runs, moe_argv):
    """--dry-run's experts section (the planner's Layout with etp = 1): each rank's expert parameters are the ones
    the run held (whole experts, E / ep of them), the expert-data-parallel group tp x seq x dp / ep."""
    from megatron.dry_run.estimate import experts_section

    for label, flags, world_size in (
            ("etp1 ep4", ("--expert-model-parallel-size", 4), 4),
            ("etp1 ep2", ("--expert-model-parallel-size", 2, "--zero-stage", 1), 4),
            ("etp1 ep2 cp2", ("--expert-model-parallel-size", 2, "--context-parallel-size", 2), 4),
            ("etp1 ep2 ulysses2", ("--expert-model-parallel-size", 2, "--ds-sequence-parallel-size", 2), 4)):
        rc = run_config_from_argv(layout(moe_argv, *ETP1, *flags, tp=2), world_size=world_size)
        section = experts_section(rc, [rc.model.num_layers])
        ep = rc.parallel.expert_model_parallel_size
        assert section["expert_data_parallel_size"] == world_size // ep, (label, section)
        assert {run["expert_numel"] for run in runs[label]} == {section["stages"][0]["expert_params_per_rank"]}, \
            (label, section)


@pytest.mark.multiprocess
def test_whole_experts_over_the_tp_ranks_in_bf16_track_fp32(runs):
    for rank, run in enumerate(runs["etp1 ep2 bf16"]):
        assert run["optimizer"] == "BF16_Optimizer", f"rank {rank}"
        assert_same_run(runs["plain"][0], run, f"rank {rank}: bf16 TP=2 + SP, ETP=1 x EP=2 vs fp32 one process",
                        dtype=torch.bfloat16)


@pytest.mark.multiprocess
def test_whole_experts_over_the_tp_ranks_resume_loss_for_loss(runs):
    name = "etp1 ep2"
    for rank, (straight, first, resumed) in enumerate(zip(runs[name], runs[f"{name} first"], runs[f"{name} resumed"])):
        assert_resumed_bit_for_bit(straight, first, resumed, f"rank {rank}", 3, ITERS)


@pytest.mark.multiprocess
def test_whole_experts_over_the_tp_ranks_continue_from_a_universal_checkpoint_at_ep1(runs):
    """Saved at TP = 2 + SP, ETP = 1, EP = 2 (ZeRO-1), converted by ds_to_universal.py, resumed on one process."""
    ref = runs["plain"][0]
    tail = dict(ref, losses=ref["losses"][3:], grad_norms=ref["grad_norms"][3:])
    run = runs["universal"][0]
    assert run["iterations"] == list(range(4, ITERS + 1)), run["iterations"]
    assert_same_moe_run(tail, run, "TP=2 + SP, ETP=1 x EP=2 -> universal -> one process")


@pytest.mark.multiprocess
def test_whole_experts_read_back_whole_from_either_checkpoint(runs):
    """The single-process reader (exporters) takes every expert from the expert files of the ETP = 1 checkpoint; they
    are the universal conversion's (cut from the ZeRO-1 optimizer partitions), value for value: the same step's fp32
    weights read two ways."""
    config, state, _ = load_full_state_dict(runs["save"], "global_step3")
    zero = os.path.join(runs["save"], "global_step3_universal", "zero")
    folders = sorted(name for name in os.listdir(zero) if re.match(r"^\d+\.mlp\.experts\.", name))
    assert len(folders) == 2 * 4, folders  # 2 layers x (w1, w2, fc1_bias, fc2_bias)
    for folder in folders:
        item, rest = folder.split(".", 1)
        name = f"layers.{int(item) - 3}.{rest}"  # pipeline item i + 3 is transformer layer i
        universal = torch.load(os.path.join(zero, folder, "fp32.pt"), weights_only=True)["param"]
        assert state[name].shape[0] == config.moe.num_experts and torch.equal(state[name], universal), name
