"""Running lm-evaluation-harness tasks on a model: which tasks, the run, its JSON and its tensorboard scalars.

    manager = task_manager(["tiny_choice"], include_path="examples/eval_tasks")
    results = run_tasks(lm, ["tiny_choice"], manager, HarnessSettings(batch_size=8, limit=100))
    save_results(results, "out/")                 # the harness's own results_<date>.json
    headline_metrics(results)                     # {"tiny_choice/acc": 0.25, ...}

Tasks come from the harness's YAML files: its built-in ones (indexing all of them takes the harness tens of
seconds) and those under ``include_path``. When every requested task is found under ``include_path`` the
built-in ones are not indexed at all; ``builtin=False`` never indexes them.

Bad input is one ValueError each, naming the file or task and the fix: a task file that is not valid YAML
(the harness would skip it silently and then not find its task), a task the index does not hold, a task
whose configuration the harness refuses (an unknown output_type, a missing data file, ...).

Datasets are whatever the task's ``dataset_path`` says: a local ``json`` / ``csv`` file, or a dataset of the
Hugging Face hub read from the local cache (set ``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1`` on a
cluster without internet: nothing is then downloaded, and a dataset missing from the cache is an error).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import random
from typing import Optional, Sequence

__all__ = ["HarnessSettings", "task_manager", "check_task_files", "run_tasks", "score_tasks", "save_results",
           "headline_metrics", "write_tensorboard"]


@dataclasses.dataclass(frozen=True)
class HarnessSettings:
    """What the harness decides, under its own command-line names (lm_eval --num_fewshot ...)."""

    num_fewshot: Optional[int] = None      # examples in each prompt (None: the task's own default)
    limit: Optional[float] = None          # documents per task (a fraction when below 1; None: all)
    log_samples: bool = False              # keep every document's requests and responses in the results
    seed: int = 1234                       # the harness's seeds (python, numpy, torch, few-shot sampling)
    gen_kwargs: Optional[str] = None       # "key=value,..." overriding the tasks' generation settings

    def validate(self) -> "HarnessSettings":
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"num_fewshot must be >= 0, got {self.num_fewshot}")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"limit must be > 0 (documents per task, or a fraction below 1), got {self.limit}")
        return self


def check_task_files(include_path: str) -> list[pathlib.Path]:
    """Every ``*.yaml`` under ``include_path``, each parsed as the harness parses it; a ValueError naming the
    first file that is not valid YAML or not a mapping (the harness's index would skip it without a word)."""
    from lm_eval.tasks._yaml_loader import load_yaml  # noqa: PLC0415 (lm_eval: seconds to import, only to evaluate)

    root = pathlib.Path(include_path)
    if not root.exists():
        raise ValueError(f"include_path {include_path!r} does not exist; pass a folder (or file) of task YAMLs")
    files = [root] if root.is_file() else sorted(root.glob("**/*.yaml"))
    for path in files:
        try:
            config = load_yaml(path, resolve_func=False)
        except Exception as error:  # noqa: BLE001 - yaml's errors, a missing include, a cycle: all one message
            raise ValueError(f"task file {str(path)!r} cannot be read as a task: {error}; fix the YAML "
                             f"(see examples/eval_tasks/ for working ones)") from error
        if "task" not in config and "group" not in config and "include" not in config:
            raise ValueError(f"task file {str(path)!r} names no task (no 'task:' or 'group:' key); add one")
    return files


def task_manager(tasks: Sequence[str], include_path: Optional[str] = None, builtin: bool = True):
    """The harness's TaskManager holding every task of ``tasks``: those under ``include_path`` alone when all
    are there (the built-in index is then skipped), else with the built-in ones (unless ``builtin`` is False)."""
    from lm_eval.tasks import TaskManager  # noqa: PLC0415 (lm_eval: seconds to import, only to evaluate)

    if not tasks:
        raise ValueError("no task given; pass --tasks NAME[,NAME...] (`lm_eval ls tasks` lists the built-in ones)")
    manager = None
    if include_path is not None:
        check_task_files(include_path)
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if not _missing(manager, tasks):
            return manager
    if builtin:
        manager = TaskManager(include_path=include_path)
    missing = _missing(manager, tasks) if manager is not None else list(tasks)
    if missing:
        where = f"under include_path {include_path!r}" if include_path else "among the harness's tasks"
        where += "" if builtin or include_path is None else " (built-in tasks not searched)"
        known = sorted(manager.all_tasks)[:20] if manager is not None and not builtin else []
        raise ValueError(f"unknown task(s) {', '.join(missing)} {where}" + (f"; known: {', '.join(known)}" if known else "")
                         + "; check the names (`lm_eval ls tasks` lists the built-in ones) or pass --include_path")
    return manager


def _missing(manager, tasks: Sequence[str]) -> list[str]:
    known = set(manager.all_tasks)
    return [task for task in tasks if task not in known]


def run_tasks(lm, tasks: Sequence[str], manager, settings: HarnessSettings = HarnessSettings()) -> dict:
    """The harness's results dict (``lm_eval.simple_evaluate``) of ``lm`` on ``tasks``. The harness seeds
    python's, numpy's and torch's global generators with ``settings.seed``; callers that must not be
    disturbed save and restore them."""
    from lm_eval import simple_evaluate  # noqa: PLC0415 (lm_eval: seconds to import, only to evaluate)

    settings.validate()
    _load_tasks(manager, tasks)  # refused here, in one message, rather than inside the harness
    seed = settings.seed
    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, num_fewshot=settings.num_fewshot,
                           limit=settings.limit, log_samples=settings.log_samples, gen_kwargs=settings.gen_kwargs,
                           random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                           fewshot_random_seed=seed, bootstrap_iters=0)


