"""DeepSpeed-Ulysses (--ds-sequence-parallel-size) trains as (1, 1, 1) does.

fp32, no dropout, 10 iterations of pretrain_gpt's path: losses and grad norms within ``run_tolerance``
(megatron/testing/tolerance.py) of a single process, for BLOOM (ALiBi), a Llama-style model (rotary, SwiGLU,
RMSNorm, GQA) and learned positions, at SP=2 (ZeRO 0, 1, 2 and 3; with --torch-compile at ZeRO 0 and 3), SP=4, SP=2
x TP=2 (also with Megatron's --sequence-parallel) and SP=2 x DP=2, and ZeRO-3 with hpZ groups of 2 at SP=2 x DP=2
and SP=2 x TP=2; bf16 tracks fp32; a run saved at iteration 5 and resumed with SP=2 continues bit for bit, and
through universal checkpoints at other layouts; the ZeRO-0/1 checkpoints read back and export; bad layouts are
refused before launch. One launch per world size trains every layout of that size in turn.
"""

import pytest
import torch

from megatron.testing import run_distributed, tiny_argv
from tests.helpers.training import (
    MANY_LAYOUTS,
    assert_continues,
    assert_same_run,
    layout,
    pretrain_error,
    to_universal,
    train,
    weights_tolerance,
)

pytestmark = MANY_LAYOUTS

