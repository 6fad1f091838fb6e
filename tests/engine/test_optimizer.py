"""The client optimizer gets every optimizer flag: --optimizer sgd --sgd-momentum 0.5 reaches the torch
optimizer inside the DeepSpeed engine, and the fp32 clipping wrapper is a real torch Optimizer."""

import pytest
import torch

from megatron.testing import run_distributed
from megatron.testing.corpus import tiny_argv


def _engine_optimizer(rank, world_size, rc):
    from megatron.engine.initialize import build_engine, init_deepspeed_comm
    from megatron.parallel.state import ParallelState

    init_deepspeed_comm("gloo")
    engine = build_engine(rc, ParallelState.create(1, 1))
    wrapper = engine.optimizer
    inner = wrapper.optimizer
    return {"wrapper": type(wrapper).__name__, "inner": type(inner).__name__,
            "is_torch_optimizer": isinstance(wrapper, torch.optim.Optimizer),
            "shares_groups": wrapper.param_groups is inner.param_groups and wrapper.state is inner.state,
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]}


@pytest.mark.multiprocess
def test_sgd_momentum_and_weight_decay_reach_the_optimizer(tiny_corpus):
    from megatron.arguments import run_config_from_argv

    rc = run_config_from_argv(tiny_argv(tiny_corpus, "--optimizer", "sgd", "--sgd-momentum", "0.5",
                                        "--weight-decay", "0.03", lr=0.02), world_size=1)
    (out,) = run_distributed(_engine_optimizer, world_size=1, args=(rc,), timeout=300)
    assert (out["wrapper"], out["inner"]) == ("GradNormClippingOptimizer", "SGD")
    assert out["is_torch_optimizer"] and out["shares_groups"]
    decay, no_decay = out["groups"]
    assert (decay["name"], decay["momentum"], decay["weight_decay"]) == ("decay", 0.5, 0.03)
    assert (no_decay["name"], no_decay["momentum"], no_decay["weight_decay"]) == ("no_decay", 0.5, 0.0)


def test_client_optimizer_from_its_config():
    from megatron.config import OptimizerConfig
    from megatron.engine.optimizer import build_client_optimizer

    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    adam = build_client_optimizer(module, OptimizerConfig(lr=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6,
                                                          weight_decay=0.1))
    assert isinstance(adam, torch.optim.AdamW)
    decay, no_decay = adam.param_groups
    assert (decay["betas"], decay["eps"], decay["lr"], decay["weight_decay"]) == ((0.8, 0.95), 1e-6, 3e-4, 0.1)
    assert len(decay["params"]) == 1 and len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
    sgd = build_client_optimizer(module, OptimizerConfig(optimizer="sgd", sgd_momentum=0.25))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.25
