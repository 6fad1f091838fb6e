"""Multi-token prediction (--mtp-num-layers) trained end to end: the depths' loss reaches the weights, and the
parallel layouts train as one process does (fp32, 10 iterations, ``assert_same_run``): PP=2 x TP=2 (the depths on
the last stage, embedding with a copy of the word embedding tied to the first stage's), the same with Megatron
sequence parallelism, TP=2 x DP=2 on ZeRO-2 (DeepSpeed's model engine: the depths inside GPTModel), and an MoE
model whose MTP layer routes (an MoE layer, as the decoder's last) at PP=2 x EP=2."""

import os

import pytest

from megatron.arguments import run_config_from_argv
from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import (
    MANY_LAYOUTS,
    assert_continues,
    assert_same_run,
    layout,
    tensorboard_scalars,
    to_universal,
    train,
)

pytestmark = MANY_LAYOUTS

ITERS = 10
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--position-embedding-type", "rope"]
MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
ZBH1 = ["--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"]
VIRTUAL = ["--num-virtual-stages-per-pipeline-rank", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "0.01"]


@pytest.fixture(scope="module")
def base(tiny_corpus):
    return tiny_argv(tiny_corpus, *LLAMA, train_iters=ITERS, hidden_size=32, seq_length=16, lr=3e-3,
                     embed_layernorm=False, position_embedding_type=None)


@pytest.fixture(scope="module")
def tensorboard_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mtp_tensorboard"))


