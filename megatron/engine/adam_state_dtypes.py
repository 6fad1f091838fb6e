"""AdamW whose moment estimates are stored in a lower precision: Megatron-LM's precision-aware optimizer's
``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` (bf16 or fp16; fp32 is torch's own AdamW, untouched).

Each step loads a parameter's stored moments into fp32, updates them there with the fp32 gradient, applies the
update with those fp32 values (as Transformer Engine's FusedAdam does), and stores them back rounded to their
dtype: Adam's states take 2 bytes per value instead of 4, at the cost of that rounding once per step. The
parameters themselves are the fp32 masters DeepSpeed's optimizer wrappers hand the client optimizer.
"""

from __future__ import annotations

import math

import torch

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class AdamWStateDtypes(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction) with ``exp_avg`` and ``exp_avg_sq``
    stored in ``exp_avg_dtype`` / ``exp_avg_sq_dtype``."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 exp_avg_dtype: torch.dtype = torch.bfloat16, exp_avg_sq_dtype: torch.dtype = torch.bfloat16):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=self.exp_avg_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.exp_avg_sq_dtype)
                state["step"] += 1
                step = float(state["step"])
                grad = param.grad.float()
                exp_avg = state["exp_avg"].float().mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                master = param.float()
                master.mul_(1 - lr * weight_decay)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
                master.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
                param.copy_(master)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss
