"""A checkpoint in BLOOM's layout written the way Megatron-DeepSpeed writes one (no run_state.json, no
completion marker, Megatron's args; built from transformers' Bloom weights by tests/helpers/megatron_deepspeed.py,
not by our writer): the single-process reader merges it into exactly those weights, and training
continues from it at TP=2, PP=2, its first loss the one transformers' model gives the same batch (within the
tolerance of the model's depth: the split products sum in another order)."""

import math

import pytest
import torch

from megatron.testing import DistributedTestError, run_distributed, tiny_argv
from megatron.testing.tolerance import model_tolerance, tolerance
from tests.helpers.megatron_deepspeed import write_bloom_checkpoint
from tests.helpers.training import pretrain_error, train

VOCAB, PADDED, HIDDEN, HEADS, LAYERS, SEQ = 400, 512, 64, 4, 2, 32


@pytest.fixture(scope="module")
def bloom():
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                         hidden_dropout=0.0, attention_dropout=0.0, initializer_range=0.3)).eval()
    with torch.no_grad():  # LayerNorms and biases away from 1 / 0 too, so a misplaced one shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _megatron_checkpoint(bloom, out_dir):
    state = bloom.transformer.state_dict()
    write_bloom_checkpoint(state, str(out_dir), num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS,
                           padded_vocab=PADDED, seq_length=SEQ, tp=2, pp=2)
    return state


def test_the_reader_merges_it_into_transformers_weights(bloom, tmp_path):
    from megatron.checkpoint.hf.bloom import ours_to_bloom_state_dict
    from megatron.checkpoint.single_process import load_full_state_dict

    original = _megatron_checkpoint(bloom, tmp_path)
    with pytest.warns(UserWarning, match="not written by this project"):
        config, state, record = load_full_state_dict(str(tmp_path))
    assert (config.num_layers, config.padded_vocab_size, config.position_embedding_type) == (LAYERS, PADDED, "alibi")
    assert record["progress"]["iteration"] == 100 and record["written_by"] == "Megatron-DeepSpeed"
    back = ours_to_bloom_state_dict(state, config, vocab_size=VOCAB, with_lm_head=False)
    assert sorted(back) == sorted("transformer." + k for k in original)
    for name, tensor in original.items():
        assert torch.equal(back["transformer." + name], tensor), name


@pytest.mark.multiprocess
def test_training_continues_from_it(bloom, tiny_corpus, tmp_path):
    from megatron.arguments import run_config_from_argv
    from megatron.training.data_iterators import build_datasets

    _megatron_checkpoint(bloom, tmp_path / "ckpt")
    common = dict(train_iters=2, lr_warmup_iters=1, load=str(tmp_path / "ckpt"), tensor_model_parallel_size=2,
                  pipeline_model_parallel_size=2)
    runs = [tiny_argv(tiny_corpus, **common), tiny_argv(tiny_corpus, finetune=True, **common)]
    refused = run_distributed(pretrain_error, world_size=4, args=(runs[0],), env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert refused[0] and "--finetune" in refused[0], refused[0]  # no progress of ours to resume: says what to pass
    results = run_distributed(train, world_size=4, args=([runs[1]],), env={"OMP_NUM_THREADS": "1"}, timeout=600)
    history = [(iteration, loss) for iteration, loss, *_ in results[-1][0]["history"]]
    assert [i for i, _ in history] == [1, 2] and all(math.isfinite(loss) for _, loss in history)
    # The first loss is the loaded model's on samples 0..7, before any update: transformers' Bloom with
    # the same weights (and the 112 zero padding rows' logits) gives it.
    rc = run_config_from_argv(runs[1], world_size=4)
    train_set = build_datasets(rc).train
    tokens = torch.stack([torch.from_numpy(train_set[i]["text"]) for i in range(8)])  # [8, s + 1]
    with torch.no_grad():
        logits = bloom(tokens[:, :-1]).logits  # [8, s, v]
    padded = torch.cat((logits, torch.zeros(8, SEQ, PADDED - VOCAB)), dim=-1)
    expected = torch.nn.functional.cross_entropy(padded.reshape(-1, PADDED), tokens[:, 1:].reshape(-1)).item()
    # A token's loss moves by at most twice its logits' difference (the model's depth, fp32); the cross entropy's own
    # shift, exp, sum over the padded vocabulary and log, and the mean's product, sum and division (depth 7) add theirs.
    bound = 2 * model_tolerance(rc.model, torch.float32, logits) + tolerance(torch.float32, 7, PADDED, expected)
    loss_diff = abs(history[0][1] - expected)
    assert loss_diff <= bound, (history[0][1], expected)


class _Payload:
    """Unpickling this runs its ``__reduce__`` callable: it would create ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.multiprocess
def test_load_through_deepspeed_never_runs_code_in_a_checkpoint(bloom, tiny_corpus, tmp_path):
    """DeepSpeed's own loader unpickles anything; ours (megatron.engine.checkpoint_engine) refuses the file."""
    _megatron_checkpoint(bloom, tmp_path / "ckpt")
    # A layer file: only DeepSpeed's load reads it (our record comes from the mp_rank files).
    layer = tmp_path / "ckpt" / "global_step100" / "layer_03-model_00-model_states.pt"
    marker = tmp_path / "payload_ran"
    torch.save(dict(torch.load(layer, weights_only=True), extra=_Payload(str(marker))), layer)
    argv = tiny_argv(tiny_corpus, train_iters=2, lr_warmup_iters=1, load=str(tmp_path / "ckpt"), finetune=True,
                     tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    # The rank reading that file fails (CheckpointFormatError); the others then stop waiting for it.
    with pytest.raises(DistributedTestError) as info:
        run_distributed(train, world_size=4, args=([argv],), env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert "CheckpointFormatError" in str(info.value) and "layer_03-model_00-model_states.pt" in str(info.value)
    assert "weights_only=True" in str(info.value)
    assert not marker.exists()
