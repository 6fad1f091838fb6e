"""Learning-rate schedule: Megatron's AnnealingLR.

Linear warmup from 0 to ``max_lr`` over ``warmup_steps``, then ``linear`` / ``cosine`` decay to
``min_lr`` at ``decay_steps`` (the decay length counts the warmup, as in Megatron), then ``min_lr``;
``constant`` holds ``max_lr`` after warmup. The loop passes ``step(increment)`` the samples of each
optimizer step (the current global batch); the schedule counts them in its unit
(``RunConfig.lr_schedule_lengths``): samples, with lengths from the iteration flags x global batch size
exactly as Megatron converts them, so sample- and iteration-based runs share one code path; or, with
Megatron-DeepSpeed's ``--lr-decay-tokens``, tokens (samples x ``--seq-length``), the lengths in tokens.

The rate is written into every optimizer param group, times the group's ``lr_mult`` if it has one; a group
with its own ``max_lr`` / ``min_lr`` (Megatron-LM's ``--decoupled-lr`` for the embedding and output layer,
``megatron.engine.optimizer``) follows the same shape between its own peak and floor. The warmup starts from
``init_lr`` (Megatron-LM's ``--lr-warmup-init``, default 0).
"""

from __future__ import annotations

import math
from typing import Optional

from megatron.config import LR_DECAY_STYLES

_CHECKED_KEYS = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style")


class LRScheduler:
    def __init__(self, optimizer, *, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: float,
                 decay_style: str, use_checkpoint_lr_scheduler: bool = False, override_lr_scheduler: bool = False,
                 tokens_per_sample: int = 1, init_lr: float = 0.0):
        if decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"decay style {decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}")
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= min_lr ({min_lr}) <= max_lr ({max_lr})")
        if not 0 <= warmup_steps < decay_steps:
            raise ValueError(f"need 0 <= warmup_steps ({warmup_steps}) < decay_steps ({decay_steps})")
        if use_checkpoint_lr_scheduler and override_lr_scheduler:
            raise ValueError("use_checkpoint_lr_scheduler and override_lr_scheduler contradict each other")
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.init_lr = float(init_lr)
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.decay_style = decay_style
        self.use_checkpoint_lr_scheduler = use_checkpoint_lr_scheduler
        self.override_lr_scheduler = override_lr_scheduler
        # 1: the steps are samples; --seq-length: tokens (Megatron-DeepSpeed's token-based schedule)
        self.tokens_per_sample = tokens_per_sample
        self.num_steps = 0
        self.step(0)

    @classmethod
    def from_run_config(cls, optimizer, run_config) -> "LRScheduler":
        """The schedule of a ``RunConfig``, counted in consumed samples or tokens (``lr_schedule_lengths``)."""
        warmup, decay, unit = run_config.lr_schedule_lengths()
        s = run_config.lr_schedule
        return cls(optimizer, max_lr=run_config.optimizer.lr, min_lr=run_config.optimizer.min_lr,
                   warmup_steps=warmup, decay_steps=decay, decay_style=s.lr_decay_style,
                   use_checkpoint_lr_scheduler=s.use_checkpoint_lr_scheduler,
                   override_lr_scheduler=s.override_lr_scheduler, tokens_per_sample=unit, init_lr=s.lr_warmup_init)

    def get_lr(self, group: Optional[dict] = None) -> float:
        """The rate after ``num_steps`` steps (of ``group``, where it has its own ``max_lr`` / ``min_lr``)."""
        group = group or {}
        max_lr, min_lr = group.get("max_lr", self.max_lr), group.get("min_lr", self.min_lr)
        if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
            if self.init_lr == 0.0:
                return max_lr * float(self.num_steps) / float(self.warmup_steps)
            return self.init_lr + (max_lr - self.init_lr) * float(self.num_steps) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return max_lr
        if self.num_steps > self.decay_steps:
            return min_lr
        decay_ratio = float(self.num_steps - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        assert 0.0 <= decay_ratio <= 1.0, decay_ratio
        if self.decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:  # cosine: half a period from max_lr down to min_lr
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int = 1) -> float:
        """Advance by ``increment`` (samples of the step just taken) and set the rate on the optimizer."""
        self.num_steps += increment * self.tokens_per_sample
        lr = self.get_lr()
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = (self.get_lr(group) if "max_lr" in group else lr) * group.get("lr_mult", 1.0)
        return lr

    def state_dict(self) -> dict:
        """Megatron's AnnealingLR keys, so checkpoints carry the same fields."""
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "decay_style": self.decay_style, "num_steps": self.num_steps,
                "tokens_per_sample": self.tokens_per_sample}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step count; the schedule's shape follows Megatron's resume rules.

        By default the checkpoint's shape must equal this one (a ValueError names the difference);
        ``override_lr_scheduler`` keeps this object's values, ``use_checkpoint_lr_scheduler`` takes
        the checkpoint's.
        """
        for key in _CHECKED_KEYS:
            saved = state.get(key, _legacy(state, key))
            if saved is None or self.override_lr_scheduler:
                continue
            if self.use_checkpoint_lr_scheduler:
                setattr(self, key, saved)
            elif saved != getattr(self, key):
                raise ValueError(f"learning-rate schedule {key}: checkpoint has {saved!r}, the flags give "
                                 f"{getattr(self, key)!r}; pass --override-lr-scheduler to keep the flags or "
                                 f"--use-checkpoint-lr-scheduler to keep the checkpoint's")
        # the saved count in the unit counted from now on (samples or tokens: the checkpoint's with
        # use_checkpoint_lr_scheduler, whose lengths are in it; else this one's)
        count, saved_unit = state.get("num_steps", state.get("num_iters", 0)), state.get("tokens_per_sample", 1)
        if self.use_checkpoint_lr_scheduler:
            self.tokens_per_sample = saved_unit
        self.num_steps = count if saved_unit == self.tokens_per_sample else count * self.tokens_per_sample / saved_unit
        self.step(0)


def _legacy(state: dict, key: str) -> Optional[object]:
    """Names older Megatron checkpoints used for the same values."""
    legacy = {"max_lr": "start_lr", "warmup_steps": "warmup_iter", "decay_steps": "end_iter"}
    return state.get(legacy.get(key, ""))
