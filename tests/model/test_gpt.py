"""GPTModel on one process: causality, init independence, KV cache, bf16, training, loss definition."""

import pytest
import torch
import torch.nn.functional as F

from megatron.model import EmbeddingLayer, GPTModel, TransformerLayer, gpt_loss
from megatron.parallel.random import RNGStatesTracker
from megatron.testing.tolerance import model_tolerance, tolerance
from tests.helpers.model import POSITION_TYPES, tiny_config


def _ids(b=2, s=16, seed=0):
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("position_type", POSITION_TYPES)
def test_changing_a_token_changes_no_earlier_logit(position_type):
    model = GPTModel(tiny_config(position_embedding_type=position_type)).eval()
    ids = _ids()
    changed = ids.clone()
    changed[:, 9] = (ids[:, 9] + 1) % 256
    with torch.no_grad():
        before, after = model(ids), model(changed)  # [s, b, v]
    assert torch.equal(before[:9], after[:9]), (before[:9] - after[:9]).abs().max()
    assert (before[9:] - after[9:]).abs().amax(dim=(1, 2)).min().item() > 1e-6  # every later position moves


@pytest.mark.parametrize("position_type", POSITION_TYPES)
def test_the_order_of_earlier_tokens_matters(position_type):
    # Without position information causal attention is blind to the order of the earlier tokens.
    model = GPTModel(tiny_config(position_embedding_type=position_type)).eval()
    ids = _ids()
    swapped = ids.clone()
    swapped[:, [2, 5]] = ids[:, [5, 2]]
    with torch.no_grad():
        diff = (model(ids)[10] - model(swapped)[10]).abs().max().item()
    assert diff > 1e-4, diff


def test_layer_weights_depend_only_on_seed_and_layer_number():
    config = tiny_config(num_layers=4)
    full = GPTModel(config)
    # A pipeline stage holding layers 2..3 only, built in another order after other draws.
    torch.manual_seed(999)
    stage = [TransformerLayer(config, None, 3), TransformerLayer(config, None, 2)]
    for layer in stage:
        expected = full.layers[layer.layer_number].state_dict()
        got = layer.state_dict()
        assert sorted(got) == sorted(expected)
        for name in expected:
            assert torch.equal(got[name], expected[name]), (layer.layer_number, name)
    embedding = EmbeddingLayer(config)
    assert torch.equal(embedding.word_embeddings.weight, full.embedding.word_embeddings.weight)
    # Different layers and different seeds really differ.
    qkv = lambda m: m.self_attention.query_key_value.weight  # noqa: E731
    assert not torch.equal(qkv(full.layers[0]), qkv(full.layers[1]))
    assert not torch.equal(qkv(TransformerLayer(tiny_config(num_layers=4, seed=7), None, 2)), qkv(stage[1]))


def test_initial_statistics():
    config = tiny_config(num_layers=2, hidden_size=64, init_method_std=0.02)
    layer = GPTModel(config).layers[0]
    assert layer.self_attention.query_key_value.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.mlp.dense_4h_to_h.weight.std().item() == pytest.approx(0.02 / 2.0, rel=0.05)  # / sqrt(2 * 2)
    assert layer.self_attention.dense.weight.std().item() == pytest.approx(0.01, rel=0.1)
    for name, param in layer.named_parameters():
        if name.endswith("bias"):
            assert param.abs().max().item() == 0.0, name
    assert torch.equal(layer.input_layernorm.weight, torch.ones(64))


def test_layer_number_out_of_range_names_the_values():
    with pytest.raises(ValueError, match="layer_number 2 .* num_layers 2"):
        TransformerLayer(tiny_config(), None, 2)


@pytest.mark.parametrize("position_type", POSITION_TYPES)
def test_kv_cache_decoding_equals_full_forward(position_type):
    model = GPTModel(tiny_config(position_embedding_type=position_type)).eval()
    ids = _ids(s=12)
    with torch.no_grad():
        full = model(ids)  # [s, b, v]
        caches = model.new_kv_caches()
        prompt = model(ids[:, :5], kv_caches=caches)  # several tokens at once into an empty cache
        steps = [prompt[-1]]
        # Two tokens at once after the prompt (an explicit offset mask), then one by one.
        steps.append(model(ids[:, 5:7], kv_caches=caches)[-1])
        for i in range(7, 12):
            steps.append(model(ids[:, i:i + 1], kv_caches=caches)[-1])
    assert caches[0].length == 12 and caches[1].key.shape == (12, 2, 4, 16)
    expected = torch.stack([full[4], full[6]] + [full[i] for i in range(7, 12)])
    max_diff = (torch.stack(steps) - expected).abs().max().item()
    assert max_diff <= model_tolerance(model.config, torch.float32, expected), max_diff


def test_bf16_forward_stays_close_to_fp32():
    ids = _ids()
    fp32 = GPTModel(tiny_config(position_embedding_type="alibi", embed_layernorm=True)).eval()
    bf16 = GPTModel(tiny_config(position_embedding_type="alibi", embed_layernorm=True, params_dtype="bf16")).eval()
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        expected, got = fp32(ids), bf16(ids)
        loss32 = fp32(ids, labels=ids, loss_mask=torch.ones_like(ids))
        loss16 = bf16(ids, labels=ids, loss_mask=torch.ones_like(ids))
    assert got.dtype == torch.bfloat16
    # The same weights (initialized in fp32, then cast): bf16 rounds every operation of the model's depth.
    bound = model_tolerance(fp32.config, torch.bfloat16, expected)
    diff = (got.float() - expected).abs().max().item()
    assert diff <= bound, diff
    # A token's loss (log-sum-exp minus the label's logit) moves by at most twice its logits' difference; so does
    # their mean.
    assert loss16.dtype == torch.float32, loss16.dtype
    loss_diff = abs(loss16.item() - loss32.item())
    assert loss_diff <= 2 * bound, (loss16, loss32)


