"""Interleaved virtual pipeline stages (--num-virtual-stages-per-pipeline-rank) train as 1F1B does.

fp32, no dropout, gloo on CPU, PP = 2 with 4 layers: v = 2 puts layers 0 and 2 on rank 0, 1 and 3 on rank 1. One
2-process launch trains 1F1B and interleaved (ZeRO-1) for 10 iterations each, saving at 5 and 10. The layer files
are BLOOM's either way, but a rank's ZeRO optimizer shard holds the layers of its chunks, so a regular checkpoint
resumes only under its own schedule (there bit for bit; refused by name otherwise) and switches schedule through a
universal checkpoint. A second launch resumes each from iteration 5 under the other schedule and the interleaved one
under its own, and trains both schedules in bf16 (BF16_Optimizer). Losses and grad norms agree with 1F1B's within
``run_tolerance`` (megatron/testing/tolerance.py) over the 10 iterations, through both resumes, and between the two
bf16 runs (bf16's tolerance). One 4-process launch trains TP=2 x PP=2 (4 layers) and PP=4 (8 layers: one per chunk)
under 1F1B and under v = 2, 10 iterations each: the same losses and grad norms within that tolerance.

Megatron-LM's pipeline layout flags (megatron.config.pipeline_layout) in the first 2-process launch: the 4 layers
as 3 + 1 (--pipeline-model-parallel-layout 'Ettt|tL'), as 1 + 3 (--decoder-first-pipeline-num-layers 1), and
interleaved unevenly ('E|tt|t|tL': rank 0 holds the embedding alone as its first chunk and one layer as its second,
rank 1 two layers, then one with the loss), and with an empty chunk ('E|tttt||L', Megatron-LM's "empty stage":
rank 0 holds the embedding and nothing else, its second chunk passes the activations on). Each trains as one
process does (a 1-process launch, the reference), and each rank builds the stages the layout names; so does 3 + 1
under ZB-H1 (ZeRO-0), and 'E|tt|t|tL' at TP=2 x PP=2 in the 4-process launch.
"""

import os

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import run_tolerance
from tests.helpers.training import TINY_WIDTH, assert_same_run, layout, to_universal, train

ITERS = 10
LAYERS = 4  # two chunks of one layer on each of 2 pipeline ranks
VIRTUAL = ["--num-virtual-stages-per-pipeline-rank", "2"]
ZBH1 = ["--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"]  # fp32 ZB-H1 runs at ZeRO stage 0
# name: flags, and each rank's (virtual) stages as pipeline items (BLOOM's numbering: 0-2 the embedding and its
# slots, 3-6 the layers, 7-9 the loss's slot, final norm and head), written from the layout by hand
LAYOUTS = {
    "layout 3+1": (["--pipeline-model-parallel-layout", "Ettt|tL"], [0, 6, 10]),
    "first 1": (["--decoder-first-pipeline-num-layers", "1"], [0, 4, 10]),
    "interleaved layout": (["--pipeline-model-parallel-layout", "E|tt|t|tL"], [0, 3, 5, 6, 10]),
    "interleaved empty chunk": (["--pipeline-model-parallel-layout", "E|tttt||L"], [0, 3, 7, 7, 10]),
    "zbh1 layout 3+1": (["--pipeline-model-parallel-layout", "Ettt|tL", *ZBH1, "--zero-stage", "0"], [0, 6, 10]),
}
HELD_LAYERS = {"layout 3+1": [3, 1], "first 1": [1, 3], "interleaved layout": [1, 3],  # per rank
               "interleaved empty chunk": [0, 4], "zbh1 layout 3+1": [3, 1]}
ENGINES = {"interleaved layout": "InterleavedPipelineEngine", "interleaved empty chunk": "InterleavedPipelineEngine",
           "zbh1 layout 3+1": "ZeroBubblePipelineEngine"}  # the others: DeepSpeed's PipelineEngine (1F1B)


