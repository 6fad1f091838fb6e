"""Megatron's --eod-mask-loss and --reset-position-ids: what the micro-batches hold, and what the engine's loss
makes of them; --reset-attention-mask: the document mask equals Megatron-LM's loops, training with it equals one
process at every layout (context parallelism under ZB-H1 and the interleaved schedule included) and differs from the
unmasked run; refused with MTP and the flash backend, by name."""

import pytest
import torch

from megatron.arguments import run_config_from_argv
from megatron.model.attention_core import document_causal_mask
from megatron.testing import run_distributed, tiny_argv
from megatron.testing.tolerance import run_tolerance, tolerance, transformer_depth
from megatron.training.batches import gpt_micro_batch
from tests.helpers.paths import REPO_ROOT

EOD = 7


def _megatron_loops(tokens, eod):
    """Megatron-LM's get_ltor_masks_and_position_ids (loss mask and position ids), as its loops do it."""
    data = tokens[:, :-1]
    b, s = data.shape
    loss_mask = torch.ones(b, s)
    loss_mask[data == eod] = 0.0
    position_ids = torch.arange(s).repeat(b, 1)
    for row in range(b):
        previous = 0
        for i in (data[row] == eod).nonzero().flatten().tolist():
            position_ids[row, i + 1:] -= i + 1 - previous
            previous = i + 1
    return loss_mask, position_ids


def _megatron_attention_mask(tokens, eod):
    """Megatron-LM's --reset-attention-mask loop: causal, then for each eod at input position i the tokens after it
    see nothing up to and including it. [b, 1, s, s], True = attend."""
    data = tokens[:, :-1]
    b, s = data.shape
    mask = torch.ones(s, s).tril().repeat(b, 1, 1, 1).bool()
    for row in range(b):
        for i in (data[row] == eod).nonzero().flatten().tolist():
            mask[row, 0, i + 1:, :i + 1] = False
    return mask


def test_masks_and_positions_equal_megatrons_loops():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 12, (6, 41), generator=generator)  # about one token in 12 is the eod
    tokens[2] = tokens[4] = 3  # no eod at all ...
    tokens[0, 0] = tokens[1, 39] = tokens[2, 40] = EOD  # ... but as the last label; first and last inputs
    tokens[3, 5:9] = EOD  # consecutive eods: empty documents
    loss_mask, position_ids = _megatron_loops(tokens, EOD)
    (input_ids, positions), (labels, mask) = gpt_micro_batch(tokens, EOD, eod_mask_loss=True,
                                                             reset_position_ids=True)
    assert torch.equal(mask, loss_mask) and torch.equal(positions, position_ids)
    assert torch.equal(input_ids, tokens[:, :-1]) and torch.equal(labels, tokens[:, 1:])
    assert mask[2].all() and not mask[1, 39] and not mask[0, 0]  # an eod as a label is a target
    assert positions[3, 5:10].tolist() == [5, 0, 0, 0, 0] and positions[4].tolist() == list(range(40))
    (_, _, documents), _ = gpt_micro_batch(tokens, EOD, reset_attention_mask=True)
    assert torch.equal(document_causal_mask(documents, None, torch.float32), _megatron_attention_mask(tokens, EOD))

    (_, plain_positions), (_, plain_mask) = gpt_micro_batch(tokens)
    assert plain_mask.all() and torch.equal(plain_positions, torch.arange(40).repeat(6, 1))
    (_, only_positions), (_, only_mask) = gpt_micro_batch(tokens, EOD, reset_position_ids=True)
    assert only_mask.all() and torch.equal(only_positions, position_ids)
    with pytest.raises(ValueError, match="need the end-of-document token id"):
        gpt_micro_batch(tokens, eod_mask_loss=True)


def test_refusals_name_the_flag(tiny_corpus):
    rc = run_config_from_argv(tiny_argv(tiny_corpus, reset_attention_mask=True), world_size=1)
    assert rc.data.reset_attention_mask and rc.data.eod_token_id is not None
    with pytest.raises(ValueError, match="--reset-attention-mask does not work yet with --mtp-num-layers 1"):
        run_config_from_argv(tiny_argv(tiny_corpus, reset_attention_mask=True, mtp_num_layers=1,
                                       embed_layernorm=False), world_size=1)
    with pytest.raises(ValueError, match="--reset-position-ids .* --position-embedding-type alibi"):
        run_config_from_argv(tiny_argv(tiny_corpus, reset_position_ids=True), world_size=1)
    rc = run_config_from_argv(tiny_argv(tiny_corpus, eod_mask_loss=True), world_size=1)
    from megatron.data.tokenizers import build_tokenizer

    assert rc.data.eod_token_id == build_tokenizer(rc.data.tokenizer).eod
    assert run_config_from_argv(tiny_argv(tiny_corpus), world_size=1).data.eod_token_id is None