def score_tasks(lm, tasks: Sequence[str], manager, settings: HarnessSettings = HarnessSettings()) -> dict:
    """The harness's results of ``lm`` on ``tasks`` without the record of the run around them (the
    environment, git hashes, the tokenizer: seconds of subprocesses that simple_evaluate spends every time),
    on every process that calls it: for scoring often, during training. Seeds as ``run_tasks``."""
    import numpy as np  # noqa: PLC0415 (beside the harness's imports)
    import torch  # noqa: PLC0415 (beside the harness's imports)
    from lm_eval.evaluator import evaluate  # noqa: PLC0415 (lm_eval: seconds to import, only to evaluate)

    settings.validate()
    loaded = _load_tasks(manager, tasks)
    for task in loaded["tasks"].values():
        if settings.num_fewshot is not None:
            task.set_config(key="num_fewshot", value=settings.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=settings.seed)
    random.seed(settings.seed)
    np.random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    return evaluate(lm=lm, task_dict=loaded, limit=settings.limit, bootstrap_iters=0,
                    log_samples=settings.log_samples, verbosity=None)


def _load_tasks(manager, tasks: Sequence[str]) -> dict:
    """``manager.load(tasks)``, with whatever the harness refuses (an unknown output_type, a template that does
    not render, a data file that is missing) as one ValueError."""
    try:
        return manager.load(list(tasks))
    except Exception as error:  # noqa: BLE001 - jinja, datasets, the harness's config checks: one message
        raise ValueError(f"task(s) {', '.join(tasks)}: the harness cannot load them: {error}; fix the task "
                         f"file or its data files") from error


def save_results(results: dict, output_path: str, model_name: str) -> str:
    """Write ``results`` as the harness's CLI does for ``--output_path`` (``EvaluationTracker``: the aggregated
    results_<date>.json, and samples_<task>_<date>.jsonl when they were logged, in a folder named after
    ``model_name`` (the checkpoint's path, sanitized as the harness sanitizes a model's path)); that folder."""
    from lm_eval.loggers import EvaluationTracker  # noqa: PLC0415 (lm_eval: seconds to import, only to evaluate)

    tracker = EvaluationTracker(output_path=output_path)
    tracker.general_config_tracker.log_experiment_args(model_source="megatron", model_args={"pretrained": model_name},
                                                       system_instruction=None, chat_template=None,
                                                       fewshot_as_multiturn=False)
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples:
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    return os.path.join(output_path, tracker.general_config_tracker.model_name_sanitized)


def headline_metrics(results: dict) -> dict[str, float]:
    """{"task/metric": value} of every finite metric in the results' per-task table (no stderr, no
    sample counts, no names)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric = key.split(",")[0]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in metric \
                    and metric != "sample_len" and math.isfinite(value):
                out[f"{task}/{metric}"] = float(value)
    return out


def write_tensorboard(metrics: dict[str, float], logdir: str, step: int, prefix: str = "lm-eval") -> None:
    """One scalar per metric, tagged ``prefix/task/metric``, at ``step`` (the checkpoint's iteration)."""
    from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 (tensorboard: only when asked for)

    os.makedirs(logdir, exist_ok=True)
    writer = SummaryWriter(log_dir=logdir)
    try:
        for name, value in sorted(metrics.items()):
            writer.add_scalar(f"{prefix}/{name}", value, step)
    finally:
        writer.close()