def _argv(corpus, *extra, **flags):
    return tiny_argv(corpus, "--pipeline-model-parallel-size", "2", *extra,
                     **dict(dict(num_layers=LAYERS, train_iters=ITERS, zero_stage=1), **flags))


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """1F1B and interleaved for 10 iterations, saving at 5 and 10; each resumed from its iteration 5 under the
    other schedule; both in bf16 for 5 iterations."""
    root = tmp_path_factory.mktemp("interleaved")
    saved_1f1b, saved_interleaved = str(root / "1f1b"), str(root / "interleaved")
    evaluate = dict(eval_interval=ITERS, eval_iters=2)  # eval_batch: the forward-only schedule
    argvs = [_argv(tiny_corpus, save=saved_1f1b, save_interval=5, **evaluate),
             _argv(tiny_corpus, *VIRTUAL, save=saved_interleaved, save_interval=5, **evaluate)]
    argvs += [_argv(tiny_corpus, *flags) for flags, _ in LAYOUTS.values()]
    per_rank = run_distributed(train, world_size=2, args=(argvs,), timeout=600)
    out = dict(zip(["1f1b", "interleaved"], per_rank[-1]))
    out["layouts"] = [dict(zip(LAYOUTS, results[2:])) for results in per_rank]  # per rank
    # The latest regular checkpoints (iteration 10) under the other schedule: refused before any launch.
    out["refusals"] = [_regular_load_refusal(_argv(tiny_corpus, *VIRTUAL, load=saved_1f1b)),
                       _regular_load_refusal(_argv(tiny_corpus, load=saved_interleaved))]
    for saved in (saved_1f1b, saved_interleaved):
        to_universal(os.path.join(saved, "global_step5"))  # and points latest_universal at it
    with open(os.path.join(saved_interleaved, "latest"), "w") as latest:  # roll the regular pointer back to 5
        latest.write("global_step5")
    argvs = [_argv(tiny_corpus, *VIRTUAL, load=saved_1f1b, universal_checkpoint=True),
             _argv(tiny_corpus, load=saved_interleaved, universal_checkpoint=True),
             _argv(tiny_corpus, *VIRTUAL, load=saved_interleaved),
             _argv(tiny_corpus, "--bf16", train_iters=5), _argv(tiny_corpus, "--bf16", *VIRTUAL, train_iters=5)]
    names = ["interleaved_resumed", "1f1b_resumed", "interleaved_own_resume", "1f1b_bf16", "interleaved_bf16"]
    return out | dict(zip(names, run_distributed(train, world_size=2, args=(argvs,), timeout=600)[-1]))


@pytest.fixture(scope="module")
def wider_runs(tiny_corpus):
    """On 4 processes (fp32, ZeRO-1, 4 micro-batches): TP=2 x PP=2 and PP=4 (8 layers), each under 1F1B and v=2; and
    TP=2 x PP=2 interleaved unevenly by the layout 'E|tt|t|tL'."""
    argv = tiny_argv(tiny_corpus, train_iters=ITERS, zero_stage=1, num_layers=LAYERS)
    eight = tiny_argv(tiny_corpus, train_iters=ITERS, zero_stage=1, num_layers=8)
    layouts = {"1f1b tp2 pp2": layout(argv, tp=2, pp=2), "interleaved tp2 pp2": layout(argv, *VIRTUAL, tp=2, pp=2),
               "1f1b pp4": layout(eight, pp=4), "interleaved pp4": layout(eight, *VIRTUAL, pp=4),
               "interleaved layout tp2 pp2": layout(argv, *LAYOUTS["interleaved layout"][0], tp=2, pp=2)}
    results = run_distributed(train, world_size=4, args=(list(layouts.values()),), timeout=600)
    return {rank: dict(zip(layouts, per_rank)) for rank, per_rank in enumerate(results)}


@pytest.fixture(scope="module")
def one_process(tiny_corpus):
    """The reference of the pipeline layouts: the same model and data on one process."""
    argv = tiny_argv(tiny_corpus, num_layers=LAYERS, train_iters=ITERS, zero_stage=1)
    return run_distributed(train, world_size=1, args=([argv],), timeout=600)[0][0]


def _regular_load_refusal(argv) -> str:
    """The ValueError resuming a regular checkpoint under the other schedule gives, before any launch."""
    from megatron.arguments import run_config_from_argv
    from megatron.checkpoint.resume import resume_point

    with pytest.raises(ValueError) as refused:
        resume_point(run_config_from_argv(argv, world_size=2))
    return str(refused.value)


def _between(run, first, last):
    """``run``'s iterations ``first`` .. ``last`` with their losses and grad norms."""
    keep = [i for i, it in enumerate(run["iterations"]) if first <= it <= last]
    return {key: [run[key][i] for i in keep] for key in ("iterations", "losses", "grad_norms")}


@pytest.mark.multiprocess
def test_interleaved_trains_as_1f1b(runs):
    reference, interleaved = runs["1f1b"], runs["interleaved"]
    assert reference["iterations"] == list(range(1, ITERS + 1))
    assert reference["losses"][-1] < reference["losses"][0] - 0.05, reference["losses"]  # it learns
    assert interleaved["engine"] == "InterleavedPipelineEngine" and reference["engine"] == "PipelineEngine"
    assert_same_run(reference, interleaved, "interleaved v=2 vs 1F1B", num_layers=LAYERS)
    assert reference["valid"] and interleaved["valid"].keys() == reference["valid"].keys()
    for name, loss in reference["valid"].items():  # evaluated after the last step: another schedule's weights
        rel = run_tolerance(torch.float32, LAYERS, TINY_WIDTH, ITERS)
        assert abs(interleaved["valid"][name] - loss) <= rel * abs(loss), name