ITERS = 10
LLAMA = ("--normalization", "rmsnorm", "--swiglu", "--num-attention-heads", "8", "--num-key-value-heads", "4",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96")
SP2, SP4, TP2 = ("--ds-sequence-parallel-size", 2), ("--ds-sequence-parallel-size", 4), \
    ("--tensor-model-parallel-size", 2)


def _models(corpus):
    bloom = tiny_argv(corpus, train_iters=ITERS)
    llama = tiny_argv(corpus, *LLAMA, train_iters=ITERS, position_embedding_type="rope", embed_layernorm=False)
    learned = tiny_argv(corpus, train_iters=ITERS, position_embedding_type="learned_absolute", embed_layernorm=False)
    return {"bloom": bloom, "llama": llama, "learned": learned}


def at_end(folder):
    """Flags saving a run once, when it ends."""
    return "--save", folder, "--save-interval", 100


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """The checkpoint folders the runs write: the SP = 2 ZeRO-1 run's iteration 5 ("first half"; "half for the
    pipeline" is a copy of it, converted for the pipeline engine), and at iteration 10 the one-process BLOOM
    reference's and the SP = 2 runs' at ZeRO-0 and ZeRO-1."""
    root = tmp_path_factory.mktemp("ulysses")
    return {name: str(root / name) for name in ("half", "half for the pipeline", "one", "sp2 zero0", "sp2 zero1")}


def _universal_resumes(corpus, saves) -> dict:
    """The SP=2 ZeRO-1 run's iteration-5 checkpoint ("first half"), converted by ds_to_universal.py for the model
    engine, which Ulysses runs on, and, in a copy of the folder, with --target-engine pipeline: the runs that
    resume it at SP=4, at SP=2 x DP=2, at SP=1 x DP=4 under ZeRO-2 and in 3D (TP=2 x PP=2), 4 processes each."""
    import os
    import shutil

    model_engine, pipeline = saves["half"], saves["half for the pipeline"]
    shutil.copytree(model_engine, pipeline)
    for save, name, flags in ((model_engine, "global_step5_universal", ()),
                              (pipeline, "global_step5_universal_pipeline", ("--target-engine", "pipeline"))):
        to_universal(os.path.join(save, "global_step5"), os.path.join(save, name), *flags)  # latest_universal -> it
    argv = tiny_argv(corpus, train_iters=ITERS, zero_stage=1)
    resumed = {"sp4": layout(argv, *SP4, "--load", model_engine), "sp2 dp2": layout(argv, *SP2, "--load", model_engine),
               "sp1 dp4 zero2": tiny_argv(corpus, "--load", model_engine, train_iters=ITERS, zero_stage=2),
               "3d tp2 pp2": tiny_argv(corpus, "--load", pipeline, train_iters=ITERS, zero_stage=1,
                                       tensor_model_parallel_size=2, pipeline_model_parallel_size=2)}
    return {f"universal {label}": (layout(a, "--universal-checkpoint"), "bloom") for label, a in resumed.items()}


@pytest.fixture(scope="module")
def runs(tiny_corpus, saves):
    models = _models(tiny_corpus)
    save = saves["half"]
    refs = run_distributed(train, world_size=1, timeout=300,
                           args=([layout(models["bloom"], *at_end(saves["one"])), models["llama"],
                                  models["learned"]],))[0]
    references = dict(zip(models, refs))
    for name, ref in references.items():
        assert ref["losses"][-1] < ref["losses"][0] - 0.05, (name, ref["losses"])  # it learns
    bloom = models["bloom"]
    two = {
        "bloom sp2": (layout(bloom, *SP2, *at_end(saves["sp2 zero0"])), "bloom"),
        "bloom sp2 zero1": (layout(bloom, *SP2, "--zero-stage", 1, *at_end(saves["sp2 zero1"])), "bloom"),
        "bloom sp2 zero2": (layout(bloom, *SP2, "--zero-stage", 2), "bloom"),
        "bloom sp2 zero3": (layout(bloom, *SP2, "--zero-stage", 3), "bloom"),
        "llama sp2": (layout(models["llama"], *SP2), "llama"),
        "learned sp2": (layout(models["learned"], *SP2), "learned"),
        "bloom sp2 bf16": (layout(bloom, *SP2, "--bf16"), "bloom"),
        # compiled layers with the all-to-alls inside them
        "bloom sp2 compiled": (layout(bloom, *SP2, "--torch-compile"), "bloom"),
        "llama sp2 zero3 compiled": (layout(models["llama"], *SP2, "--zero-stage", 3, "--torch-compile"), "llama"),
        "first half": (layout(bloom, *SP2, "--zero-stage", 1, "--save", save, "--save-interval", 100,
                               "--exit-interval", 5), "bloom"),
        "resumed": (layout(bloom, *SP2, "--zero-stage", 1, "--load", save), "bloom"),
    }
    four = {
        "bloom sp4": (layout(bloom, *SP4), "bloom"),
        "bloom sp2 tp2": (layout(bloom, *SP2, *TP2), "bloom"),
        # both sequence axes: Ulysses over SP and Megatron's --sequence-parallel inside each TP group
        "bloom sp2 tp2 megatron sp": (layout(bloom, *SP2, *TP2, "--sequence-parallel"), "bloom"),
        "llama sp2 tp2": (layout(models["llama"], *SP2, *TP2, "--zero-stage", 2), "llama"),
        "bloom sp2 dp2": (layout(bloom, *SP2, "--zero-stage", 1), "bloom"),
        # ZeRO++ hpZ: the secondary shard within groups of the ranks ZeRO-3 shards over (dp x sp)
        "bloom sp2 dp2 hpz2": (layout(bloom, *SP2, "--zero-stage", 3, "--zero-hpz-partition-size", 2), "bloom"),
        "bloom sp2 tp2 hpz2": (layout(bloom, *SP2, *TP2, "--zero-stage", 3, "--zero-hpz-partition-size", 2), "bloom"),
        "learned sp2 dp2": (layout(models["learned"], *SP2, "--zero-stage", 3), "learned"),
    }
    out = {}
    for world, layouts in ((2, two), (4, four)):
        if world == 4:  # the universal resumes of the 2-process launch's "first half" join the 4-process launch
            layouts.update(_universal_resumes(tiny_corpus, saves))
        results = run_distributed(train, world_size=world, args=([argv for argv, _ in layouts.values()],),
                                  timeout=900)
        for rank, per_rank in enumerate(results):
            for (label, (_, model)), result in zip(layouts.items(), per_rank):
                out.setdefault(label, {})[rank] = (model, result)
    return references, out


EXACT = ["bloom sp2", "bloom sp2 zero1", "bloom sp2 zero2", "bloom sp2 zero3", "llama sp2", "learned sp2",
         "bloom sp2 compiled", "llama sp2 zero3 compiled",
         "bloom sp4", "bloom sp2 tp2", "bloom sp2 tp2 megatron sp", "llama sp2 tp2", "bloom sp2 dp2", "learned sp2 dp2",
         "bloom sp2 dp2 hpz2", "bloom sp2 tp2 hpz2"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", EXACT)
def test_ulysses_matches_single_process_in_fp32(runs, label):
    references, out = runs
    for rank, (model, result) in out[label].items():
        assert len(result["losses"]) == ITERS, (label, rank)
        assert_same_run(references[model], result, f"rank {rank}: {label}")


@pytest.mark.multiprocess
def test_ulysses_engine_and_optimizers(runs):
    _, out = runs
    expected = {"bloom sp2 zero1": "DeepSpeedZeroOptimizer", "bloom sp2 zero2": "DeepSpeedZeroOptimizer",
                "bloom sp2 zero3": "DeepSpeedZeroOptimizer_Stage3", "bloom sp2 bf16": "BF16_Optimizer"}
    for label, optimizer in expected.items():
        for rank, (_, result) in out[label].items():
            assert result["optimizer"] == optimizer, (label, rank, result["optimizer"])
    for label in ("bloom sp2 compiled", "llama sp2 zero3 compiled", "bloom sp2"):
        for rank, (_, result) in out[label].items():  # the tiny models' two layers, compiled or not
            assert result["compiled_layers"] == (0 if label == "bloom sp2" else 2), (label, rank, result)


@pytest.mark.multiprocess
def test_hpz_groups_are_the_sequence_parallel_ranks_of_a_replica(runs):
    """hpZ 2 at SP 2: each group holds one TP rank's two SP ranks of one data-parallel replica, enumerated here
    from rank = ((pipe * dp + data) * sp + seq) * tp + model."""
    _, out = runs
    for label, (tp, dp) in {"bloom sp2 dp2 hpz2": (1, 2), "bloom sp2 tp2 hpz2": (2, 1)}.items():
        expected = {}
        for d in range(dp):
            for t in range(tp):
                group = [(d * 2 + s) * tp + t for s in range(2)]
                expected.update({r: group for r in group})
        for rank, (_, result) in out[label].items():
            assert result["hpz_ranks"] == result["hpz_ranks_engine"] == expected[rank], (label, rank, result)


@pytest.mark.multiprocess
def test_ulysses_bf16_tracks_fp32(runs):
    references, out = runs
    for rank, (model, result) in out["bloom sp2 bf16"].items():
        assert_same_run(references[model], result, f"rank {rank}: bf16", dtype=torch.bfloat16)


@pytest.mark.multiprocess
def test_ulysses_resume_is_exact(runs):
    _, out = runs
    for rank in (0, 1):
        first, resumed = out["first half"][rank][1], out["resumed"][rank][1]
        straight = out["bloom sp2 zero1"][rank][1]
        assert first["iterations"] == [1, 2, 3, 4, 5] and resumed["iterations"] == [6, 7, 8, 9, 10], rank
        assert first["losses"] + resumed["losses"] == straight["losses"], rank
        assert first["grad_norms"] + resumed["grad_norms"] == straight["grad_norms"], rank


@pytest.mark.multiprocess
def test_universal_checkpoint_moves_between_sequence_parallel_sizes(runs):
    """The SP ranks hold the same weights: the SP=2 ZeRO-1 run's iteration-5 checkpoint ("first half"), converted
    by ds_to_universal.py (for the model engine, which Ulysses runs on, and, in a copy of the folder, with
    --target-engine pipeline), continues at SP=4, at SP=2 x DP=2, at SP=1 x DP=4 under ZeRO-2 and in 3D (TP=2 x
    PP=2), each within ``run_tolerance`` of the straight SP=2 run (in the fixture's 4-process launch)."""
    _, out = runs
    straight = out["bloom sp2 zero1"][0][1]
    for label in ("sp4", "sp2 dp2", "sp1 dp4 zero2", "3d tp2 pp2"):
        for rank, (_, run) in out[f"universal {label}"].items():
            assert run["iterations"] == list(range(6, 11)), (label, run["iterations"])
            assert_continues(straight["losses"], run["losses"], f"rank {rank} {label}", dtype=torch.float32)


@pytest.mark.multiprocess
def test_ulysses_zero0_and_zero1_checkpoints_export_and_refuse_the_pipeline_engine(runs, saves, tiny_corpus,
                                                                                    tmp_path):
    """DeepSpeed's model engine saves a Ulysses run's weights in its module states at ZeRO-0/1 (no
    pipeline layer files): the readers take the record's word for it. The weights read back (the SP = 2 runs' at
    iteration 10) equal the one-process run's at the same iteration, the transformers export computes our model's
    logits, and resuming on the pipeline engine is refused before any work, naming the conversion."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron.checkpoint.run_state import load_run_state
    from megatron.checkpoint.single_process import load_full_state_dict
    from megatron.model import GPTModel
    from megatron.testing.tolerance import model_tolerance
    from tools.convert_checkpoint import to_hf

    argv = tiny_argv(tiny_corpus, train_iters=ITERS)
    _, reference, _ = load_full_state_dict(saves["one"])
    for stage in (0, 1):
        save = saves[f"sp2 zero{stage}"]
        record = load_run_state(save)
        assert (record["saving_engine"], record["weight_files"]) == ("model", "module_states"), record
        config, state, _ = load_full_state_dict(save)
        assert set(state) == set(reference), stage
        for name, tensor in reference.items():  # 10 iterations at another layout: weights_tolerance apart
            diff = (state[name] - tensor).abs().max().item()
            assert diff <= weights_tolerance(torch.float32, ITERS, 1e-3, tensor.abs().max().item()), \
                (stage, name, diff)
        assert to_hf.main(["--load", save, "--output-dir", str(tmp_path / f"hf{stage}")]) == 0
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / f"hf{stage}")).eval()
        ours = GPTModel(config).eval()
        ours.load_state_dict(state)
        ids = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            expected = ours(ids).transpose(0, 1)[..., :400]  # [b, s, v]
            diff = (hf(ids).logits - expected).abs().max().item()
        assert diff <= model_tolerance(config, torch.float32, expected), (stage, diff)
    error = run_distributed(pretrain_error, world_size=1, timeout=300,
                            args=(layout(argv, "--zero-stage", 1, "--load", saves["sp2 zero1"], "--no-load-optim"),))[0]
    assert error and "DeepSpeed engine model (this run: pipeline)" in error and "--target-engine pipeline" in error, \
        error


def _refused(tiny_corpus, *flags, world_size):
    from megatron.arguments import run_config_from_argv

    with pytest.raises(ValueError) as error:
        run_config_from_argv(tiny_argv(tiny_corpus, *[str(f) for f in flags]), world_size=world_size)
    return str(error.value)


def test_bad_ulysses_layouts_are_refused_before_launch(tiny_corpus):
    msg = _refused(tiny_corpus, *SP4, "--seq-length", 30, world_size=4)
    assert "--seq-length 30 is not divisible by --ds-sequence-parallel-size 4" in msg
    msg = _refused(tiny_corpus, *SP4, *TP2, world_size=8)  # 4 heads over TP x SP = 8
    assert "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 2 x " \
           "--ds-sequence-parallel-size 4 = 8" in msg
    msg = _refused(tiny_corpus, *SP2, "--num-key-value-heads", 1, world_size=2)
    assert "key / value heads" in msg and " 1 is not divisible" in msg
    msg = _refused(tiny_corpus, *SP2, *TP2, "--sequence-parallel", "--seq-length", 34, world_size=4)
    assert "--seq-length 34 is not divisible by --ds-sequence-parallel-size 2 x --tensor-model-parallel-size 2" in msg
    msg = _refused(tiny_corpus, *SP2, world_size=3)
    assert "world size 3 is not a multiple of" in msg and "--ds-sequence-parallel-size 2 = 2" in msg
    msg = _refused(tiny_corpus, *SP2, "--pipeline-model-parallel-size", 2, world_size=4)
    assert "does not combine with --pipeline-model-parallel-size 2" in msg and "--pipeline-model-parallel-size 1" in msg
