"""Mixture-of-experts training runs for the end-to-end tests.

    MOE_FLAGS                     the MoE flags the training tests share (4 experts, top-2, aux loss, expert bias)
    VARIANT_FLAGS                 added to them: SwiGLU, sigmoid group-limited routing, a shared expert, capacity
                                  dropping, a dense first layer (VARIANT_DROPLESS: all but the dropping)
    train_moe(rank, world_size, runs)  a run_distributed target: ``train``'s record of each run, plus every
                                  router's expert bias and how many expert parameters this rank holds
    assert_same_moe_run(reference, run, label, num_layers)  ``assert_same_run``, and every expert bias within 1e-6
    assert_resumed_bit_for_bit(straight, first, resumed, label, saved_at, iterations)  a run stopped and resumed
                                  is the straight run, loss, grad norm and expert bias
"""

import re

import pytest

from tests.helpers.training import TINY_LAYERS, assert_same_run, record_run

MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
             "--moe-z-loss-coeff", "0.001", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
             "--moe-ffn-hidden-size", "64"]

VARIANT_DROPLESS = ["--swiglu", "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "2",
                    "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.0",
                    "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "[0,1]"]
VARIANT_FLAGS = VARIANT_DROPLESS + ["--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "position"]


def _pipeline_name(name: str) -> str:
    """A GPTModel module name (ZeRO-2's engine: ``layers.0.mlp``) as the pipeline names it (``3.mlp``: BLOOM's
    numbering puts transformer layer i at pipeline item i + 3)."""
    return re.sub(r"^layers\.(\d+)", lambda m: str(int(m.group(1)) + 3), name)


def train_moe(rank, world_size, runs):
    """On each rank: pretrain every argv of ``runs``; per run, ``record_run``'s record with ``expert_bias`` ({layer
    number, as the pipeline names it: bias list} of this rank's stage) and ``expert_numel`` (expert parameters held here)."""
    from megatron.arguments import run_config_from_argv
    from megatron.model.moe import MoELayer, is_expert_parallel
    from megatron.training.pretrain import pretrain

    out = []
    for argv in runs:
        rc = run_config_from_argv(argv, world_size=world_size)
        result = pretrain(rc)
        record = record_run(rc, result)
        module = result.engine.module
        record["expert_bias"] = {_pipeline_name(name): m.router.expert_bias.tolist()
                                 for name, m in module.named_modules()
                                 if isinstance(m, MoELayer) and m.router.expert_bias is not None}
        record["expert_numel"] = sum(p.numel() for p in module.parameters() if is_expert_parallel(p))
        out.append(record)
    return out


def assert_same_moe_run(reference, run, label, num_layers=TINY_LAYERS):
    """``run`` trained as ``reference`` did (``assert_same_run`` for a ``num_layers`` model: losses and grad norms),
    and each of its routers' expert biases is the reference's within 1e-6 (a bias moves by whole updates of its
    rate: the same signs)."""
    assert_same_run(reference, run, label, num_layers=num_layers)
    assert run["expert_bias"] and set(run["expert_bias"]) <= set(reference["expert_bias"]), label
    for name, bias in run["expert_bias"].items():
        assert bias == pytest.approx(reference["expert_bias"][name], abs=1e-6), f"{label}: {name} bias"


def assert_resumed_bit_for_bit(straight, first, resumed, label, saved_at, iterations):
    """A run stopped after iteration ``saved_at`` (``first``) and resumed from its checkpoint (``resumed``) is the
    ``straight`` run of ``iterations``: the same losses, grad norms after the resume and expert biases, bit for bit."""
    assert first["iterations"] == list(range(1, saved_at + 1)), label
    assert resumed["iterations"] == list(range(saved_at + 1, iterations + 1)), label
    assert first["losses"] + resumed["losses"] == straight["losses"], label
    assert resumed["grad_norms"] == straight["grad_norms"][saved_at:], label
    assert resumed["expert_bias"] == straight["expert_bias"], label