@pytest.fixture(scope="module")
def one_process(base, tensorboard_dir):
    runs = [base + MTP + ["--tensorboard-dir", tensorboard_dir], base, base + MTP + MOE,
            base + MTP + ["--num-layers", "4"]]
    return run_distributed(train, world_size=1, args=(runs,))[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("mtp_checkpoints")


@pytest.fixture(scope="module")
def four_processes(base, checkpoints):
    runs = [layout(base + MTP, tp=2, pp=2), layout(base + MTP, "--sequence-parallel", tp=2, pp=2),
            layout(base + MTP, "--zero-stage", "2", tp=2),
            layout(base + MTP + MOE, "--expert-model-parallel-size", "2", pp=2),
            layout(base + MTP, *ZBH1, pp=2), layout(base + MTP, "--num-layers", "4", *VIRTUAL, pp=2),
            layout(base + MTP, "--pipeline-model-parallel-layout", "E|ttmmL", pp=2),
            layout(base + MTP, "--context-parallel-size", "2", pp=2),
            layout(base + MTP, "--context-parallel-size", "2", "--sequence-parallel", tp=2)]
    # PP=2 x TP=2 at ZeRO-1 (its optimizer partitions make the universal checkpoint): straight, saved at 5, resumed
    zero1, save = ["--zero-stage", "1"], ["--save", str(checkpoints), "--save-interval", "100"]
    runs += [layout(base + MTP, *zero1, tp=2, pp=2), layout(base + MTP, *zero1, *save, "--exit-interval", "5", tp=2, pp=2),
             layout(base + MTP, *zero1, *save, "--load", str(checkpoints), tp=2, pp=2)]
    return run_distributed(train, world_size=4, args=(runs,))


def test_mtp_changes_training_but_not_what_the_lm_loss_means(one_process):
    with_mtp, without = one_process[:2]
    assert with_mtp["iterations"] == without["iterations"] == list(range(1, ITERS + 1))
    # iteration 1's reported loss is the LM loss of the same initial trunk: equal to the run without MTP
    assert with_mtp["losses"][0] == pytest.approx(without["losses"][0], rel=1e-6)
    # the depths' gradient reaches the shared weights: the runs part
    assert with_mtp["losses"][-1] != without["losses"][-1]
    assert with_mtp["grad_norms"][0] != without["grad_norms"][0]


def test_each_depths_loss_is_logged_beside_the_lm_loss(one_process, tensorboard_dir):
    """Megatron-LM's tags, one value per iteration: the depths' mean loss over the iteration's micro-batches."""
    scalars = tensorboard_scalars(tensorboard_dir)
    lm = [value for _, value in scalars["lm-loss-training/lm loss"]]
    assert lm == pytest.approx(one_process[0]["losses"], rel=1e-6)
    for depth in (1, 2):
        series = scalars[f"mtp_{depth} loss"]
        assert [step for step, _ in series] == list(range(1, ITERS + 1))
        assert all(4.0 < value < 8.0 for _, value in series)  # cross-entropies over 512 rows (ln 512 = 6.2)
        assert [value for _, value in series] != lm


@pytest.mark.multiprocess
@pytest.mark.parametrize("index, label", [(0, "PP=2 x TP=2"), (1, "PP=2 x TP=2 + SP"), (2, "TP=2 x DP=2, ZeRO-2")])
def test_mtp_layouts_train_as_one_process(one_process, four_processes, index, label):
    assert_same_run(one_process[0], four_processes[0][index], label)


@pytest.mark.multiprocess
def test_mtp_with_zbh1_and_interleaved_stages_trains_as_one_process(one_process, four_processes):
    assert_same_run(one_process[0], four_processes[0][4], "ZB-H1, PP=2 (x DP=2)")
    assert_same_run(one_process[3], four_processes[0][5], "interleaved PP=2 x v=2 (x DP=2), 4 layers", num_layers=4)


@pytest.mark.multiprocess
def test_mtp_in_a_pipeline_layout_string_trains_as_one_process(one_process, four_processes):
    """Megatron-LM's layout letters: 'E|ttmmL' puts both decoder layers and the two depths on the last stage."""
    run = four_processes[0][6]  # rank 0: the first stage, the embedding alone
    assert run["parts"] == [0, 3, 10] and run["held_layers"] == 0  # items 3..9: the layers, the norm, MTP, the head
    assert_same_run(one_process[0], run, "layout E|ttmmL, PP=2 (x DP=2)")


@pytest.mark.multiprocess
def test_moe_mtp_at_pp2_ep2_trains_as_one_process(one_process, four_processes):
    assert_same_run(one_process[2], four_processes[0][3], "MoE + MTP, PP=2 x EP=2")


@pytest.mark.multiprocess
def test_mtp_with_context_parallelism_trains_as_one_process(one_process, four_processes):
    """The shifted targets cross the CP ranks' load-balanced chunks (gathered, shifted, re-sliced)."""
    assert_same_run(one_process[0], four_processes[0][7], "CP=2 x PP=2")
    assert_same_run(one_process[0], four_processes[0][8], "CP=2 x TP=2 + SP")


@pytest.mark.multiprocess
def test_mtp_checkpoints_resume_and_move_between_layouts(base, one_process, four_processes, checkpoints):
    """Saved at iteration 5 at PP=2 x TP=2, ZeRO-1 (the depths, their tied embedding copy and the untied head on the
    last stage): resumed at the same layout, iterations 6..10 are the straight run's bit for bit; converted by
    ds_to_universal.py and resumed in one process, they continue the one-process run within ``run_tolerance``."""
    straight, first, resumed = four_processes[0][9:12]
    assert_same_run(one_process[0], straight, "PP=2 x TP=2, ZeRO-1")
    assert first["iterations"] == [1, 2, 3, 4, 5] and resumed["iterations"] == [6, 7, 8, 9, 10]
    assert_continues(straight["losses"], resumed["losses"], "PP=2 x TP=2 resumed")
    to_universal(os.path.join(str(checkpoints), "global_step5"))
    load = ["--load", str(checkpoints), "--universal-checkpoint", "--zero-stage", "1"]
    (moved,) = run_distributed(train, world_size=1, args=([base + MTP + load],))[0]
    tail = dict(one_process[0], losses=one_process[0]["losses"][5:], grad_norms=one_process[0]["grad_norms"][5:])
    assert moved["iterations"] == [6, 7, 8, 9, 10]
    assert_same_run(tail, moved, "PP=2 x TP=2 -> universal -> one process")


@pytest.mark.parametrize("flags, needle", [
    (["--context-parallel-size", "2", "--zero-stage", "2", "--pipeline-model-parallel-size", "1"],
     "--mtp-num-layers with --context-parallel-size on DeepSpeed's model engine"),
    (["--ds-sequence-parallel-size", "2", "--pipeline-model-parallel-size", "1"],
     "--mtp-num-layers 2 does not work yet with --ds-sequence-parallel-size 2"),
])
def test_mtp_refusals(base, flags, needle):
    with pytest.raises(ValueError, match=needle):
        run_config_from_argv(base + MTP + flags, world_size=2)
