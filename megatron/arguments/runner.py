"""The runner of the argument pipeline (``megatron.arguments.steps.STEPS``), in its two modes.

- stop (``run_config_from_argv``, a real launch): the steps in order; the first problem is a ValueError.
- collect (``check_argv``, ``pretrain_gpt.py --dry-run``): every step whose needs passed runs; each problem is
  recorded, and a step whose needs failed is skipped and said "not checked" with the failed step it waits on.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

from megatron.arguments.flags import build_parser
from megatron.arguments.steps import STEPS, Problems, Run, Step
from megatron.config import RunConfig
from megatron.config.launch import detect_launch

logger = logging.getLogger("megatron.arguments")

OK, OFF, FAILED = "ok", "off", "failed"  # a skipped step's state is the name of the failed step it waits on


@dataclasses.dataclass
class Outcome:
    """What a run of the steps found (collect mode): ``problems`` in the order found, each once; ``state`` of
    every step (OK, OFF, FAILED, or the name of the failed step it waits on)."""

    problems: list[str] = dataclasses.field(default_factory=list)
    state: dict[str, str] = dataclasses.field(default_factory=dict)

    def add(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)

    def not_checked(self) -> list[str]:
        """One line per failed step that others wait on, naming them, in the order of the steps."""
        waiting: dict[str, list[str]] = {}
        for name, state in self.state.items():
            if state not in (OK, OFF, FAILED):
                waiting.setdefault(state, []).append(name)
        order = list(self.state)
        return [f"{', '.join(names)}: not checked, as they need {failed} (see the problems above)"
                for failed, names in sorted(waiting.items(), key=lambda item: order.index(item[0]))]


def run_steps(run: Run, steps: Sequence[Step] = STEPS, outcome: Optional[Outcome] = None) -> Outcome:
    """Run ``steps`` on ``run``: in stop mode the first problem is raised, in collect mode (``run.collect``)
    every one is recorded in ``outcome`` (a new one by default; the dry run's holds what it found first)."""
    outcome = outcome if outcome is not None else Outcome()
    for step in steps:
        outcome.state[step.name] = _run_step(run, step, outcome)
    return outcome


def _run_step(run: Run, step: Step, outcome: Outcome) -> str:
    if step.when is not None and not step.when(run):
        return OFF
    for need in step.needs:
        state = outcome.state[need]  # a KeyError here: a step needs one declared after it
        if state != OK:
            return OFF if state == OFF else need if state == FAILED else state
    try:
        step.run(run.args if step.on == "args" else run)
    except Problems as problems:
        for message in problems.messages:
            outcome.add(message)
        return FAILED
    except ValueError as error:
        if not run.collect:
            raise
        outcome.add(str(error))
        return FAILED
    return OK


def run_config_from_argv(argv: Optional[Sequence[str]] = None, *, world_size: Optional[int] = None,
                         tokenizer=None, with_vocab: bool = True) -> RunConfig:
    """The validated ``RunConfig`` of ``argv`` (default ``sys.argv[1:]``) for ``world_size`` processes
    (default: what the launcher set, ``megatron.config.launch``).

    with_vocab: build the tokenizer the flags name (or take ``tokenizer``, anything with a
    ``vocab_size``) and fill ``model.original_vocab_size`` / ``padded_vocab_size``; False leaves
    them None (for checking a job's flags where its tokenizer files are not at hand).
    Raises ValueError naming the problem and the fix for any impossible configuration. The startup warnings
    (``RunConfig.startup_warnings``) are logged once, on rank 0.
    """
    def launch() -> tuple[int, int]:
        found = detect_launch()
        return (world_size if world_size is not None else found.world_size), found.rank

    run = Run(build_parser().parse_args(argv), launch, tokenizer=tokenizer, with_vocab=with_vocab)
    run_steps(run)
    if run.args.rank == 0:
        for message in run.config.startup_warnings:
            logger.warning(message)
    return run.config