@pytest.mark.multiprocess
def test_checkpoints_switch_schedules_on_resume(runs):
    reference = runs["1f1b"]
    for saved, resumed in (("1f1b", "interleaved_resumed"), ("interleaved", "1f1b_resumed")):
        assert runs[resumed]["iterations"] == list(range(6, ITERS + 1)), resumed
        assert_same_run(_between(reference, 6, ITERS), runs[resumed], f"{resumed} from {saved}'s iteration 5",
                        num_layers=LAYERS)
    own = runs["interleaved_own_resume"]  # a regular checkpoint under its own schedule: exact
    assert own["iterations"] == list(range(6, ITERS + 1))
    assert own["losses"] == runs["interleaved"]["losses"][5:] and own["grad_norms"] == runs["interleaved"]["grad_norms"][5:]
    for refusal in runs["refusals"]:  # a regular checkpoint's optimizer shards are per rank: convert it once
        assert "--num-virtual-stages-per-pipeline-rank" in refusal and "ds_to_universal.py" in refusal, refusal


@pytest.mark.multiprocess
def test_bf16_interleaved_uses_bf16_optimizer_and_tracks_1f1b(runs):
    one_f_one_b, interleaved = runs["1f1b_bf16"], runs["interleaved_bf16"]
    assert interleaved["optimizer"] == "BF16_Optimizer" and interleaved["engine"] == "InterleavedPipelineEngine"
    assert_same_run(one_f_one_b, interleaved, "bf16 interleaved vs bf16 1F1B",
                    dtype=torch.bfloat16, num_layers=LAYERS)
    assert_same_run(_between(runs["1f1b"], 1, 5), interleaved, "bf16 interleaved vs fp32 1F1B",
                    dtype=torch.bfloat16, num_layers=LAYERS)


@pytest.mark.multiprocess
def test_interleaved_trains_as_1f1b_at_tp2_pp2_and_pp4(wider_runs):
    for rank, results in wider_runs.items():
        for shape in ("tp2 pp2", "pp4"):
            reference, interleaved = results[f"1f1b {shape}"], results[f"interleaved {shape}"]
            assert interleaved["engine"] == "InterleavedPipelineEngine", (rank, shape, interleaved["engine"])
            assert reference["iterations"] == interleaved["iterations"] == list(range(1, ITERS + 1)), (rank, shape)
            assert_same_run(reference, interleaved, f"rank {rank}: interleaved v=2 {shape} vs 1F1B",
                            num_layers=8 if shape == "pp4" else LAYERS)
        assert results["1f1b pp4"]["losses"][-1] < results["1f1b pp4"]["losses"][0] - 0.05  # it learns


@pytest.mark.multiprocess
def test_uneven_pipeline_layouts_train_as_one_process(runs, one_process):
    assert one_process["losses"][-1] < one_process["losses"][0] - 0.05, one_process["losses"]  # it learns
    for rank, results in enumerate(runs["layouts"]):
        for name, (_, parts) in LAYOUTS.items():
            run = results[name]
            assert run["parts"] == parts, (rank, name, run["parts"])  # the stages the layout names
            assert run["held_layers"] == HELD_LAYERS[name][rank], (rank, name, run["held_layers"])
            assert run["engine"] == ENGINES.get(name, "PipelineEngine"), (rank, name, run["engine"])
            assert run["iterations"] == list(range(1, ITERS + 1)), (rank, name)
            assert_same_run(one_process, run, f"rank {rank}: {name} vs one process", num_layers=LAYERS)


@pytest.mark.multiprocess
def test_uneven_interleaved_layout_at_tp2_trains_as_one_process(wider_runs, one_process):
    for rank, results in wider_runs.items():
        run = results["interleaved layout tp2 pp2"]
        assert run["parts"] == LAYOUTS["interleaved layout"][1] and run["engine"] == "InterleavedPipelineEngine"
        assert run["held_layers"] == HELD_LAYERS["interleaved layout"][rank // 2], (rank, run["held_layers"])
        assert_same_run(one_process, run, f"rank {rank}: interleaved layout E|tt|t|tL at TP=2 x PP=2", num_layers=LAYERS)
