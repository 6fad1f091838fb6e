"""The profiling window of --profile: iterations START+1 .. END (Megatron-LM's counting: START
iterations are completed when it opens, END when it closes).

Two profilers, as in Megatron-LM: without --use-pytorch-profiler, nsys ranges (cudaProfilerStart /
Stop, for ``nsys profile --capture-range=cudaProfilerApi``; CUDA only); with it, torch.profiler,
whose trace (``rank<N>.<ms>.pt.trace.json``) lands in --tensorboard-dir for TensorBoard's profiler
plugin. The step before the window, when there is one, is torch.profiler's warm-up (not recorded).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.config.run import LoggingConfig


def check_profiler_device(logging: LoggingConfig) -> None:
    """Refuse nsys profiling where there is no CUDA (before any process group starts)."""
    if logging.profile and not logging.use_pytorch_profiler and not torch.cuda.is_available():
        raise ValueError("--profile without --use-pytorch-profiler records nsys ranges (cudaProfilerStart), which "
                         "needs CUDA and there is none; add --use-pytorch-profiler for a torch.profiler trace "
                         "in --tensorboard-dir")


class ProfilerWindow:
    """Call ``before_step(completed)`` and ``after_step(completed)`` around each training iteration,
    ``completed`` being the number of iterations done at that moment."""

    def __init__(self, logging: LoggingConfig, rank: int):
        self.logging = logging
        self.rank = rank
        self.enabled = logging.profile and (not logging.profile_ranks or rank in logging.profile_ranks)
        self._torch_profiler: Optional[torch.profiler.profile] = None
        self._nsys_running = False
        self.done = False

    def before_step(self, completed: int) -> None:
        if not self.enabled or self.done:
            return
        start = self.logging.profile_step_start
        if not self.logging.use_pytorch_profiler:
            if completed == start:
                torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
                self._nsys_running = True
        elif self._torch_profiler is None and completed in (start - 1, start):
            self._start_torch_profiler(warmup=1 if completed == start - 1 else 0)

    def _start_torch_profiler(self, warmup: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        active = self.logging.profile_step_end - self.logging.profile_step_start
        self._torch_profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.logging.tensorboard_dir,
                                                                    worker_name=f"rank{self.rank}"),
            record_shapes=True)
        self._torch_profiler.start()

    def after_step(self, completed: int) -> None:
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        if completed == self.logging.profile_step_end:
            self.close()

    def close(self) -> None:
        """End the window (at its last iteration, or when training stops inside it)."""
        if self._torch_profiler is not None:
            self._torch_profiler.stop()
            self._torch_profiler = None
            self.done = True
        if self._nsys_running:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self._nsys_running = False
            self.done = True
