"""Sequence parallelism (--sequence-parallel) changes where tokens live, not the math.

On a 2-rank gloo TP group: one TransformerLayer fed this rank's [s/tp, b, h] shard gives exactly the
shard of the full layer's output and the same input and parameter gradients; whole GPT, BLOOM and
Llama models give the same loss and the same gradient of every parameter as without sequence
parallelism (a norm or row-parallel bias whose gradient were not summed over the TP group would hold
half of it). Outputs, losses, input gradients and the matrices' gradients are bit for bit the same (at TP = 2
the same products run on the same gathered tensors, and a reduce-scatter of two partial sums adds the same two
numbers as the all-reduce); the gradients of the sequence-parallel parameters (norms, row-parallel biases) sum
each rank's tokens first, so they agree within the tolerance of that split sum. Dropout on a shard differs
across TP ranks; decoding refuses a sequence-parallel model.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.model import GPTModel, TransformerLayer
from megatron.model.transformer import sequence_parallel_dropout
from megatron.parallel.random import RNGStatesTracker, model_parallel_rng_seed
from megatron.parallel.state import LayerGroups, ParallelState, group_layout, group_rank
from megatron.testing.tolerance import tolerance
from tests.helpers.parallel import randn, rel_err, run_on_tp

S, B, H = 8, 2, 32
# A sequence-parallel parameter's gradient: the same per-token terms, summed over each rank's tokens and then
# over the two ranks instead of over all S x B tokens at once (depth 2), relative to its largest entry.
SPLIT_SUM_RTOL = tolerance(torch.float32, 2, S * B)
BASE = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, padded_vocab_size=64, seq_length=S,
                   hidden_dropout=0.0, attention_dropout=0.0)
VARIANTS = {
    "gpt": dict(position_embedding_type="absolute"),
    "bloom": dict(position_embedding_type="alibi", embed_layernorm=True),
    "llama": dict(position_embedding_type="rotary", normalization="rmsnorm", swiglu=True, ffn_hidden_size=64,
                  num_key_value_heads=2, add_bias_linear=False, untie_embeddings_and_output_weights=True),
}


def _shard(x: torch.Tensor, tp_group) -> torch.Tensor:
    chunk = x.shape[0] // 2
    return x[group_rank(tp_group) * chunk:(group_rank(tp_group) + 1) * chunk]  # [s/tp, b, h]


def _layer_worker(tp_group):
    """One layer with and without sequence parallelism: output shard, input and parameter gradients."""
    x = randn(S, B, H, seed=1)  # [s, b, h], the same on both ranks
    upstream = randn(S, B, H, seed=2)
    full = TransformerLayer(BASE, LayerGroups(tp=tp_group))
    x_full = x.clone().requires_grad_(True)
    out_full = full(x_full)
    (out_full * upstream).sum().backward()

    sp = TransformerLayer(dataclasses.replace(BASE, sequence_parallel=True), LayerGroups(tp=tp_group))
    x_shard = _shard(x, tp_group).clone().requires_grad_(True)
    out_shard = sp(x_shard)  # [s/tp, b, h]
    # the objective is the sum over ranks of each rank's tokens: the same total as the full layer's
    (out_shard * _shard(upstream, tp_group)).sum().backward()
    grads = {name: (rel_err(p_sp.grad, p_full.grad), getattr(p_sp, "sequence_parallel", False))
             for (name, p_full), (_, p_sp) in zip(full.named_parameters(), sp.named_parameters())}
    tagged = sorted(name for name, p in sp.named_parameters() if getattr(p, "sequence_parallel", False))
    untagged_full = [name for name, p in full.named_parameters() if getattr(p, "sequence_parallel", False)]
    return {"shape": list(out_shard.shape), "out": rel_err(out_shard, _shard(out_full, tp_group)),
            "x_grad": rel_err(x_shard.grad, _shard(x_full.grad, tp_group)), "grads": grads, "tagged": tagged,
            "tagged_without_sp": untagged_full}


def test_transformer_layer_on_a_sequence_shard_equals_the_full_layer():
    for rank, r in enumerate(run_on_tp(_layer_worker, 2)):
        assert r["shape"] == [S // 2, B, H], (rank, r["shape"])
        assert r["out"] == 0.0 and r["x_grad"] == 0.0, (rank, r["out"], r["x_grad"])  # exact: module docstring
        _assert_gradients(r["grads"], f"rank {rank}")
        assert r["tagged"] == ["input_layernorm.bias", "input_layernorm.weight", "mlp.dense_4h_to_h.bias",
                               "post_attention_layernorm.bias", "post_attention_layernorm.weight",
                               "self_attention.dense.bias"], r["tagged"]
        assert r["tagged_without_sp"] == []


def _assert_gradients(grads: dict, where: str) -> None:
    """{name: (relative error, sequence-parallel parameter)}: exact, or within the split sum's tolerance."""
    for name, (err, split_sum) in grads.items():
        if split_sum:
            assert err <= SPLIT_SUM_RTOL, f"{where}: gradient of {name} off by {err}"
        else:
            assert err == 0.0, f"{where}: gradient of {name} off by {err}"


