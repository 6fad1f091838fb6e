"""Megatron-LM's --decoupled-lr / --decoupled-min-lr and --lr-warmup-init: the word embedding and the output layer
on their own peak and floor, the same schedule shape, against Megatron-LM's OptimizerParamScheduler.get_lr written
here from its definition, and the update SGD applies to each parameter."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron.config import OptimizerConfig
from megatron.engine.optimizer import build_client_optimizer
from megatron.model.gpt import GPTModel
from megatron.training.lr_schedule import LRScheduler
from tests.helpers.model import tiny_config


def _megatron_lm_lr(num_steps, group, *, max_lr, min_lr, init_lr, warmup, decay, style):
    """Megatron-LM's get_lr(param_group): a group's own max_lr / min_lr, else the scheduler's; linear warmup from
    init_lr, then the decay style down to min_lr, then min_lr."""
    max_lr, min_lr = group.get("max_lr", max_lr), group.get("min_lr", min_lr)
    if warmup > 0 and num_steps <= warmup:
        return init_lr + (max_lr - init_lr) * num_steps / warmup
    if num_steps > decay:
        return min_lr
    ratio = (num_steps - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style,init_lr", [("cosine", 0.0), ("linear", 2e-5)])
def test_each_group_follows_its_own_peak_and_floor(style, init_lr):
    groups = [{"name": "decay"}, {"name": "no_decay", "lr_mult": 0.5},
              {"name": "decay_decoupled_lr", "max_lr": 5e-4, "min_lr": 4.5e-5}]
    scheduler = LRScheduler(SimpleNamespace(param_groups=groups), max_lr=1.5e-4, min_lr=1e-5, warmup_steps=40,
                            decay_steps=300, decay_style=style, init_lr=init_lr)
    for step in range(0, 320, 8):
        for group in groups:
            expected = _megatron_lm_lr(step, group, max_lr=1.5e-4, min_lr=1e-5, init_lr=init_lr, warmup=40,
                                       decay=300, style=style) * group.get("lr_mult", 1.0)
            assert group["lr"] == pytest.approx(expected, rel=1e-12, abs=0), (step, group["name"])
        scheduler.step(8)


@pytest.mark.parametrize("tied", [True, False])
def test_the_embedding_and_output_layer_step_at_the_decoupled_rate(tied):
    """SGD without momentum or weight decay moves each parameter by -lr x grad: the word embedding and (untied) the
    output layer by the decoupled rate, every other parameter by --lr's."""
    torch.manual_seed(0)
    model = GPTModel(tiny_config(untie_embeddings_and_output_weights=not tied))
    config = OptimizerConfig(optimizer="sgd", lr=1e-2, min_lr=1e-3, decoupled_lr=3e-2, decoupled_min_lr=2e-3,
                             sgd_momentum=0.0, weight_decay=0.0).validate()
    optimizer = build_client_optimizer(model, config)
    scheduler = LRScheduler(optimizer, max_lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=10,
                            decay_style="cosine")
    scheduler.step(3)  # past the warmup: 1 of 8 decay steps done
    decoupled = [g for g in optimizer.param_groups if g["name"].endswith("_decoupled_lr")]
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for g in decoupled for p in g["params"]) == sorted(
        ["embedding.word_embeddings.weight"] + ([] if tied else ["output_layer.weight"]))
    ids = torch.randint(0, 256, (2, 16))
    loss = model(ids, labels=torch.roll(ids, -1, 1), loss_mask=torch.ones(2, 16))
    loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    coeff = 0.5 * (math.cos(math.pi * 1 / 8) + 1.0)
    rates = {"decoupled": 2e-3 + coeff * (3e-2 - 2e-3), "other": 1e-3 + coeff * (1e-2 - 1e-3)}
    decoupled_ids = {id(p) for g in decoupled for p in g["params"]}
    for name, param in model.named_parameters():
        rate = rates["decoupled" if id(param) in decoupled_ids else "other"]
        torch.testing.assert_close(param.detach(), before[name] - rate * param.grad, rtol=0, atol=1e-7)


def test_decoupled_flag_rules():
    with pytest.raises(ValueError, match="--decoupled-min-lr 0.001 needs --decoupled-lr"):
        OptimizerConfig(decoupled_min_lr=1e-3).validate()
    with pytest.raises(ValueError, match="--decoupled-lr 0.001 must be positive and at least its floor"):
        OptimizerConfig(lr=1e-2, min_lr=1e-3, decoupled_lr=1e-3, decoupled_min_lr=2e-3).validate()
