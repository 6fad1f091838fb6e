"""Megatron-LM's pipeline layout flags (megatron.config.pipeline_layout): the stages hold what the flags say.

The layout strings and their meanings are Megatron-LM's own documented examples (NVIDIA/Megatron-LM, read at
d98e8a64dd): the --pipeline-model-parallel-layout help text (megatron/training/arguments.py), the docstring of
``PipelineParallelLayerLayout.parse_str_to_list`` and its unrolling comments
(megatron/core/transformer/pipeline_parallel_layer_layout.py), the ``pipeline_model_parallel_layout`` docstring of
``TransformerConfig`` (megatron/core/transformer/transformer_config.py), and the cases of
``TestPipelineParallelLayoutTransformerBlock`` (tests/unit_tests/transformer/test_transformer_block.py:
``test_layer_builder``'s valid and invalid layouts, ``test_layout_layer_number``'s golden layer numbers). The even
forms (--account-for-embedding/loss-in-pipeline-split, --decoder-first/last-pipeline-num-layers) are checked against
counts written here from Megatron-LM's rule (``get_num_layers_to_build`` in transformer_block.py). Then: the
pipeline engine's parts hold those layers (``virtual_stage_bounds``), the flags parse and are refused where the
layout cannot run, and --dry-run reports the layout's stages and hands their layer counts to the planner.
"""

import pytest

from megatron.config.pipeline_layout import (
    StageContents,
    describe,
    parse_layout,
    rank_layers,
    stage_contents,
)
from megatron.dry_run import build_report
from megatron.dry_run.text import render
from megatron.engine.partition import stage_bounds, virtual_stage_bounds
from megatron.model.layout import EMBEDDING, FINAL_NORM, HEAD, PASS_THROUGH, TRANSFORMER, pipeline_items
from tests.helpers.arguments import parse, tiny_config_argv


def _stage(letters: str) -> StageContents:
    """A stage written as Megatron-LM's letters (an independent spelling of what ``stage_contents`` returns)."""
    return StageContents(embedding="E" in letters, layers=letters.count("t"), mtp=letters.count("m"),
                         loss="L" in letters)


# ---- the string: Megatron-LM's documented examples ---------------------------------------------------------------

@pytest.mark.parametrize("text, stages", [
    # arguments.py's help text: 'E|(t|)*3,m|m||L' (an empty stage between the MTP layers and the loss)
    ("E|(t|)*3,m|m||L", ["E", "t", "t", "t", "m", "m", "", "L"]),
    # parse_str_to_list's docstring: [["E","t","t","t"]] + [["t","t"]]*29 + [["m"],["L"]]
    ("Ettt|(tt|)*29,m|L", ["Ettt"] + ["tt"] * 29 + ["m", "L"]),
    # its unrolling comments, in layer letters: ab,(cd|)*2 -> abcd|cd| ; (|ab)*2,cd -> |ab|abcd ; (ab)*3 -> ababab
    ("Et,(tt|)*2L", ["Ettt", "tt", "L"]),
    ("E(|tt)*2,L", ["E", "tt", "ttL"]),
    ("E(tm)*3|L", ["Etmtmtm", "L"]),
    # x*n unrolls one letter; the DeepSeek-V3 layout: 1 + 30 stages and MTP + loss on a stage of their own
    ("Et*3|t*2L", ["Ettt", "ttL"]),
    ("Et|(tt|)*30mL", ["Et"] + ["tt"] * 30 + ["mL"]),
    ("((t)*2|)*2", ["tt", "tt", ""]),  # groups nest here (Megatron-LM's regex does not: a superset)
])
def test_layout_strings_unroll_as_megatron_documents(text, stages):
    assert parse_layout(text) == stages