def _state(tp_group) -> ParallelState:
    """The TP=2 ParallelState of run_on_tp's group, for GPTModel."""
    return ParallelState(layout=group_layout(2, 1, 1), rank=dist.get_rank(), tp_group=tp_group)


def _models_worker(tp_group):
    """Per variant: the loss and every parameter's gradient with and without sequence parallelism."""
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(4))
    mask = (torch.arange(S) % 3 != 0).float().expand(B, S)
    results = {}
    for variant, fields in VARIANTS.items():
        out = {}
        for sp in (False, True):
            model = GPTModel(dataclasses.replace(BASE, sequence_parallel=sp, **fields), _state(tp_group))
            loss = model(ids, labels=labels, loss_mask=mask)
            loss.backward()
            out[sp] = (loss.item(), dict(model.named_parameters()))
        with_sp = out[True][1]
        results[variant] = {"loss": (out[False][0], out[True][0]),
                            "grads": {name: (rel_err(with_sp[name].grad, p.grad),
                                             getattr(with_sp[name], "sequence_parallel", False))
                                      for name, p in out[False][1].items()}}
    return results


@pytest.fixture(scope="module")
def sp_models():
    return run_on_tp(_models_worker, 2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_whole_models_match_without_sequence_parallelism(variant, sp_models):
    for rank, per_variant in enumerate(sp_models):
        r = per_variant[variant]
        plain, sp = r["loss"]
        assert plain == sp, (rank, variant, plain, sp)  # exact: module docstring
        _assert_gradients(r["grads"], f"rank {rank} {variant}")


def _dropout_worker(tp_group):
    tracker = model_parallel_rng_seed(7, group_rank(tp_group), RNGStatesTracker("cpu"))
    x = torch.ones(4, 2, 8)
    shard = sequence_parallel_dropout(x, 0.5, True, tracker)
    torch.manual_seed(7)
    replicated = torch.nn.functional.dropout(x, 0.5, training=True)
    return {"shard": shard, "replicated": replicated}


def test_shard_dropout_differs_across_tp_ranks():
    a, b = run_on_tp(_dropout_worker, 2)
    assert a["shard"] != b["shard"], "both TP ranks drew the same dropout mask for different tokens"
    assert a["replicated"] == b["replicated"]  # the default stream: the same on every TP rank


def _refusals_worker(tp_group):
    errors = {}
    config = dataclasses.replace(BASE, sequence_parallel=True, hidden_dropout=0.1)
    try:
        TransformerLayer(config, LayerGroups(tp=tp_group))
    except ValueError as error:
        errors["no tracker"] = str(error)
    model = GPTModel(dataclasses.replace(BASE, sequence_parallel=True), _state(tp_group))
    try:
        model(torch.zeros(1, 1, dtype=torch.long), kv_caches=model.new_kv_caches())
    except ValueError as error:
        errors["decode"] = str(error)
    return errors


def test_dropout_without_tracker_and_decoding_are_refused():
    errors = run_on_tp(_refusals_worker, 2)[0]
    assert "RNG tracker" in errors["no tracker"], errors
    assert "sequence_parallel=False" in errors["decode"], errors
    with pytest.raises(ValueError, match="multiple of 2"):
        dataclasses.replace(BASE, seq_length=9, sequence_parallel=True).validate(2)
