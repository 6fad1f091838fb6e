"""What the loop checks of each iteration's loss and gradient norm: non-finite values and loss spikes.

    guard = LossGuard(check_for_nan=True, max_nonfinite_steps=None, loss_spike_factor=10.0, loss_scaling=False)
    guard.observe(iteration, loss, grad_norm, skipped)   # raises NonFiniteLossError when the run must stop;
                                                         # returns the loss spike ratio (or None)

Non-finite: a NaN or infinite loss or gradient norm, or an optimizer step DeepSpeed skipped when no
fp16 loss scaler is there to explain it (bf16 and fp32 have no scale to lower: a skip means the
gradients overflowed). With --check-for-nan-in-loss-and-grad (Megatron-LM's flag, on by default) the
first one stops the run; --max-nonfinite-steps N allows N - 1 in a row instead. The error is raised
before the iteration's save, so the bad state is never checkpointed.

A spike (the loss above ``loss_spike_factor`` times the mean of the last finite losses) only reports:
a real run recovers from most, and the operator decides.
"""

from __future__ import annotations

import collections
import math
from typing import Optional

SPIKE_WINDOW = 100      # finite losses the running mean is taken over
SPIKE_MIN_HISTORY = 5   # no spike is called before this many finite losses


class NonFiniteLossError(RuntimeError):
    """The run met a non-finite loss or gradient norm (more than --max-nonfinite-steps allows)."""

    on_every_rank = True  # the loss is averaged over the ranks and the grad norm is global: all stop together


class LossGuard:
    def __init__(self, *, check_for_nan: bool, max_nonfinite_steps: Optional[int], loss_spike_factor: float,
                 loss_scaling: bool):
        # --max-nonfinite-steps, when given, is the limit; else the check stops at the first one
        self.max_nonfinite_steps = max_nonfinite_steps
        self.limit = max_nonfinite_steps if max_nonfinite_steps is not None else (1 if check_for_nan else None)
        self.loss_spike_factor = loss_spike_factor
        self.loss_scaling = loss_scaling
        self.consecutive = 0
        self.recent: collections.deque = collections.deque(maxlen=SPIKE_WINDOW)

    def nonfinite(self, loss: float, grad_norm: Optional[float], skipped: bool) -> bool:
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        return not finite or (skipped and not self.loss_scaling)

    def observe(self, iteration: int, loss: float, grad_norm: Optional[float], skipped: bool) -> Optional[float]:
        """Count this trained iteration; NonFiniteLossError when the limit is reached. The loss spike ratio
        (loss / running mean) when this loss is a spike, else None."""
        if self.nonfinite(loss, grad_norm, skipped):
            self.consecutive += 1
            if self.limit is not None and self.consecutive >= self.limit:
                raise NonFiniteLossError(self._message(iteration, loss, grad_norm, skipped))
            return None
        self.consecutive = 0
        ratio = None
        if self.loss_spike_factor and len(self.recent) >= SPIKE_MIN_HISTORY:
            mean = sum(self.recent) / len(self.recent)
            if mean > 0 and loss > self.loss_spike_factor * mean:
                ratio = loss / mean
        self.recent.append(loss)
        return ratio

    def _message(self, iteration: int, loss: float, grad_norm: Optional[float], skipped: bool) -> str:
        what = f"loss {loss}, grad norm {grad_norm}" + (", optimizer step skipped by DeepSpeed" if skipped else "")
        if self.max_nonfinite_steps is not None:
            return (f"iteration {iteration}: {self.consecutive} consecutive iterations with a non-finite loss or "
                    f"gradient norm ({what}); stopping without saving (--max-nonfinite-steps {self.limit}). Lower "
                    f"--lr, check the data, or resume from an earlier checkpoint.")
        return (f"iteration {iteration}: non-finite loss or gradient norm ({what}); stopping without saving "
                f"(--check-for-nan-in-loss-and-grad). Lower --lr, check the data, or resume from an earlier "
                f"checkpoint; --no-check-for-nan-in-loss-and-grad trains on.")