def test_virtual_stages_follow_megatrons_order():
    """TransformerConfig's docstring: 'E|(tt|)*2,(t|)*4,mL' (8 stages: PP 4 x VPP 2): vpp rank 0 pp rank 0 holds the
    embedding, pp ranks 1-2 two layers each, pp rank 3 one; vpp rank 1 pp ranks 0-2 one layer each, pp rank 3 MTP and
    loss. Stage s of the list is chunk s // PP of rank s % PP."""
    stages = stage_contents(8, 4, 2, layout="E|(tt|)*2,(t|)*4,mL", mtp_num_layers=1)
    chunk = {(s // 4, s % 4): stage for s, stage in enumerate(stages)}  # (vpp rank, pp rank)
    assert chunk[0, 0] == _stage("E")
    assert chunk[0, 1] == chunk[0, 2] == _stage("tt") and chunk[0, 3] == _stage("t")
    assert chunk[1, 0] == chunk[1, 1] == chunk[1, 2] == _stage("t") and chunk[1, 3] == _stage("mL")
    assert rank_layers(stages, 4) == [1, 3, 3, 1]


def test_layer_numbers_are_megatrons_golden_ones():
    """test_layout_layer_number: 8 layers on PP 4 x VPP 2 as [[E], [t], [t,t], [t], [], [t], [t], [t,t,L]] give the
    (1-based) layer numbers [[[], []], [[1], [5]], [[2, 3], [6]], [[4], [7, 8]]] per [pp rank][vpp rank]."""
    golden = [[[], []], [[1], [5]], [[2, 3], [6]], [[4], [7, 8]]]
    stages = stage_contents(8, 4, 2, layout="E|t|tt|t||t|t|ttL")
    first, numbers = 0, {}
    for s, stage in enumerate(stages):  # layers are numbered in stage order
        numbers[s % 4, s // 4] = [first + i + 1 for i in range(stage.layers)]
        first += stage.layers
    assert [[numbers[pp, vpp] for vpp in range(2)] for pp in range(4)] == golden


@pytest.mark.parametrize("num_layers, pp, vp, text, layers", [
    # test_layer_builder's valid cases (7 layers): 'Usual pp case', 'Empty stage', 'Usual uneven vpp case'
    (7, 2, 2, "Et|tttt|t|tL", [1, 4, 1, 1]),
    (7, 2, 2, "E|ttttttt||L", [0, 7, 0, 0]),
    (7, 2, 2, "E|t*6|t|L", [0, 6, 1, 0]),
    # TransformerConfig's list example [['embedding', 'decoder'], ['decoder', 'decoder', 'decoder', 'loss']]
    (4, 2, 1, "Et|tttL", [1, 3]),
])
def test_megatrons_valid_layouts_build_every_layer(num_layers, pp, vp, text, layers):
    stages = stage_contents(num_layers, pp, vp, layout=text)
    assert [stage.layers for stage in stages] == layers and sum(layers) == num_layers
    assert stages[0].embedding and stages[-1].loss


@pytest.mark.parametrize("num_layers, pp, vp, text, message", [
    # test_layer_builder's invalid cases
    (7, 2, 1, "tttttt|tL", "the embedding E must come once, first"),                 # no embedding
    (7, 2, 1, "Etttttt|t", "the loss L must come once, last"),                       # no loss
    (7, 2, 2, "E|ttttttt|L", "lists 3 stages, not a multiple of --pipeline-model-parallel-size 2"),  # pp size
    (7, 2, 1, "Etttttt|ttL", "places 8 transformer layers"),                         # too many layers
    # and ours
    (4, 2, 2, "Ettt|tL", "lists 2 stages; --pipeline-model-parallel-size 2 x 2 virtual stages per rank needs 4"),
    (4, 2, 1, "tEtt|tL", "the embedding E must come once, first"),
    (4, 2, 1, "Ettt|LtL", "the loss L must come once, last"),
    (4, 2, 1, "Ett|tLt", "the loss L must come once, last"),
    (4, 2, 1, "Ettt|mtL", "places 1 multi-token-prediction layers (m), but --mtp-num-layers is 0"),
    (4, 2, 1, "Ettx|tL", "'x' is not a layer"),
    (4, 2, 1, "E(tt|tL", "a '(' without its ')'"),
    (4, 2, 1, "Ett)|tL", "a ')' without its '('"),
    (4, 2, 1, "Et*|tL", "'*' must be followed by a repeat count"),
    (4, 2, 1, "E()*2tttt|L", "an empty group"),
])
def test_bad_layouts_are_refused_naming_why(num_layers, pp, vp, text, message):
    with pytest.raises(ValueError, match=_escaped(message)):
        stage_contents(num_layers, pp, vp, layout=text)


def test_mtp_layers_sit_with_the_loss():
    """DeepSeek-V3's recipe layout 'Et|(tt|)*30mL' (61 layers, PP 16 x VPP 2): the MTP depth on the last stage, with
    the loss; without a layout string the depths go with the loss too; an m elsewhere, or a count that is not
    --mtp-num-layers, is refused."""
    stages = stage_contents(61, 16, 2, layout="Et|(tt|)*30mL", mtp_num_layers=1)
    assert stages[-1] == _stage("mL") and sum(stage.mtp for stage in stages) == 1
    assert rank_layers(stages, 16) == [3] + [4] * 14 + [2]
    even = stage_contents(4, 2, 1, first=1, mtp_num_layers=2)
    assert [(stage.layers, stage.mtp, stage.loss) for stage in even] == [(1, 0, False), (3, 2, True)]
    with pytest.raises(ValueError, match="must share the last stage with the loss"):
        stage_contents(4, 3, 1, layout="Ettt|m|tL", mtp_num_layers=1)
    with pytest.raises(ValueError, match="places 0 multi-token-prediction layers"):
        stage_contents(4, 2, 1, layout="Ettt|tL", mtp_num_layers=1)


def _escaped(message: str) -> str:
    import re

    return re.escape(message)


# ---- the even forms ----------------------------------------------------------------------------------------------

def _megatron_layers_to_build(num_layers, pp, vp, rank, chunk, *, first=None, last=None, embedding=False,
                              loss=False):
    """get_num_layers_to_build (transformer_block.py), restated: uneven first / last ranks, or the embedding and
    the loss counted as layers of the even split (each then taken from the first / last chunk)."""
    if first is not None or last is not None:
        rest, ranks_left = num_layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
        per_rank = rest // ranks_left if ranks_left else 0
        if rank == 0 and first is not None:
            per_rank = first
        if rank == pp - 1 and last is not None:
            per_rank = last
        return per_rank // vp
    n = (num_layers + embedding + loss) // pp // vp
    n -= embedding and rank == 0 and chunk == 0
    n -= loss and rank == pp - 1 and chunk == vp - 1
    return n


@pytest.mark.parametrize("num_layers, pp, vp, flags", [
    (94, 8, 4, dict(embedding=True, loss=True)),  # Qwen3-235B: 94 + embedding + loss = 96 = 8 x 4 x 3
    (15, 4, 1, dict(embedding=True)),
    (7, 2, 2, dict(loss=True)),
    (61, 16, 1, dict(first=4, last=1)),   # 61 layers: 4 + 14 x 4 + 1
    (10, 4, 2, dict(first=2, last=4)),
    (5, 2, 1, dict(first=1)),
    (9, 3, 1, dict(last=1)),
])
def test_even_forms_give_megatrons_counts(num_layers, pp, vp, flags):
    stages = stage_contents(num_layers, pp, vp, first=flags.get("first"), last=flags.get("last"),
                            account_for_embedding=flags.get("embedding", False),
                            account_for_loss=flags.get("loss", False))
    assert len(stages) == pp * vp
    for s, stage in enumerate(stages):
        assert stage.layers == _megatron_layers_to_build(num_layers, pp, vp, s % pp, s // pp, **flags), s
        assert (stage.embedding, stage.loss) == (s == 0, s == pp * vp - 1)
    assert sum(stage.layers for stage in stages) == num_layers


def test_qwen3_235b_split():
    stages = stage_contents(94, 8, 4, account_for_embedding=True, account_for_loss=True)
    assert describe(stages[0]) == "E,t*2" and describe(stages[-1]) == "t*2,L"
    assert all(describe(stage) == "t*3" for stage in stages[1:-1])
    assert rank_layers(stages, 8) == [11] + [12] * 6 + [11]


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=95, pp=8, vp=4, account_for_embedding=True, account_for_loss=True), "do not split evenly"),
    (dict(num_layers=8, pp=4, vp=1, first=3, last=2), "do not split evenly into 2 x 1"),
    (dict(num_layers=8, pp=2, vp=1, first=3, last=3), "does not match the first / last"),
    (dict(num_layers=8, pp=4, vp=2, first=3), "does not divide into the 2 virtual stages"),
    (dict(num_layers=8, pp=4, vp=1, first=0), "must be a positive number of layers"),
    (dict(num_layers=8, pp=1, vp=1, first=4), "use --pipeline-model-parallel-size 2 or more"),
    (dict(num_layers=8, pp=4, vp=1, first=2, account_for_embedding=True), "cannot be combined with"),
    (dict(num_layers=8, pp=2, vp=1, layout="Etttt|ttttL", last=4), "cannot be combined with --decoder-last"),
])
def test_bad_even_forms_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        stage_contents(kwargs.pop("num_layers"), kwargs.pop("pp"), kwargs.pop("vp"), **kwargs)


