"""Per-phase wall-clock timers, leveled as Megatron-LM's (--timing-log-level).

    timers = PhaseTimers(level=1, synchronize=torch.cuda.synchronize)
    with timers("forward-backward", level=1):
        ...
    timers.elapsed_ms()        # {'forward-backward': 12.5}, and the sums start again

Here and not in megatron.training so that the engines can time their own phases (ModelEngine's
forward-backward / optimizer); the training loop reads and reports them. A timer above the chosen
level costs one comparison: level 0 (the default) measures nothing.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import torch


class PhaseTimers:
    """Sums of wall-clock time per phase name since the last ``elapsed_ms``.

    synchronize: called before each start and stop (``torch.cuda.synchronize`` on CUDA), so that a
    phase's queued kernels are counted in it rather than in the next one; None on CPU.
    """

    def __init__(self, level: int = 0, synchronize: Optional[Callable[[], None]] = None):
        self.level = level
        self.synchronize = synchronize
        self._sums_s: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, level: int = 1):
        if level > self.level:
            yield
            return
        if self.synchronize is not None:
            self.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize is not None:
                self.synchronize()
            self._sums_s[name] = self._sums_s.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` measured elsewhere (an optimizer step hook) under ``name``."""
        self._sums_s[name] = self._sums_s.get(name, 0.0) + seconds

    def elapsed_ms(self, reset: bool = True) -> dict[str, float]:
        out = {name: 1000.0 * seconds for name, seconds in self._sums_s.items()}
        if reset:
            self._sums_s = {}
        return out


NO_TIMERS = PhaseTimers(level=0)


def innermost_torch_optimizer(optimizer) -> Optional[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` inside DeepSpeed's wrappers (BF16_Optimizer, the ZeRO optimizers
    keep it as ``.optimizer``), or None when there is none to find."""
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def time_optimizer_inner_step(optimizer, timers: PhaseTimers, level: int = 1) -> bool:
    """Count the base optimizer's own ``step`` (the update, without DeepSpeed's unscaling and clipping)
    as Megatron's 'optimizer-inner-step', through torch's public step hooks. False if none was found."""
    inner = innermost_torch_optimizer(optimizer)
    if inner is None or level > timers.level:
        return False
    started: list[float] = []

    def before(*_):
        if timers.synchronize is not None:
            timers.synchronize()
        started.append(time.perf_counter())

    def after(*_):
        if timers.synchronize is not None:
            timers.synchronize()
        timers.add("optimizer-inner-step", time.perf_counter() - started.pop())

    inner.register_step_pre_hook(before)
    inner.register_step_post_hook(after)
    return True
