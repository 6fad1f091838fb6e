"""``check_argv``: every problem of a command line at once, for ``pretrain_gpt.py --dry-run``.

``run_config_from_argv`` stops at the first problem, as a launch should; a dry run wants them all. Both run
the same declared steps (``megatron.arguments.steps``); here in collect mode
(``megatron.arguments.runner``): each step whose inputs passed runs, each problem is recorded, and a step
whose inputs failed is said "not checked" with the step it waits on. Before the steps, what only a dry run
meets in the command line itself:

1. the flags themselves (argparse): an unknown flag is reported and left out, so the rest is still
   checked; an unreadable value stops everything;
2. a split file that cannot be read (the cluster's, on a laptop): reported, and a stand-in group takes its
   place so that the settings and the plan are still checked;
3. the world size: --world-size, else the one the launch environment plans.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Mapping, Optional, Sequence

from megatron.arguments.flags import build_parser
from megatron.arguments.runner import FAILED, OK, Outcome, run_steps
from megatron.arguments.steps import ACROSS_SETTINGS, FLAG_STEPS, STEPS, VOCABULARY, Run
from megatron.config import RunConfig
from megatron.config.launch import planned_world_size
from megatron.data.dataset_utils import read_groups_file


@dataclasses.dataclass
class ArgvCheck:
    """What ``check_argv`` found. ``run_config`` is set when every setting is valid (missing files aside:
    a laptop has no data, and the plan can still be shown); its vocabulary is filled when the tokenizer
    was built."""

    world_size: Optional[int]
    world_size_source: str
    problems: list[str] = dataclasses.field(default_factory=list)
    not_checked: list[str] = dataclasses.field(default_factory=list)
    warnings: tuple[str, ...] = ()          # what the job would log at startup (RunConfig.startup_warnings)
    run_config: Optional[RunConfig] = None
    dry_run_options: Optional[argparse.Namespace] = None  # the parsed flags (--dry-run-json, --dry-run-gpu, ...)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_argv(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> ArgvCheck:
    """Every problem of ``argv`` (pretrain_gpt.py's flags, ``--world-size`` included) that can be found
    without starting the job; the world size is ``--world-size``, else ``planned_world_size(env)``."""
    argv, outcome = list(argv), Outcome()
    parser = build_parser()
    parser.exit_on_error = False
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as error:
        return ArgvCheck(None, "unknown", [str(error)], ["everything else: the flags could not be read"])
    if unknown:
        outcome.add(f"unrecognized arguments: {' '.join(unknown)}")
        argv = _without_unknown(parser, argv, args, unknown)
    unread = ()
    if argv is not None:
        args, unread = _unread_split_files_left_out(parser, argv, args, outcome)
    world, source, planned = _world_size(args, env)
    result = ArgvCheck(world, source, outcome.problems, dry_run_options=args)
    result.not_checked += [f"the data files of --{split}-weighted-split-paths-path: it could not be read"
                           for split in unread]
    run = Run(args, planned, collect=True, stand_in_splits=tuple(unread))
    run_steps(run, FLAG_STEPS if argv is None else STEPS, outcome)
    result.not_checked += outcome.not_checked()
    if argv is None:
        result.not_checked.append("the settings' own rules (model, parallel layout, batch, optimizer, schedule, "
                                  "...), the tokenizer and the DeepSpeed JSON merge: the flags around an "
                                  "unrecognized one could not be told apart")
    result.warnings = getattr(args, "startup_warnings", ())
    if outcome.state.get(ACROSS_SETTINGS) == OK and outcome.state.get(VOCABULARY) != FAILED:
        result.run_config = run.config
    return result


def _world_size(args: argparse.Namespace, env: Optional[Mapping[str, str]]):
    """(world size or None, where it comes from, the world-size step's function: (world, rank 0) or the
    reason it is unknown)."""
    try:
        world, source = ((args.dry_run_world_size, "--world-size") if args.dry_run_world_size is not None
                         else planned_world_size(env))
    except ValueError as error:
        reason = str(error)

        def unknown() -> tuple[int, int]:
            raise ValueError(reason)

        return None, "unknown", unknown
    return world, source, lambda: (world, 0)


def _without_unknown(parser, argv: list[str], args, unknown: list[str]) -> Optional[list[str]]:
    """``argv`` without its unrecognized tokens (argparse returns them in order), so the other checks can
    run; None when that cannot be done safely (the rest would then parse differently)."""
    rest, pending = [], list(unknown)
    for token in argv:
        if pending and token == pending[0]:
            pending.pop(0)
        else:
            rest.append(token)
    try:
        again, left = parser.parse_known_args(rest)
    except argparse.ArgumentError:
        return None
    return rest if not left and not pending and vars(again) == vars(args) else None


def _unread_split_files_left_out(parser, argv: list[str], args, outcome: Outcome):
    """A ``--SPLIT-weighted-split-paths-path FILE`` that cannot be read (on a laptop, the cluster's split
    files are not there) is a problem; for the other checks and the plan it is replaced by a one-dataset
    stand-in group (``--SPLIT-weighted-split-paths "unread: 1 0:1 FILE"``), as what the plan needs of the
    data is only whether there is some. Returns (the flags with the stand-ins, the splits left out)."""
    unread = []
    for split in ("train", "valid", "test"):
        flag, path = f"--{split}-weighted-split-paths-path", getattr(args, f"{split}_weighted_split_paths_path")
        if path is None or getattr(args, f"{split}_weighted_split_paths"):
            continue
        try:
            read_groups_file(path, flag)
        except ValueError as error:
            outcome.add(str(error))
            at = next(i for i, token in enumerate(argv) if token == flag or token.startswith(flag + "="))
            value = [] if "=" in argv[at] else argv[at + 1:at + 2]
            argv = argv[:at] + [f"--{split}-weighted-split-paths", f"unread: 1 0:1 {path}"] + argv[at + 1 + len(value):]
            unread.append(split)
    return (parser.parse_known_args(argv)[0], unread) if unread else (args, unread)
