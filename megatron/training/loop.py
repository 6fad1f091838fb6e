"""The training loop: one DeepSpeed pipeline step per iteration, evaluation, logging, exits, saves.

    trainer = Trainer(rc, engine, lr_scheduler=..., microbatches=..., train_iterator=..., ...)
    reason = trainer.train()        # '' when --train-iters / --train-samples is reached

Per iteration: update the global batch (rampup; DeepSpeed is told), skip the data of iterations
in --skip-train-iteration-range, run ``engine.train_batch`` (forward, backward, gradient
reductions and the optimizer step inside DeepSpeed), advance the learning rate by the samples
consumed, average TP-duplicated parameters if asked, count skipped and non-finite steps, log,
evaluate, save, and check the exit conditions (agreed across ranks). With --hang-watchdog-factor a thread watches
each training step (megatron.training.watchdog); with --log-straggler each log line names the fastest and
slowest ranks' forward time (megatron.training.straggler).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.config import RunConfig
from megatron.config.deepspeed import deepspeed_batch_factor
from megatron.engine.timers import PhaseTimers, time_optimizer_inner_step
from megatron.engine.ulysses import backward_loss_scale
from megatron.model.moe import set_aux_loss_scale
from megatron.training.exit import ExitMonitor
from megatron.training.guards import LossGuard
from megatron.training.metrics import TrainingLogger, current_device_name, peak_tflops_for_device, throughput_metrics
from megatron.training.profiling import ProfilerWindow
from megatron.training.straggler import ForwardTimer, gather_per_rank, straggler_report
from megatron.training.timing import format_timers, gather_timers, memory_scalars, timer_scalars
from megatron.training.watchdog import HangWatchdog, StepClock, default_store


def loss_part_factor(rc: RunConfig) -> float:
    """What a rank's part of the micro-batch loss is multiplied by before the backward when the sequence is split
    (1 otherwise): cp on the pipeline engine (``GPTLossFn``: DeepSpeed averages over its dp x cp data axis), the
    model engine's ``backward_loss_scale`` (Ulysses, CP on ZeRO-2/3). The MoE layers' aux and z parts get it too."""
    if rc.deepspeed_engine == "pipeline":
        return float(deepspeed_batch_factor(rc))
    p = rc.parallel
    return backward_loss_scale(rc.deepspeed_zero_stage, p.ds_sequence_parallel_size * p.context_parallel_size)


@dataclasses.dataclass
class Progress:
    """What a resume needs to continue exactly where the run stopped (saved in the checkpoint)."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    skipped_iterations: int = 0
    nonfinite_iterations: int = 0


@dataclasses.dataclass
class IterationRecord:
    iteration: int
    loss: float
    grad_norm: Optional[float]
    lr: float
    global_batch_size: int
    skipped: bool


