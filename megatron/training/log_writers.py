"""Where the training scalars go: TensorBoard (--tensorboard-dir) and Weights & Biases (--wandb-project), both
behind one ``add_scalar(tag, value, step)``, so that every scalar the ``TrainingLogger`` writes reaches both.

Only the last rank writes (it holds the loss after the pipeline), as Megatron-LM's and Megatron-DeepSpeed's do.
W&B gets TensorBoard's tag names; the "... vs samples" and "... vs tokens" tags, whose TensorBoard step is the
consumed samples or tokens, are logged at the current iteration with a ``Samples`` or ``Tokens`` column as their
x axis (W&B's steps must not decrease), as Megatron-DeepSpeed's interop logger does.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

from megatron.config.run import LoggingConfig

# TensorBoard tags whose step is not the iteration, and the W&B column that stands for that step
# (Megatron-DeepSpeed's x-axis names).
CUSTOM_AXES = ((" vs samples", "Samples"), (" vs tokens", "Tokens"))


def wandb_enabled(logging: LoggingConfig) -> bool:
    """W&B logs when a project is named; an empty --wandb-project (a launch script's unset variable) is none."""
    return bool(logging.wandb_project)


def check_wandb_installed(logging: LoggingConfig) -> None:
    """Refuse --wandb-project where the wandb package is missing, on every rank, before any process group."""
    if wandb_enabled(logging) and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"--wandb-project {logging.wandb_project!r} logs to Weights & Biases, but the wandb package "
                         f"is not installed in this Python: install the version requirements.txt pins (`pip install "
                         f"-r requirements.txt`, or `make venv`), or leave --wandb-project out")


def wandb_save_dir(logging: LoggingConfig, save: Optional[str]) -> str:
    """--wandb-save-dir, else --save's wandb/ folder (Megatron's default), else the working directory."""
    if logging.wandb_save_dir:
        return logging.wandb_save_dir
    return os.path.join(save, "wandb") if save else os.getcwd()


class WandbWriter:
    """A W&B run behind TensorBoard's ``add_scalar``."""

    def __init__(self, run):
        self.run = run
        self.iteration = 0  # the W&B step: the last iteration a tag was logged at
        self.defined: set[str] = set()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for suffix, axis in CUSTOM_AXES:
            if tag.endswith(suffix):
                if tag not in self.defined:
                    self.run.define_metric(axis)
                    self.run.define_metric(tag, step_metric=axis)
                    self.defined.add(tag)
                self.run.log({tag: value, axis: step}, step=self.iteration)
                return
        self.iteration = max(self.iteration, step)
        self.run.log({tag: value}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_wandb(logging: LoggingConfig, save: Optional[str], config: dict) -> WandbWriter:
    """Start the W&B run (online, or offline under WANDB_MODE=offline) with ``config`` as its config."""
    import wandb  # noqa: PLC0415 (optional, about half a second to import: only on the rank that logs to W&B)

    directory = wandb_save_dir(logging, save)
    os.makedirs(directory, exist_ok=True)
    try:
        run = wandb.init(project=logging.wandb_project, name=logging.wandb_exp_name or None,
                         entity=logging.wandb_entity or None, dir=directory, config=config)
    except Exception as error:  # wandb's own errors (no API key, no network) share no base class worth naming
        raise ValueError(f"W&B could not start the run of --wandb-project {logging.wandb_project!r}: {error}; where "
                         f"there is no network, set WANDB_MODE=offline (the run is kept in {directory}, "
                         f"`wandb sync` uploads it later)") from error
    return WandbWriter(run)


class FanOutWriter:
    """Several writers behind one ``add_scalar``: each scalar goes to every one."""

    def __init__(self, writers: list):
        self.writers = writers

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def open_writers(logging: LoggingConfig, save: Optional[str], config: dict) -> Optional[FanOutWriter]:
    """The writers the flags ask for (the last rank calls this), or None when there is none."""
    writers = []
    if logging.tensorboard_dir:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 (tensorboard, about a second to import)

        try:
            writers.append(SummaryWriter(log_dir=logging.tensorboard_dir, max_queue=logging.tensorboard_queue_size))
        except OSError as error:
            raise ValueError(f"--tensorboard-dir {logging.tensorboard_dir}: cannot write events there ({error}); "
                             f"give a folder this process can create and write") from error
    if wandb_enabled(logging):
        try:
            writers.append(open_wandb(logging, save, config))
        except BaseException:
            for writer in writers:
                writer.close()
            raise
    return FanOutWriter(writers) if writers else None
