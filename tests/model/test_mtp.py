"""Multi-token prediction against a plain-PyTorch reference written from DeepSeek-V3's paper (arXiv:2412.19437,
section 2.2): depth k at position i combines the (k-1)-th depth's representation of token i with the embedding
of token i+k, runs one transformer block, and predicts token i+k+1 through the SHARED embedding and output head;
L_MTP = lambda / D * sum_k L_k, each L_k the mean cross-entropy over the positions that have a target.

The reference never shifts or masks: it slices. Depth k sees only positions 0 .. s-1-k (the block is causal, so
the outputs of those positions do not depend on the cut-off tail), embeds tokens t[k+1 .. s] directly, and its
targets are tokens t[k+2 .. s+1] of the (s+1)-token sample. The model's code rolls and masks instead
(Megatron-LM's way); a wrong shift, a missing mask, a depth fed the wrong hidden state or a concatenation in the
wrong order all change the numbers compared here (losses and every gradient, the shared weights' included).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.model import GPTModel
from megatron.testing.tolerance import model_tolerance, step_depth, tolerance
from tests.helpers.model import tiny_config


def mtp_config(**overrides):
    fields = dict(normalization="rmsnorm", swiglu=True, add_bias_linear=False, position_embedding_type="rotary",
                  untie_embeddings_and_output_weights=True, ffn_hidden_size=96, mtp_num_layers=2,
                  mtp_loss_scaling_factor=0.3)
    fields.update(overrides)
    return tiny_config(**fields)


def _rms(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def reference_losses(model, tokens, mask):
    """(main loss, [L_1 .. L_D]) of ``tokens`` [b, s+1] with ``mask`` [b, s] over the labels tokens[:, 1:],
    from the paper's definition (see the module docstring), using the model's trunk and blocks as functions."""
    config = model.config
    s = tokens.shape[1] - 1
    emb = model.embedding.word_embeddings.weight
    head = emb if model.output_layer is None else model.output_layer.weight

    def ce(hidden, targets, m):  # hidden [n, b, h], targets / m [b, n]
        logits = (hidden @ head.t()).float().transpose(0, 1)  # [b, n, v]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        return (loss * m.reshape(-1)).sum() / m.sum()

    hidden = F.embedding(tokens[:, :s], emb).transpose(0, 1)  # [s, b, h]
    for layer in model.layers:
        hidden = layer(hidden)
    hidden = model.final_layernorm(hidden)
    main = ce(hidden, tokens[:, 1:], mask.float())
    depth_losses = []
    for k, depth in enumerate(model.mtp.layers, start=1):
        n = s - k  # positions with a target t[i + k + 1], i + k + 1 <= s
        prev = hidden[:n]  # h^{k-1}_i
        embedded = F.embedding(tokens[:, k:k + n], emb).transpose(0, 1)  # Emb(t_{i+k})
        eps = config.layernorm_epsilon
        combined = torch.cat([_rms(embedded, depth.enorm.weight, eps), _rms(prev, depth.hnorm.weight, eps)], -1)
        x = combined @ depth.eh_proj.weight.t()  # M_k [h, 2h]
        hidden = depth.final_layernorm(depth.transformer_layer(x))  # h^k_i, i < n
        depth_losses.append(ce(hidden, tokens[:, k + 1:k + 1 + n], mask[:, k:k + n].float()))
    return main, torch.stack(depth_losses)


def _batch(config, seed=0, b=3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.padded_vocab_size, (b, config.seq_length + 1), generator=g)
    mask = (torch.rand(b, config.seq_length, generator=g) > 0.2).float()
    return tokens, mask


def _perturb(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=g))
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mtp_loss_and_gradients_match_the_papers_definition(tied):
    config = mtp_config(untie_embeddings_and_output_weights=not tied)
    model = _perturb(GPTModel(config)).train()
    tokens, mask = _batch(config)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask)
    ours_depths = model.mtp.last_losses
    main, depths = reference_losses(model, tokens, mask)
    tol = model_tolerance(config, torch.float32, depths)
    # the value returned is the LM loss alone; the depths' losses are kept for the log
    assert abs(loss.item() - main.item()) <= tol, (loss.item(), main.item())
    assert torch.allclose(ours_depths, depths.detach(), rtol=0, atol=tol), (ours_depths, depths)
    # gradients: of L_main + lambda / D * sum L_k, for every parameter (the shared embedding and head included)
    ours = torch.autograd.grad(loss, list(model.parameters()))
    ref_total = main + config.mtp_loss_scaling_factor * depths.mean()
    ref = torch.autograd.grad(ref_total, list(model.parameters()))
    names = [name for name, _ in model.named_parameters()]
    for name, a, r in zip(names, ours, ref):
        bound = tolerance(torch.float32, step_depth(config.num_layers + 1), 96, scale=r.abs().max().item() + 1e-12)
        assert torch.allclose(a, r, rtol=0, atol=bound), (name, (a - r).abs().max().item(), bound)
    assert ours[names.index("embedding.word_embeddings.weight")].abs().sum() > 0
    for name, grad in zip(names, ours):
        if name.startswith("mtp."):
            assert grad.abs().sum() > 0, f"{name} got no gradient"


def test_mtp_scaling_factor_zero_leaves_the_gradient_of_the_lm_loss():
    config = mtp_config(mtp_loss_scaling_factor=0.0)
    model = _perturb(GPTModel(config)).train()
    plain = _perturb(GPTModel(mtp_config(mtp_num_layers=0))).train()
    tokens, mask = _batch(config)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask)
    plain_loss = plain(tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask)
    assert loss.item() == plain_loss.item()  # the same trunk, the same weights (init by name), the same sums
    grads = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
    plain_grads = torch.autograd.grad(plain_loss, list(plain.parameters()))
    for (name, _), g in zip(plain.named_parameters(), plain_grads):
        assert torch.equal(grads[name], g), name


def test_moe_model_builds_an_moe_mtp_layer():
    from megatron.config.moe import MoEConfig  # noqa: PLC0415

    moe = MoEConfig(num_experts=4, router_topk=2, layer_pattern=(False, True), ffn_hidden_size=32)
    config = mtp_config(moe=moe, mtp_num_layers=1)
    model = GPTModel(config)
    names = [n for n, _ in model.named_parameters()]
    assert any(n.startswith("mtp.layers.0.transformer_layer.mlp.experts") for n in names), names
    tokens, mask = _batch(config)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("overrides, needle", [
    (dict(position_embedding_type="absolute"), "learned positions"),
    (dict(embed_layernorm=True), "--embed-layernorm"),
    (dict(mtp_num_layers=-1), "non-negative"),
])
def test_mtp_refusals_name_the_cause(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        mtp_config(**overrides)
