"""Megatron's AnnealingLR, against values computed by hand.

max_lr 1.0, min_lr 0.1, warmup 10 steps, decay 110 steps (warmup included: 100 steps of decay)."""

import math
import types

import pytest
import torch

from megatron.training.lr_schedule import LRScheduler


def optimizer(*lr_mults):
    groups = [{"lr": -1.0} if m is None else {"lr": -1.0, "lr_mult": m} for m in lr_mults or (None,)]
    return types.SimpleNamespace(param_groups=groups)


def scheduler(style="cosine", opt=None, **kwargs):
    settings = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110, decay_style=style)
    return LRScheduler(opt if opt is not None else optimizer(), **{**settings, **kwargs})


def lr_at(style, steps):
    s = scheduler(style)
    s.step(steps)
    return s.get_lr()


COSINE_QUARTER = 0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1)  # 0.86820...


@pytest.mark.parametrize("style,steps,expected", [
    ("cosine", 0, 0.0), ("cosine", 5, 0.5), ("cosine", 10, 1.0),          # warmup start, middle, end
    ("cosine", 35, COSINE_QUARTER), ("cosine", 60, 0.55),                 # a quarter, half of the decay
    ("cosine", 110, 0.1), ("cosine", 111, 0.1), ("cosine", 10 ** 6, 0.1),  # end, after the end
    ("linear", 35, 0.775), ("linear", 60, 0.55), ("linear", 110, 0.1), ("linear", 200, 0.1),
    ("constant", 5, 0.5), ("constant", 60, 1.0), ("constant", 10 ** 6, 1.0),
])
def test_schedule_values(style, steps, expected):
    assert lr_at(style, steps) == pytest.approx(expected, abs=1e-12)


def test_quarter_cosine_value_by_hand():
    assert COSINE_QUARTER == pytest.approx(0.868198, abs=1e-6)


def test_steps_accumulate_and_set_every_group_with_its_multiplier():
    opt = optimizer(None, 0.1)
    s = scheduler(opt=opt)
    for _ in range(6):
        s.step(10)  # e.g. a global batch of 10 samples per step
    assert s.num_steps == 60
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.55, 0.055])


def test_sets_a_real_torch_optimizer():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=123.0)
    s = scheduler(opt=opt)
    assert opt.param_groups[0]["lr"] == 0.0  # step(0) at construction: warmup starts from 0
    s.step(5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_no_warmup_starts_at_max_lr():
    assert scheduler("linear", warmup_steps=0).get_lr() == 1.0


def test_state_dict_round_trip():
    s = scheduler()
    s.step(35)
    state = s.state_dict()
    assert state == {"max_lr": 1.0, "min_lr": 0.1, "warmup_steps": 10, "decay_steps": 110,
                     "decay_style": "cosine", "num_steps": 35, "tokens_per_sample": 1}
    opt = optimizer()
    t = scheduler(opt=opt)
    t.load_state_dict(state)
    assert t.num_steps == 35 and opt.param_groups[0]["lr"] == pytest.approx(COSINE_QUARTER)


def test_a_resume_that_switches_to_tokens_counts_the_samples_in_tokens():
    """A sample-counted checkpoint resumed by a token-based schedule (--override-lr-scheduler: its lengths are the
    flags'): 35 samples of 16 tokens are 560 tokens; and back."""
    s = scheduler()
    s.step(35)
    tokens = LRScheduler(None, max_lr=1.0, min_lr=0.1, warmup_steps=160, decay_steps=1760, decay_style="cosine",
                         override_lr_scheduler=True, tokens_per_sample=16)
    tokens.load_state_dict(s.state_dict())
    assert tokens.num_steps == 560 and tokens.get_lr() == pytest.approx(COSINE_QUARTER)
    back = scheduler()
    back.override_lr_scheduler = True
    back.load_state_dict(tokens.state_dict())
    assert back.num_steps == 35


def test_resume_with_a_different_schedule_needs_a_choice():
    state = scheduler(max_lr=2.0).state_dict()
    with pytest.raises(ValueError, match="max_lr: checkpoint has 2.0, the flags give 1.0"):
        scheduler().load_state_dict(state)
    kept = scheduler(override_lr_scheduler=True)
    kept.load_state_dict(state)
    assert kept.max_lr == 1.0
    taken = scheduler(use_checkpoint_lr_scheduler=True)
    taken.load_state_dict(state)
    assert taken.max_lr == 2.0


@pytest.mark.parametrize("kwargs,words", [
    (dict(warmup_steps=110), "warmup_steps (110) < decay_steps (110)"),
    (dict(min_lr=2.0), "min_lr (2.0) <= max_lr (1.0)"),
    (dict(decay_style="exponential"), "'exponential' is not one of"),
])
def test_invalid_schedules(kwargs, words):
    with pytest.raises(ValueError) as info:
        scheduler(**kwargs)
    assert words in str(info.value)
