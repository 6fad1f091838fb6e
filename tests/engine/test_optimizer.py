"""The client optimizer gets every optimizer flag: --optimizer sgd --sgd-momentum 0.5 reaches the torch
optimizer inside the DeepSpeed engine, and the fp32 clipping wrapper is a real torch Optimizer."""

import pytest
import torch

from megatron.testing import run_distributed
from megatron.testing.tiny_corpus import tiny_argv


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


def test_the_clipping_wrapper_still_shares_groups_and_state_after_loading_a_checkpoint():
    """torch's load_state_dict replaces the wrapped optimizer's param_groups and state; the learning-rate
    schedule sets lr through the wrapper, so a wrapper left on the old groups made a resumed fp32 run step
    with the lr of its save from then on (a run resumed at iteration 5 differed from iteration 8)."""
    from megatron.config import OptimizerConfig
    from megatron.engine.optimizer import GradNormClippingOptimizer, build_client_optimizer

    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    wrapper = GradNormClippingOptimizer(build_client_optimizer(module, OptimizerConfig(lr=1e-2)), clip_grad=1.0,
                                        tp_rank=0, model_group=None)
    module(torch.randn(2, 4)).sum().backward()
    wrapper.step()
    saved = wrapper.state_dict()
    wrapper.load_state_dict(saved)
    assert wrapper.param_groups is wrapper.optimizer.param_groups and wrapper.state is wrapper.optimizer.state
    for group in wrapper.param_groups:  # what the schedule does each iteration
        group["lr"] = 0.5
    assert [g["lr"] for g in wrapper.optimizer.param_groups] == [0.5] * len(wrapper.optimizer.param_groups)
    before = module.weight.detach().clone()
    module.zero_grad()
    module(torch.randn(2, 4)).sum().backward()
    wrapper.step()
    assert not torch.equal(before, module.weight)


def _communication_dtype(rank, world_size, rc):
    from megatron.engine.initialize import build_engine, init_deepspeed_comm
    from megatron.parallel.state import ParallelState

    init_deepspeed_comm("gloo")
    return str(build_engine(rc, ParallelState.create(1, 1)).communication_data_type)


@pytest.mark.multiprocess
def test_bf16_gradients_are_reduced_in_bf16(tiny_corpus):
    """What --grad-reduce-in-bf16 (Megatron-LM) asks is DeepSpeed's default for bf16 runs: the engine casts the fp32
    gradient buffer to its communication dtype, bf16, for the data-parallel all-reduce. The flag writes it into the
    config; a JSON asking fp32 contradicts it."""
    from megatron.arguments import run_config_from_argv
    from megatron.config.deepspeed import build_deepspeed_config

    plain = run_config_from_argv(tiny_argv(tiny_corpus, "--bf16"), world_size=1)
    asked = run_config_from_argv(tiny_argv(tiny_corpus, "--bf16", "--grad-reduce-in-bf16"), world_size=1)
    assert "communication_data_type" not in build_deepspeed_config(plain)
    assert build_deepspeed_config(asked)["communication_data_type"] == "bf16"
    with pytest.raises(ValueError, match="communication_data_type"):
        build_deepspeed_config(asked, {"communication_data_type": "fp32"})
    (dtype,) = run_distributed(_communication_dtype, world_size=1, args=(plain,), timeout=300)
    assert dtype == "torch.bfloat16"
    with pytest.raises(ValueError, match="--grad-reduce-in-bf16 reduces bf16 runs' gradients in bf16; it needs --bf16"):
        run_config_from_argv(tiny_argv(tiny_corpus, "--grad-reduce-in-bf16"), world_size=1)