def test_no_flag_leaves_the_partition_method():
    assert stage_contents(8, 4, 2) is None


# ---- the engine's parts, the flags, the dry run ------------------------------------------------------------------

def _held_kinds(config, parallel) -> list[list[str]]:
    items = pipeline_items(config)
    bounds = virtual_stage_bounds(config, parallel)
    return [[items[i].kind for i in range(a, b) if items[i].kind != PASS_THROUGH] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("pp, overrides, expected", [
    (2, dict(pipeline_model_parallel_layout="Ettt|tL"), [["E", "t", "t", "t"], ["t", "L"]]),
    (2, dict(pipeline_model_parallel_layout="E|tt|t|tL"), [["E"], ["t", "t"], ["t"], ["t", "L"]]),
    (2, dict(decoder_first_pipeline_num_layers=1), [["E", "t"], ["t", "t", "t", "L"]]),
    (2, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
             num_virtual_stages_per_pipeline_rank=3), [["E"], ["t"], ["t"], ["t"], ["t"], ["L"]]),
])
def test_the_engines_parts_hold_the_layout(files, pp, overrides, expected):
    rc = parse(files, num_layers=4, pipeline_model_parallel_size=pp, global_batch_size=8, **overrides)
    letter = {EMBEDDING: ["E"], TRANSFORMER: ["t"], FINAL_NORM: [], HEAD: ["L"]}  # L: the final norm and the head
    held = [[x for kind in stage for x in letter[kind]] for stage in _held_kinds(rc.model, rc.parallel)]
    assert held == expected
    assert all(stage.count(FINAL_NORM) == stage.count(HEAD) for stage in _held_kinds(rc.model, rc.parallel))