@pytest.mark.parametrize("position_type", POSITION_TYPES)
def test_tiny_model_overfits_a_fixed_batch(position_type):
    torch.manual_seed(0)
    model = GPTModel(tiny_config(position_embedding_type=position_type, hidden_dropout=0.1)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    ids = _ids(b=4, s=17, seed=3)
    inputs, labels, mask = ids[:, :-1], ids[:, 1:], torch.ones(4, 16)
    losses = []
    for _ in range(30):
        loss = model(inputs, labels=labels, loss_mask=mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.3)
    assert losses[-1] < 0.5 * losses[0], losses


def test_gpt_loss_is_the_masked_mean_of_token_losses():
    model = GPTModel(tiny_config()).eval()
    ids, labels = _ids(), _ids(seed=1)
    mask = torch.ones(2, 16)
    mask[0, 10:] = 0.0
    mask[1, :3] = 0.0
    with torch.no_grad():
        logits = model(ids)  # [s, b, v]
        per_token = model(ids, labels=labels)  # [b, s]
        loss = model(ids, labels=labels, loss_mask=mask)
    reference = F.cross_entropy(logits.transpose(0, 1).reshape(-1, 256), labels.reshape(-1), reduction="none")
    reference = reference.view(2, 16)
    # Our vocab-parallel cross entropy against torch's on the same logits (the forward is the same function run
    # twice: the same logits): the shift by the max, exp, the sum over the vocabulary, the log: depth 4, width 256.
    scale = reference.abs().max().item()
    per_token_diff = (per_token - reference).abs().max().item()
    assert per_token_diff <= tolerance(torch.float32, 4, 256, scale), per_token_diff
    # ... and the masked mean: the mask's product, the sum over the tokens, the division.
    expected = (reference * mask).sum() / mask.sum()
    for got in (loss, gpt_loss(logits, labels, mask)):
        loss_diff = (got - expected).abs().item()
        assert loss_diff <= tolerance(torch.float32, 7, 256, scale), loss_diff
    assert gpt_loss(logits, labels, torch.zeros(2, 16)).item() == 0.0
    with pytest.raises(ValueError, match=r"labels must be \[b, s\]"):
        gpt_loss(logits, labels.t(), mask)


def test_output_head_is_tied_to_the_word_embedding():
    model = GPTModel(tiny_config())
    hidden = torch.randn(3, 2, 64)  # [s, b, h]
    logits = model.embedding.lm_logits(hidden)
    expected = hidden @ model.embedding.word_embeddings.weight.t()
    # F.linear against a plain matmul: one product summing over h.
    diff = (logits - expected).abs().max().item()
    assert diff <= tolerance(torch.float32, 1, 64, expected.abs().max().item()), diff
    names = [name for name, _ in model.named_parameters()]
    assert sum("word_embeddings" in name for name in names) == 1 and not any("lm_head" in n for n in names)


def test_attention_dropout_draws_from_the_tracker_not_the_default_rng():
    config = tiny_config(attention_dropout=0.5)
    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 4321)
    layer = TransformerLayer(config, None, 0, rng_tracker=tracker).train()
    hidden = torch.randn(8, 2, 64)
    default_before = torch.get_rng_state()
    tracked_before = tracker.get_states()["model-parallel-rng"]
    out1 = layer(hidden)
    assert torch.equal(torch.get_rng_state(), default_before)
    assert not torch.equal(tracker.get_states()["model-parallel-rng"], tracked_before)
    tracker.set_states({"model-parallel-rng": tracked_before})
    assert torch.equal(layer(hidden), out1)  # same tracked state, same dropout mask
    assert not torch.equal(layer.eval()(hidden), out1)


@pytest.mark.parametrize("num_layers,chunk", [(3, 1), (3, 2)])
def test_recomputed_layers_give_the_same_loss_and_gradients(num_layers, chunk):
    """GPTModel.recompute_activations (the ZeRO-2/3 path's --checkpoint-activations): every run of ``chunk``
    layers goes through the checkpoint function once per forward, and nothing changes numerically."""
    from megatron.parallel.random import tracked_checkpoint_func

    config = tiny_config(num_layers=num_layers)
    plain, recomputed = GPTModel(config), GPTModel(config)
    calls = []
    checkpoint = tracked_checkpoint_func(None)
    recomputed.recompute_activations(lambda fn, x: calls.append(1) or checkpoint(fn, x), chunk)
    ids = _ids()
    mask = torch.ones(ids.shape)
    grads = []
    for model in (plain, recomputed):
        model.train()
        loss = model(ids, labels=ids, loss_mask=mask)
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(calls) == -(-num_layers // chunk)
    # Exact: non-reentrant checkpointing runs the same layers' forward again on the same saved inputs and
    # backpropagates through that graph with the same kernels in the same order; nothing is summed differently.
    assert grads[0][0] == grads[1][0]
    assert all(torch.equal(grads[0][1][n], grads[1][1][n]) for n in grads[0][1])
    recomputed.eval()
    with torch.no_grad():
        recomputed(ids)
    assert len(calls) == -(-num_layers // chunk)  # not in eval
