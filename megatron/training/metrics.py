"""What a training run reports: the log line, the scalars (Megatron-DeepSpeed's tensorboard tag names, so
existing dashboards keep working) and the TFLOPs estimate.

Only the last rank writes (it holds the loss after the pipeline); the others pass ``writer=None``. The writer is
TensorBoard's, W&B's or both behind one ``add_scalar`` (megatron.training.log_writers).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.config import ModelConfig
from megatron.config.hardware import PEAK_BF16_TFLOPS

# MFU is model FLOPs (no recomputation) / (time * peak); HFU counts the recomputed forward too. The peaks:
# megatron.config.hardware.PEAK_BF16_TFLOPS.


def peak_tflops_for_device(device_name: Optional[str], override: Optional[float] = None) -> Optional[float]:
    """The peak TFLOP/s of one device: ``override`` (--peak-tflops) if given, else looked up from
    its name (e.g. torch.cuda.get_device_name(): 'NVIDIA A100-SXM4-80GB'); None when unknown (CPU)."""
    if override:
        return float(override)
    if not device_name:
        return None
    upper = device_name.upper()
    for key, peak in PEAK_BF16_TFLOPS.items():
        if key in upper:
            return peak
    return None


def current_device_name() -> Optional[str]:
    """The CUDA device's name, or None on CPU (no MFU there: no meaningful peak)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def throughput_metrics(config: ModelConfig, global_batch_size: int, checkpoint_activations: bool,
                       elapsed_s_per_iter: float, world_size: int, peak_tflops: Optional[float]) -> dict:
    """Per-GPU model TFLOP/s (no recomputation), hardware TFLOP/s (with it) and, when the peak is
    known, MFU and HFU. ``tflops_per_gpu`` is the hardware figure, the one Megatron logs as TFLOPs."""
    if elapsed_s_per_iter <= 0:
        raise ValueError(f"elapsed time per iteration must be positive, got {elapsed_s_per_iter}")
    per_gpu = elapsed_s_per_iter * world_size * 1e12
    model = config.flops_per_iteration(global_batch_size, recompute=False) / per_gpu
    hardware = config.flops_per_iteration(global_batch_size, recompute=checkpoint_activations) / per_gpu
    out = {"model_tflops_per_gpu": model, "hardware_tflops_per_gpu": hardware, "tflops_per_gpu": hardware,
           "mfu": None, "hfu": None}
    if peak_tflops:
        out.update(mfu=model / peak_tflops, hfu=hardware / peak_tflops)
    return out


def scalar_tags(prefix: str, name: str) -> tuple[str, str, str]:
    """(vs iteration, vs samples, vs tokens) tag names, e.g. 'lm-loss-training/lm loss vs samples'."""
    return f"{prefix}/{name}", f"{prefix}/{name} vs samples", f"{prefix}/{name} vs tokens"