def _engine_loss_and_reference(rank, world_size, argv):
    """The pipeline engine's loss on the run's first micro-batch, and the same weights' loss computed here
    as a plain GPTModel on positions and a mask made by Megatron's loops from the tokens."""
    from megatron.engine.initialize import build_engine, init_deepspeed_comm
    from megatron.model import GPTModel
    from megatron.model.layout import model_name
    from megatron.parallel.state import ParallelState
    from megatron.training.data_iterators import build_datasets, micro_batch_iterator
    from megatron.training.pretrain import set_seeds

    rc = run_config_from_argv(argv, world_size=1)
    init_deepspeed_comm("gloo")
    state = ParallelState.create(1, 1)
    engine = build_engine(rc, state, tracker=set_seeds(rc.training.seed, state))
    batch = next(micro_batch_iterator(build_datasets(rc).train, rc, consumed_samples=0, dp_rank=0, dp_size=1,
                                      num_workers=0))
    engine_loss = float(engine.eval_batch(iter([batch])))

    (input_ids, _), (labels, _) = batch
    tokens = torch.cat([input_ids, labels[:, -1:]], dim=1)  # [b, s + 1]
    loss_mask, position_ids = _megatron_loops(tokens, rc.data.eod_token_id)
    model = GPTModel(rc.model, state)
    model.load_state_dict({model_name(k, rc.model): v for k, v in engine.module.state_dict().items()})
    model.eval()
    with torch.no_grad():
        per_token = model(input_ids, position_ids, labels=labels)  # [b, s]
        plain = model(input_ids, labels=labels).mean()
    reference = float((per_token * loss_mask).sum() / loss_mask.sum())
    return engine_loss, reference, float(plain), int((input_ids == rc.data.eod_token_id).sum())


def _one_process(rank, world_size, argv, runs):
    """The one-process launch: ``train``'s records of ``runs``, then ``_engine_loss_and_reference(argv)``."""
    from tests.helpers.training import train

    return train(rank, world_size, runs), _engine_loss_and_reference(rank, world_size, argv)


# --reset-attention-mask with --eod-mask-loss on the tiny model with rotary positions and 2 query groups, 64 tokens a
# sample (about one end of document in every 80 tokens of the tiny corpus). Rotary, not the tiny model's ALiBi: ALiBi's
# slopes leave little weight on the previous document at initialization (the masked and unmasked runs' first losses
# then lie within the tolerance); with rotary they differ by 15 times it.
MASKED = dict(seq_length=64, reset_attention_mask=True, eod_mask_loss=True, position_embedding_type="rotary",
              embed_layernorm=False, group_query_attention=True, num_query_groups=2)
# the layouts that must train as one process does, on 4 processes: CP = 2 x TP = 2 with sequence parallelism (the
# ring's document blocks), Ulysses = 2 (DP = 2; the whole sample's ids after the all-to-all), PP = 2 (DP = 2; the
# ids travel between the stages with the hidden state) under 1F1B, ZB-H1 and the interleaved schedule (v = 2, on a
# 4-layer model: its own one-process reference), ZeRO-2 at DP = 4; and CP = 2 x PP = 2 under ZB-H1 (the ring's
# backward in the B passes, the weight passes deferred) and the interleaved schedule (each chunk's ring on its own
# micro-batch order, the same on both CP ranks of a stage).
PP2 = ("--pipeline-model-parallel-size", 2)
CP2 = ("--context-parallel-size", 2)
ZBH1 = ("--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics")
INTERLEAVED = ("--num-virtual-stages-per-pipeline-rank", 2, "--num-layers", 4)
# the live lm-eval harness during the PP=2 run (its batches must carry document ids too: the stages' activations keep
# their recorded form); it leaves the training losses as they are (tests/evaluation/test_harness_parity.py)
HARNESS = ("--eval-harness-tasks", "tiny_choice", "--eval-harness-include-path", REPO_ROOT / "examples" / "eval_tasks",
           "--eval-harness-limit", 4, "--eval-harness-interval", 5)
