"""Megatron-LM's precision-aware optimizer dtypes (--exp-avg-dtype / --exp-avg-sq-dtype): AdamW with its moments
stored in bf16 or fp16, against AdamW written here from its definition with the stored moments rounded each step,
and in a training run on DeepSpeed's BF16_Optimizer (ZeRO-1)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.engine.adam_state_dtypes import AdamWStateDtypes
from megatron.testing import run_distributed
from megatron.testing.tiny_corpus import tiny_argv


def _reference(param, grads, *, lr, betas, eps, wd, m_dtype, v_dtype):
    """AdamW (Loshchilov & Hutter, as torch computes it): decay, moments, bias correction; the moments computed in
    float64 from the stored ones and stored rounded to their dtypes; the update from the unrounded ones."""
    p = param.double()
    m_stored = torch.zeros_like(param, dtype=m_dtype)
    v_stored = torch.zeros_like(param, dtype=v_dtype)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = betas[0] * m_stored.double() + (1 - betas[0]) * g
        v = betas[1] * v_stored.double() + (1 - betas[1]) * g * g
        p = p * (1 - lr * wd)
        p = p - lr * (m / (1 - betas[0] ** t)) / (torch.sqrt(v / (1 - betas[1] ** t)) + eps)
        m_stored, v_stored = m.to(m_dtype), v.to(v_dtype)
    return p.float(), m_stored, v_stored


@pytest.mark.parametrize("m_dtype,v_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_update_against_adamw_with_rounded_moments(m_dtype, v_dtype):
    torch.manual_seed(0)
    start = torch.randn(64, 32)
    grads = [torch.randn(64, 32) * 0.1 for _ in range(6)]
    param = torch.nn.Parameter(start.clone())
    opt = AdamWStateDtypes([param], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, exp_avg_dtype=m_dtype,
                           exp_avg_sq_dtype=v_dtype)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    expected, m, v = _reference(start, grads, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, wd=0.1, m_dtype=m_dtype,
                                v_dtype=v_dtype)
    state = opt.state[param]
    assert state["exp_avg"].dtype == m_dtype and state["exp_avg_sq"].dtype == v_dtype
    # fp32 arithmetic against float64: a few fp32 ulps of each of 6 steps of size lr
    torch.testing.assert_close(param.detach(), expected, rtol=0, atol=6 * 8 * 2**-24 * 4)
    # a rounding of the stored state can differ by one unit of its dtype where the fp32 and float64 values straddle it
    torch.testing.assert_close(state["exp_avg"].float(), m.float(), rtol=2 * torch.finfo(m_dtype).eps, atol=1e-12)
    torch.testing.assert_close(state["exp_avg_sq"].float(), v.float(), rtol=2 * torch.finfo(v_dtype).eps, atol=1e-12)
    # and it is not torch's fp32-state AdamW: the rounding moved the weights
    fp32 = torch.nn.Parameter(start.clone())
    adamw = torch.optim.AdamW([fp32], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for g in grads:
        fp32.grad = g.clone()
        adamw.step()
    assert not torch.equal(fp32.detach(), param.detach())
    assert math.isclose(float((fp32 - param).detach().abs().max()), 0.0, abs_tol=1e-3)  # but only by the rounding's effect


def _trained_state_dtypes(rank, world_size, argv):
    from megatron.arguments import run_config_from_argv
    from megatron.training.pretrain import pretrain

    result = pretrain(run_config_from_argv(argv, world_size=world_size))
    inner = result.engine.optimizer.optimizer
    return {"optimizer": type(inner).__name__, "wrapper": type(result.engine.optimizer).__name__,
            "dtypes": sorted({str(s[k].dtype) for s in inner.state.values() for k in ("exp_avg", "exp_avg_sq")}),
            "losses": [r.loss for r in result.history]}


@pytest.mark.multiprocess
def test_bf16_moments_train_on_bf16_optimizer(tiny_corpus):
    argv = tiny_argv(tiny_corpus, "--bf16", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                     "--exp-avg-sq-dtype", "bf16", train_iters=3)
    (out,) = run_distributed(_trained_state_dtypes, world_size=1, args=(argv,), timeout=300)
    assert (out["wrapper"], out["optimizer"]) == ("BF16_Optimizer", "AdamWStateDtypes")
    assert out["dtypes"] == ["torch.bfloat16"] and len(out["losses"]) == 3
    assert all(math.isfinite(loss) for loss in out["losses"])


def test_flag_rules(files):
    from tests.helpers.arguments import parse

    with pytest.raises(ValueError, match="--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"):
        parse(files, exp_avg_dtype="bf16")
    with pytest.raises(ValueError, match="--exp-avg-sq-dtype fp8: FP8 optimizer states are not implemented"):
        parse(files, use_precision_aware_optimizer=True, exp_avg_sq_dtype="fp8")
    with pytest.raises(ValueError, match="--main-grads-dtype bf16 / --main-params-dtype fp32: DeepSpeed's"):
        parse(files, main_grads_dtype="bf16")
    assert parse(files, use_precision_aware_optimizer=True, exp_avg_dtype="fp16").optimizer.exp_avg_dtype == "fp16"


def test_dry_run_plans_half_the_adam_bytes(files):
    """The plan's optimizer state: 8 bytes a parameter with fp32 moments, 4 with both in bf16, 6 with one."""
    from megatron.dry_run.estimate import planner_layout
    from megatron.planner.memory import static_bytes
    from tests.helpers.arguments import parse

    adam = {}
    for dtypes in (("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp32")):
        rc = parse(files, bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype=dtypes[0],
                   exp_avg_sq_dtype=dtypes[1])
        layout = planner_layout(rc, [2])
        adam[dtypes] = static_bytes(1000, layout)["adam"] * layout.weight_replicas
    assert adam == {("fp32", "fp32"): 8000, ("bf16", "bf16"): 4000, ("fp16", "fp32"): 6000}