class TrainingLogger:
    """Formats the per-interval log line and writes the scalars (TensorBoard, W&B)."""

    def __init__(self, writer=None, *, log_timers: bool = False, log_batch_size: bool = False,
                 log_validation_ppl: bool = False, log_throughput: bool = False, print_fn=print):
        self.writer = writer
        self.log_timers = log_timers
        self.log_throughput = log_throughput
        self.log_batch_size = log_batch_size
        self.log_validation_ppl = log_validation_ppl
        self.print_fn = print_fn

    def _add(self, prefix: str, name: str, value: float, iteration: int, samples: int,
             tokens: Optional[int] = None) -> None:
        if self.writer is None:
            return
        vs_iter, vs_samples, vs_tokens = scalar_tags(prefix, name)
        self.writer.add_scalar(vs_iter, value, iteration)
        self.writer.add_scalar(vs_samples, value, samples)
        if tokens is not None:
            self.writer.add_scalar(vs_tokens, value, tokens)

    def training(self, *, iteration: int, train_iters: int, consumed_samples: int, consumed_tokens: int,
                 elapsed_ms_per_iter: float, lr: float, global_batch_size: int, loss: float,
                 grad_norm: Optional[float], skipped: int, nan_iters: int, seq_length: int,
                 tflops_per_gpu: float, model_tflops_per_gpu: float, world_size: int, mfu: Optional[float] = None,
                 timers: str = "", moe: Optional[dict[str, float]] = None) -> str:
        samples_per_s = global_batch_size / (elapsed_ms_per_iter / 1000.0) if elapsed_ms_per_iter > 0 else 0.0
        tokens_per_s = samples_per_s * seq_length
        line = (f" iteration {iteration:8d}/{train_iters:8d} | consumed samples: {consumed_samples:12d} | "
                f"consumed tokens: {consumed_tokens:14d} | elapsed time per iteration (ms): {elapsed_ms_per_iter:.1f} | "
                f"learning rate: {lr:.3E} | global batch size: {global_batch_size:5d} | lm loss: {loss:.6E} | "
                f"grad norm: {grad_norm if grad_norm is not None else float('nan'):.3f} | "
                f"number of skipped iterations: {skipped:3d} | number of nan iterations: {nan_iters:3d} | "
                f"samples per second: {samples_per_s:.3f} | tokens per second: {tokens_per_s:.1f} | "
                f"TFLOPs: {tflops_per_gpu:.3g} |")
        line += f" model TFLOPs: {model_tflops_per_gpu:.3g} |"  # without recomputation (TFLOPs above counts it)
        if mfu is not None:
            line += f" MFU: {100 * mfu:.1f}% |"
        if self.log_throughput:
            line += self._throughput(iteration, model_tflops_per_gpu, tokens_per_s / world_size, mfu)
        for tag in sorted(tag for tag in (moe or {}) if tag.startswith("mtp_")):  # megatron.model.mtp
            line += f" {tag}: {moe[tag]:.6E} |"
        if moe and "moe/aux-loss" in moe:  # the last iteration's MoE statistics (megatron.model.moe.stats)
            loads = [v for tag, v in moe.items() if tag.endswith("/load-max-over-mean")]
            line += (f" moe aux loss: {moe['moe/aux-loss']:.4E} | moe z loss: {moe['moe/z-loss']:.4E} | "
                     f"moe load max/mean: {max(loads):.3f} | moe dropped fraction: {moe['moe/dropped-fraction']:.4f} |")
        line += timers  # --timing-log-level: megatron.training.timing.format_timers
        self.print_fn(line, flush=True)
        if self.log_timers and self.writer is not None:
            self.writer.add_scalar("iteration-time/iteration-time", elapsed_ms_per_iter / 1000.0, iteration)
            self.writer.add_scalar("iteration-time/samples per second", samples_per_s, iteration)
            self.writer.add_scalar("iteration-time/tokens per second", tokens_per_s, iteration)
            self.writer.add_scalar("iteration-time/TFLOPs per gpu", tflops_per_gpu, iteration)
            if mfu is not None:
                self.writer.add_scalar("iteration-time/MFU", mfu, iteration)
        return line

    def _throughput(self, iteration: int, model_tflops_per_gpu: float, tokens_per_s_per_gpu: float,
                    mfu: Optional[float]) -> str:
        """--log-throughput: Megatron-LM's log field and 'throughput' tag (model TFLOP/s per GPU, recomputation
        not counted), tokens per second per GPU, and MFU where the peak is known; the log line's part."""
        values = {"throughput": model_tflops_per_gpu, "throughput/tokens per second per GPU": tokens_per_s_per_gpu}
        if mfu is not None:
            values["throughput/MFU"] = mfu
        self.write_scalars(values, iteration)
        tflops = f"{model_tflops_per_gpu:.1f}" if model_tflops_per_gpu >= 1 else f"{model_tflops_per_gpu:.3g}"
        return f" throughput per GPU (TFLOP/s/GPU): {tflops} | tokens per second per GPU: {tokens_per_s_per_gpu:.1f} |"

    def write_scalars(self, values: dict[str, float], iteration: int) -> None:
        """Flat tags (timers, memory), as Megatron-LM writes them."""
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, iteration)

    def scalars(self, *, iteration: int, consumed_samples: int, consumed_tokens: int, loss: float, lr: float,
                global_batch_size: int, grad_norm: Optional[float]) -> None:
        """One iteration's own values to tensorboard (every --tensorboard-log-interval iterations)."""
        if math.isfinite(loss):  # a skipped iteration has no loss
            self._add("lm-loss-training", "lm loss", loss, iteration, consumed_samples, consumed_tokens)
        self._add("learning-rate", "learning-rate", lr, iteration, consumed_samples, consumed_tokens)
        if self.log_batch_size:
            self._add("batch-size", "batch-size", global_batch_size, iteration, consumed_samples, consumed_tokens)
        if grad_norm is not None and math.isfinite(grad_norm):
            self._add("grad-norm", "grad-norm", grad_norm, iteration, consumed_samples, consumed_tokens)

    def validation(self, *, name: Optional[str], loss: float, iteration: int, consumed_samples: int,
                   consumed_tokens: int, test: bool = False) -> str:
        kind = "test" if test else "validation"
        ppl = math.exp(min(20.0, loss))
        label = f"{name} " if name else ""
        line = f" {kind} loss at iteration {iteration} | {label}lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
        self.print_fn("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
        prefix = f"lm-loss-validation/{name}" if name else "lm-loss-validation"
        self._add(prefix, f"lm loss {kind}", loss, iteration, consumed_samples, consumed_tokens)
        if self.log_validation_ppl:
            self._add(prefix, f"lm loss {kind} ppl", ppl, iteration, consumed_samples, consumed_tokens)
        return line