class Trainer:
    def __init__(self, rc: RunConfig, engine, *, lr_scheduler, microbatches, train_iterator, valid_iterators,
                 logger: TrainingLogger, exit_monitor: ExitMonitor, progress: Progress,
                 save_fn: Optional[Callable[[Progress], None]] = None,
                 sync_fn: Optional[Callable[[], None]] = None, world_size: int = 1,
                 save_poll_fn: Optional[Callable[[], None]] = None, save_wait_fn: Optional[Callable[[], None]] = None,
                 harness_fn: Optional[Callable[[], dict]] = None,
                 moe_stats_fn: Optional[Callable[[], dict[str, float]]] = None, token_count=None,
                 reached_fn: Optional[Callable[[int], None]] = None):
        self.rc = rc
        self.engine = engine
        self.moe_stats_fn = moe_stats_fn  # collective, after every trained iteration (megatron.model.moe.stats)
        self.token_count = token_count  # --calculate-per-token-loss with a loss mask (megatron.training.token_count)
        self.moe_stats: dict[str, float] = {}
        self.lr_scheduler = lr_scheduler
        self.microbatches = microbatches
        self.train_iterator = train_iterator
        self.valid_iterators = valid_iterators
        self.logger = logger
        self.exit_monitor = exit_monitor
        self.progress = progress
        self.save_fn = save_fn
        # --async-save (megatron.checkpoint.async_save): after each step, finish a background save whose writers are
        # done (or stop the run if one failed); at the end of the loop, whatever the reason, wait for it.
        self.save_poll_fn = save_poll_fn
        self.save_wait_fn = save_wait_fn
        self.sync_fn = sync_fn
        self.reached_fn = reached_fn  # after every iteration: the job's progress, for in-job restarts (restarts.py)
        self.world_size = world_size
        self.harness_fn = harness_fn  # --eval-harness-tasks on the live model: {"task/metric": value}
        self.history: list[IterationRecord] = []
        self.last_validation: dict[str, float] = {}
        # MFU needs the device's peak: known GPUs by name, or --peak-tflops; None on CPU (TFLOPs only).
        device_name = current_device_name()
        self.peak_tflops = peak_tflops_for_device(device_name, rc.logging.peak_tflops)
        if rc.logging.log_throughput and self.peak_tflops is None:
            logger.print_fn(f"--log-throughput: no MFU, the peak TFLOP/s of {device_name or 'a CPU'} is not known; "
                            f"--peak-tflops gives it", flush=True)
        t = rc.training
        self.guard = LossGuard(check_for_nan=t.check_for_nan_in_loss_and_grad, max_nonfinite_steps=t.max_nonfinite_steps,
                               loss_spike_factor=t.loss_spike_factor, loss_scaling=rc.fp16)
        self.loss_spikes = 0
        self._setup_instruments()

    def _setup_instruments(self) -> None:
        """The phase timers (--timing-log-level), shared with the engine, and the --profile window."""
        log = self.rc.logging
        self.device = getattr(self.engine, "device", None)
        on_cuda = isinstance(self.device, torch.device) and self.device.type == "cuda"
        self.timers = PhaseTimers(log.timing_log_level, torch.cuda.synchronize if on_cuda else None)
        if hasattr(self.engine, "phase_timers"):  # ModelEngine times its forward-backward and optimizer
            self.engine.phase_timers = self.timers
        time_optimizer_inner_step(getattr(self.engine, "optimizer", None), self.timers)
        if log.timing_log_level >= 2:
            self.train_iterator = _TimedIterator(self.train_iterator, self.timers)
        self.profiler = ProfilerWindow(log, dist.get_rank() if dist.is_initialized() else 0)
        # --log-straggler: the model's forward calls timed (training steps only: paused around evaluations)
        self.forward_timer = ForwardTimer(self.engine.module, cuda=on_cuda) if log.log_straggler else None
        e = self.rc.exit
        self.step_clock = None if e.hang_watchdog_factor is None else StepClock(
            e.hang_watchdog_factor, e.hang_watchdog_min_seconds, e.hang_watchdog_warmup_iters)

    # ---- schedule ---------------------------------------------------------------------------
    def _done(self) -> bool:
        t, p = self.rc.training, self.progress
        if t.train_tokens is not None and p.consumed_tokens >= t.train_tokens:
            return True
        if t.train_iters is not None:
            return p.iteration >= t.train_iters
        return p.consumed_samples >= t.train_samples

    def _total_iters(self) -> int:
        t, gbs = self.rc.training, self.rc.batch.global_batch_size
        total = t.train_iters if t.train_iters is not None else t.train_samples // gbs
        if t.train_tokens is not None:
            total = min(total, -(-t.train_tokens // (gbs * self.rc.data.seq_length)))
        return total

    def _in_skip_range(self, iteration: int) -> bool:
        return any(start <= iteration <= end for start, end in self.rc.training.skip_train_iteration_range)

    def _set_batch_size(self) -> int:
        self.microbatches.update(self.progress.consumed_samples)
        gbs = self.microbatches.get_current_global_batch_size()
        deepspeed_batch = gbs * deepspeed_batch_factor(self.rc)  # CP on the pipeline engine: x cp
        if deepspeed_batch != self.engine.train_batch_size():
            self.engine.set_train_batch_size(deepspeed_batch)
        return gbs

    # ---- one iteration ----------------------------------------------------------------------
    def _skip_data(self) -> None:
        """Consume this iteration's micro-batches without training on them (Megatron's skip)."""
        for _ in range(self.microbatches.get()):
            next(self.train_iterator)

    def train_step(self) -> IterationRecord:
        gbs = self._set_batch_size()
        iteration = self.progress.iteration + 1
        if self._in_skip_range(iteration):
            self._skip_data()
            self.moe_stats = {}
            self.lr_scheduler.step(gbs)  # the schedule follows consumed samples, trained on or not
            record = IterationRecord(iteration, float("nan"), None, self.lr_scheduler.get_lr(), gbs, True)
        else:
            # MoE balancing losses get the gradient the language-model loss gets: 1 / micro-batches per step, times
            # the factor a rank's part of it gets under context parallelism or Ulysses
            set_aux_loss_scale(self.engine.module, loss_part_factor(self.rc) / self.engine.gradient_accumulation_steps())
            with self.timers("train-batch", 1):
                if self.token_count is None:
                    loss = self.engine.train_batch(self.train_iterator)
                else:
                    loss = self.engine.train_batch(self.token_count.step_iterator(self.train_iterator,
                                                                                  self.microbatches.get()))
                    self.token_count.end_step()
                loss = float(loss.item()) if torch.is_tensor(loss) else float(loss)
            if self.moe_stats_fn is not None:
                self.moe_stats = self.moe_stats_fn()
            applied = self.engine.was_step_applied()
            grad_norm = self.engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else None
            if applied:
                self.lr_scheduler.step(gbs)
                if self.sync_fn is not None:
                    self.sync_fn()
            record = IterationRecord(iteration, loss, grad_norm, self.lr_scheduler.get_lr(), gbs, not applied)
            self._count_nonfinite(record)
        self.progress.iteration = iteration
        self.progress.consumed_samples += gbs
        self.progress.consumed_tokens += gbs * self.rc.data.seq_length
        self.history.append(record)
        return record

    def _count_nonfinite(self, record: IterationRecord) -> None:
        """Skipped and non-finite counts; NonFiniteLossError (before any save) when the guard says stop."""
        if record.skipped:
            self.progress.skipped_iterations += 1
        if self.guard.nonfinite(record.loss, record.grad_norm, record.skipped):
            self.progress.nonfinite_iterations += 1
        spike = self.guard.observe(record.iteration, record.loss, record.grad_norm, record.skipped)
        if spike is not None:
            self.loss_spikes += 1
            self.logger.print_fn(f"iteration {record.iteration}: loss spike, {record.loss:.4E} is {spike:.1f} x the "
                                 f"mean of the last {len(self.guard.recent) - 1} losses", flush=True)
            self.logger.write_scalars({"loss-spikes/loss-spike-ratio": spike,
                                       "loss-spikes/loss-spikes": self.loss_spikes}, record.iteration)

    # ---- evaluation -------------------------------------------------------------------------
    def evaluate(self, iterators: dict, test: bool = False) -> dict[str, float]:
        with self._forward_untimed():
            results = self._evaluate(iterators, test)
        if not test:
            self.last_validation = results
        return results

    def _evaluate(self, iterators: dict, test: bool) -> dict[str, float]:
        results = {}
        self.engine.eval()
        for name, iterator in iterators.items():
            losses = [float(self.engine.eval_batch(iterator).item()) for _ in range(self.rc.training.eval_iters)]
            results[name] = sum(losses) / len(losses)
            self.logger.validation(name=name or None, loss=results[name], iteration=self.progress.iteration,
                                   consumed_samples=self.progress.consumed_samples,
                                   consumed_tokens=self.progress.consumed_tokens, test=test)
        self.engine.train()
        return results

    @contextlib.contextmanager
    def _forward_untimed(self):
        """--log-straggler: the forward calls inside (evaluations) are not timed."""
        if self.forward_timer is not None:
            self.forward_timer.active = False
        try:
            yield
        finally:
            if self.forward_timer is not None:
                self.forward_timer.active = True

    def evaluate_harness(self) -> dict[str, float]:
        """--eval-harness-tasks on the live model (every rank), logged as lm-eval/TASK/METRIC at this iteration."""
        start = time.time()
        with self._forward_untimed():
            metrics = self.harness_fn()
        self.logger.write_scalars({f"lm-eval/{name}": value for name, value in metrics.items()}, self.progress.iteration)
        self.logger.print_fn(f" lm-eval at iteration {self.progress.iteration} ({time.time() - start:.1f} s) | "
                             + " | ".join(f"{name}: {value:.6g}" for name, value in sorted(metrics.items())) + " |",
                             flush=True)
        return metrics

    # ---- the loop ---------------------------------------------------------------------------
    def _log(self, records: list[IterationRecord], elapsed_s: float) -> None:
        last = records[-1]
        trained = [r for r in records if math.isfinite(r.loss)]
        loss = sum(r.loss for r in trained) / len(trained) if trained else float("nan")
        ms = 1000.0 * elapsed_s / len(records)
        timers_text = self._report_instruments(last.iteration, len(records)) + self._report_straggler(
            last.iteration, len(records))
        rates = throughput_metrics(self.rc.model, last.global_batch_size, self.rc.training.checkpoint_activations,
                                   max(ms, 1e-9) / 1000.0, self.world_size, self.peak_tflops)
        self.logger.training(tflops_per_gpu=rates["hardware_tflops_per_gpu"],
                             model_tflops_per_gpu=rates["model_tflops_per_gpu"], mfu=rates["mfu"],
                             iteration=last.iteration, train_iters=self._total_iters(),
                             consumed_samples=self.progress.consumed_samples,
                             consumed_tokens=self.progress.consumed_tokens, elapsed_ms_per_iter=ms, lr=last.lr,
                             global_batch_size=last.global_batch_size, loss=loss, grad_norm=last.grad_norm,
                             skipped=self.progress.skipped_iterations, nan_iters=self.progress.nonfinite_iterations,
                             seq_length=self.rc.data.seq_length, world_size=self.world_size, timers=timers_text,
                             moe=self.moe_stats)

    def _report_instruments(self, iteration: int, num_iterations: int) -> str:
        """Timers across ranks (a collective, every rank) and memory to TensorBoard; the log line's part."""
        log = self.rc.logging
        if log.log_memory_to_tensorboard:
            self.logger.write_scalars(memory_scalars(self.device), iteration)
        if log.timing_log_level == 0:
            return ""
        per_rank = gather_timers(self.timers.elapsed_ms(), num_iterations)
        if log.log_timers_to_tensorboard:
            self.logger.write_scalars(timer_scalars(per_rank), iteration)
        return format_timers(per_rank, log.timing_log_option)

    def _report_straggler(self, iteration: int, num_iterations: int) -> str:
        """--log-straggler: every rank's forward time per iteration (a collective, every rank); the log line's part
        and the scalars."""
        if self.forward_timer is None:
            return ""
        per_rank = gather_per_rank(self.forward_timer.take_ms() / num_iterations)
        text, scalars = straggler_report(per_rank, self.rc.logging.straggler_minmax_count)
        self.logger.write_scalars(scalars, iteration)
        return text

    def train(self) -> str:
        """Train until the end of the schedule or an exit condition; return the exit reason ('' at the end)."""
        pending: list[IterationRecord] = []
        window_start = time.time()
        self.engine.train()
        watchdog = None
        if self.step_clock is not None:  # --hang-watchdog-factor: one thread per rank
            watchdog = HangWatchdog(self.step_clock, rank=dist.get_rank() if dist.is_initialized() else 0,
                                    world_size=self.world_size, store=default_store(),
                                    poll_s=min(1.0, self.rc.exit.hang_watchdog_min_seconds / 10))
            watchdog.start()
        try:
            reason = self._train_loop(pending, window_start)
            if self.save_wait_fn is not None:
                self.save_wait_fn()
            return reason
        finally:
            if watchdog is not None:
                watchdog.stop()
            self.profiler.close()

    def _clock(self, what: str, *args, **kwargs) -> None:
        """--hang-watchdog-factor: tell the step clock (megatron.training.watchdog) where the loop is."""
        if self.step_clock is not None:
            getattr(self.step_clock, what)(time.monotonic(), *args, **kwargs)

    def _train_loop(self, pending: list[IterationRecord], window_start: float) -> str:
        log_interval = self.rc.logging.log_interval
        ckpt, t = self.rc.checkpoint, self.rc.training
        while not self._done():
            step_start = time.time()
            self.profiler.before_step(self.progress.iteration)
            self._clock("start", self.progress.iteration + 1)
            record = self.train_step()
            if self.reached_fn is not None:
                self.reached_fn(self.progress.iteration)
            self.profiler.after_step(self.progress.iteration)
            if self.save_poll_fn is not None:
                self.save_poll_fn()
            if t.torch_compile and len(self.history) == 1:
                self.logger.print_fn(f"torch.compile: iteration {record.iteration} took {time.time() - step_start:.1f} s, "
                             f"compiling the transformer layers' forward and backward included", flush=True)
            pending.append(record)
            it = self.progress.iteration
            if it % self.rc.logging.tensorboard_log_interval == 0:
                self.logger.scalars(iteration=it, consumed_samples=self.progress.consumed_samples,
                                    consumed_tokens=self.progress.consumed_tokens, loss=record.loss, lr=record.lr,
                                    global_batch_size=record.global_batch_size, grad_norm=record.grad_norm)
                self.logger.write_scalars(self.moe_stats, it)
            if it % log_interval == 0:
                self._log(pending, time.time() - window_start)
                pending, window_start = [], time.time()
            self._clock("pause")  # evaluations and saves are not watched, nor counted in the step's time
            if t.eval_interval and t.eval_iters and it % t.eval_interval == 0 and self.valid_iterators:
                self.evaluate(self.valid_iterators)
                window_start = time.time()
            if self.harness_fn is not None and it % t.eval_harness_interval == 0:
                self.evaluate_harness()
                window_start = time.time()
            saved = False
            if ckpt.save and ckpt.save_interval and it % ckpt.save_interval == 0 and self.save_fn is not None:
                self.save_fn(self.progress)
                saved = True
            self._clock("resume")
            reason = self.exit_monitor.check(it)
            self._clock("stop", timed=not self._in_skip_range(it))  # a step that skipped its data is no step's time
            if reason:
                if ckpt.save and not saved and self.save_fn is not None:
                    self.save_fn(self.progress)
                return reason
        saved_by_interval = ckpt.save_interval and self.progress.iteration % ckpt.save_interval == 0
        if ckpt.save and self.save_fn is not None and not saved_by_interval:
            self.save_fn(self.progress)
        return ""


class _TimedIterator:
    """The training batches, each ``next`` timed as Megatron's 'batch-generator' (level 2)."""

    def __init__(self, iterator, timers: PhaseTimers):
        self.iterator = iterator
        self.timers = timers

    def __iter__(self):
        return self

    def __next__(self):
        with self.timers("batch-generator", 2):
            return next(self.iterator)