def test_without_the_flags_the_parts_are_the_partition_methods(files):
    rc = parse(files, num_layers=4, pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2)
    assert virtual_stage_bounds(rc.model, rc.parallel) == stage_bounds(rc.model, 4, "type:transformer")


def test_the_flags_parse_and_give_the_virtual_stages(files):
    rc = parse(files, num_layers=4, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|tt|t|tL")
    assert rc.parallel.num_virtual_stages_per_pipeline_rank == 2
    assert rc.parallel.pipeline_model_parallel_layout == "E|tt|t|tL"
    rc = parse(files, num_layers=4, pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split=True,
               account_for_loss_in_pipeline_split=True, num_layers_per_virtual_pipeline_stage=1)
    assert rc.parallel.num_virtual_stages_per_pipeline_rank == 3  # (4 + 2) / (2 x 1), as Megatron-LM counts
    assert [s.layers for s in rc.parallel.stage_contents(4)] == [0, 1, 1, 1, 1, 0]


@pytest.mark.parametrize("overrides, message", [
    (dict(pipeline_model_parallel_layout="Ett|tt|L"), "lists 3 stages, not a multiple of --pipeline-model-parallel"),
    (dict(pipeline_model_parallel_layout="Ettt|tL", num_virtual_stages_per_pipeline_rank=2),
     "drop --num-virtual-stages-per-pipeline-rank"),
    (dict(pipeline_model_parallel_layout="Ettt|tL", pp_partition_method="uniform"),
     "--pp-partition-method uniform would split them too"),
    (dict(pipeline_model_parallel_layout="Etttt||L|"), "pipeline rank 1 holds no layer (its stages [1, 3] are empty)"),
    (dict(pipeline_model_parallel_layout="Ettt|tL", num_layers=5), "places 4 transformer layers"),
    (dict(decoder_first_pipeline_num_layers=1, num_layers_per_virtual_pipeline_stage=1),
     "give the virtual stages as --num-virtual-stages-per-pipeline-rank"),
    (dict(pipeline_model_parallel_layout="E|tt|t|tL", global_batch_size=6), "make it a multiple of 2"),
])
def test_the_run_refuses_layouts_it_cannot_build(files, overrides, message):
    flags = dict(dict(num_layers=4, pipeline_model_parallel_size=2), **overrides)
    with pytest.raises(ValueError, match=_escaped(message)):
        parse(files, **flags)


def test_uneven_interleaving_needs_no_equal_chunks(files):
    """The interleaved schedule's equal-chunk rule is the even split's: a layout places the chunks itself."""
    rc = parse(files, num_layers=5, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|t|tL")
    assert rc.parallel.num_virtual_stages_per_pipeline_rank == 2
    assert rank_layers(rc.parallel.stage_contents(5), 2) == [2, 3]
    # Megatron-LM's 'Empty stage' case runs too: rank 0's second chunk is empty, its first holds the embedding
    rc = parse(files, num_layers=7, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|ttttttt||L")
    assert rank_layers(rc.parallel.stage_contents(7), 2) == [0, 7]


def test_dry_run_reports_the_layouts_stages_to_the_planner(tokenizer_files):
    argv = tiny_config_argv(tokenizer_files, num_layers=5, pipeline_model_parallel_size=2,
                            pipeline_model_parallel_layout="E|tt|t|ttL") + ["--dry-run", "--world-size", "2"]
    report = build_report(argv)
    assert report["ok"], report["problems"]
    layout = report["layout"]
    assert layout["pipeline_layout"] == ["E", "t*2", "t", "t*2,L"]
    assert [s["num_transformer_layers"] for s in layout["stages"]] == [1, 4]
    assert [[c["num_transformer_layers"] for c in s["chunks"]] for s in layout["stages"]] == [[0, 1], [2, 2]]
    assert [[c["transformer_layers"] for c in s["chunks"]] for s in layout["stages"]] == [[None, [2, 2]],
                                                                                         [[0, 1], [3, 4]]]
    assert layout["stages"][0]["holds"] == ["embedding"] and layout["stages"][1]["holds"] == ["final_layernorm", "head"]
    text = render(report)
    assert "placed by the pipeline layout flags" in text and "layout     E | t*2 | t | t*2,L" in text
    # the planner's memory, step and schedule sections count the stages' layers: two spellings of 1 + 4 layers
    # plan alike, 3 + 2 layers otherwise (the first stage's activations, the bubble's slowest stage)
    def planned(**flags):
        argv = tiny_config_argv(tokenizer_files, num_layers=5, pipeline_model_parallel_size=2, **flags)
        out = build_report(argv + ["--dry-run", "--world-size", "2"])
        assert out["ok"], out["problems"]
        return out

    one_four, first_one, three_two = (planned(pipeline_model_parallel_layout="Et|ttttL"),
                                      planned(decoder_first_pipeline_num_layers=1),
                                      planned(pipeline_model_parallel_layout="Ettt|ttL"))
    assert [s["num_transformer_layers"] for s in first_one["layout"]["stages"]] == [1, 4]
    for section in ("memory", "step", "schedule"):
        assert one_four[section] == first_one[section], section
    ones, threes = one_four["schedule"]["activation_gib"], three_two["schedule"]["activation_gib"]
    assert ones[0] < threes[0] and ones[1] > threes[1], (ones, threes)


def test_a_regular_checkpoint_resumes_only_under_its_own_layout(files):
    """Which layers a rank's optimizer shard holds is the layout's: run_state.json records it, and a regular
    checkpoint resumes with its optimizer state only under the same layout (else through a universal one)."""
    from megatron.checkpoint.resume import _check_same_layout
    from megatron.checkpoint.run_state import build_run_state

    def run(**overrides):
        return parse(files, num_layers=4, pipeline_model_parallel_size=2, zero_stage=1, **overrides)

    three_one = run(pipeline_model_parallel_layout="Ettt|tL")
    saved = build_run_state(three_one, dict(iteration=5, consumed_train_samples=40, consumed_valid_samples=0))
    assert saved["parallel"]["pipeline_layout"] == "E,t*3|t,L"
    assert "pipeline_layout" not in build_run_state(run(), dict(iteration=5, consumed_train_samples=40,
                                                                consumed_valid_samples=0))["parallel"]
    _check_same_layout(three_one, "ckpt", saved)  # its own layout
    _check_same_layout(run(pipeline_model_parallel_layout="E,t*3|tL"), "ckpt", saved)  # spelled otherwise
    _check_same_layout(run(pipeline_model_parallel_layout="Et|tttL", no_load_optim=True), "ckpt", saved)  # weights
    for other, now in ((run(pipeline_model_parallel_layout="Et|tttL"), "E,t|t*3,L"),
                       (run(), "--pp-partition-method's split")):
        with pytest.raises(ValueError, match=_escaped(f"pipeline layout E,t*3|t,L (this run: {now})")) as refused:
            _check_same_layout(other, "ckpt", saved)
        assert "ds_to_universal.py" in str(refused.value)


def test_dry_run_of_qwen3_235bs_split(tokenizer_files):
    """Qwen3-235B's pipeline (94 layers, PP 8, 3 layers per virtual stage counting the embedding and the loss:
    v = 96 / (8 x 3) = 4) on the tiny widths: each rank's chunks and layers, and a plan for each of the 8 ranks."""
    argv = tiny_config_argv(tokenizer_files, num_layers=94, pipeline_model_parallel_size=8,
                            num_layers_per_virtual_pipeline_stage=3, account_for_embedding_in_pipeline_split=True,
                            account_for_loss_in_pipeline_split=True, global_batch_size=16)
    report = build_report(argv + ["--dry-run", "--world-size", "8"])
    assert report["ok"], report["problems"]
    stages = report["layout"]["stages"]
    assert [s["num_transformer_layers"] for s in stages] == [11] + [12] * 6 + [11]
    assert [c["num_transformer_layers"] for c in stages[0]["chunks"]] == [2, 3, 3, 3]
    assert [c["num_transformer_layers"] for c in stages[-1]["chunks"]] == [3, 3, 3, 2]
    assert stages[0]["chunks"][0]["transformer_layers"] == [0, 1] and stages[1]["chunks"][0]["transformer_layers"] == [2, 4]
    assert report["layout"]["pipeline_layout"] == ["E,t*2"] + ["t*3"] * 30 + ["t*2,L"]
    assert report["schedule"]["label"] == "interleaved 1F1B v=4" and len(report["memory"]["per_stage_gib"]) == 8