LAYOUTS = {"CP=2 x TP=2 + SP": ("--context-parallel-size", 2, "--tensor-model-parallel-size", 2, "--sequence-parallel"),
           "Ulysses=2": ("--ds-sequence-parallel-size", 2), "PP=2 + live lm-eval": PP2 + HARNESS,
           "PP=2 ZB-H1": PP2 + ZBH1, "PP=2 x v=2 interleaved": PP2 + INTERLEAVED,
           # DeepSpeed's model engine without Ulysses (GPTModel's document_ids), its layers recomputed in backward
           "ZeRO-2 DP=4 + recomputed layers": ("--zero-stage", 2, "--checkpoint-activations"),
           "CP=2 x PP=2 ZB-H1": CP2 + PP2 + ZBH1, "CP=2 x PP=2 x v=2 interleaved": CP2 + PP2 + INTERLEAVED}


@pytest.fixture(scope="module")
def one_process(tiny_corpus):
    """One launch of one process: the masked and the unmasked (whole-sample causal) runs of MASKED, and the
    engine-loss check's numbers (test_the_engine_loss_uses_the_mask_and_positions)."""
    argv = tiny_argv(tiny_corpus, seq_length=128, micro_batch_size=4, global_batch_size=4, eod_mask_loss=True,
                     reset_position_ids=True, position_embedding_type="absolute", embed_layernorm=False)
    runs = [tiny_argv(tiny_corpus, **MASKED), tiny_argv(tiny_corpus, **dict(MASKED, reset_attention_mask=False)),
            tiny_argv(tiny_corpus, **dict(MASKED, num_layers=4))]
    return run_distributed(_one_process, world_size=1, args=(argv, runs))[0]


@pytest.mark.multiprocess
def test_document_masks_train_equal_at_every_layout(tiny_corpus, one_process):
    from tests.helpers.training import TINY_LAYERS, TINY_WIDTH, assert_same_run, layout, train

    (masked, unmasked, four_layers), _ = one_process
    runs = [layout(tiny_argv(tiny_corpus, **MASKED), *flags) for flags in LAYOUTS.values()]
    results = run_distributed(train, world_size=4, args=(runs,), timeout=600)
    assert len(masked["losses"]) == 10
    for label, record in zip(LAYOUTS, results[0]):
        reference = four_layers if "--num-layers" in LAYOUTS[label] else masked
        assert_same_run(reference, record, f"--reset-attention-mask at {label} vs one process",
                        num_layers=4 if reference is four_layers else TINY_LAYERS)
    labels = list(LAYOUTS)
    for rank in range(4):  # ZB-H1's steps; the interleaved runs hold 2 chunks x 1 layer
        records = dict(zip(labels, results[rank]))
        assert records["PP=2 ZB-H1"]["executed_steps"] and records["CP=2 x PP=2 ZB-H1"]["executed_steps"], rank
        assert records["PP=2 x v=2 interleaved"]["held_layers"] == 2, rank
        assert records["CP=2 x PP=2 x v=2 interleaved"]["held_layers"] == 2, rank
        for label in ("CP=2 x PP=2 ZB-H1", "CP=2 x PP=2 x v=2 interleaved"):  # every rank: each CP rank's ring
            assert_same_run(four_layers if "--num-layers" in LAYOUTS[label] else masked, records[label],
                            f"rank {rank}: --reset-attention-mask at {label} vs one process",
                            num_layers=4 if "--num-layers" in LAYOUTS[label] else TINY_LAYERS)
    # the mask is what the runs agree on: the whole-sample causal run differs, by 10 tolerances at the first step
    first, other = masked["losses"][0], unmasked["losses"][0]
    bound = run_tolerance(torch.float32, TINY_LAYERS, TINY_WIDTH, 1)
    assert abs(first - other) > 10 * bound * abs(first)
    # and so do the masked CP x ZB-H1 run's (the same 2-layer model): the ring applied the documents
    assert abs(results[0][labels.index("CP=2 x PP=2 ZB-H1")]["losses"][0] - other) > 9 * bound * abs(first)


@pytest.mark.multiprocess
def test_the_engine_loss_uses_the_mask_and_positions(one_process):
    engine_loss, reference, plain, eods = one_process[1]
    assert eods >= 2, "the samples should hold documents ends"
    # Two computations of one forward: the model's 27 roundings and the masked mean, summing over the 512 rows
    # of the vocabulary and the 4 x 128 tokens.
    bound = tolerance(torch.float32, transformer_depth(2) + 1, 512, scale=reference)
    assert abs(engine_loss - reference) <= bound, (engine_loss, reference)
    assert abs(plain - reference) > 10 * bound  # what the flags change is visible at this tolerance
