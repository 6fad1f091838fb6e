"""``check_argv``: every problem of a command line at once, for ``pretrain_gpt.py --dry-run``.

``run_config_from_argv`` stops at the first problem, as a launch should; a dry run wants them all. The
checks here are the same functions, run one by one on the parts that do not depend on each other:

1. the flags themselves (argparse: unknown flags; an unreadable value stops everything);
2. what ``parse_namespace`` checks: required flags, the model flags spelled two ways, the world size
   against TP x PP, the skip ranges,
   the data flags, the DeepSpeed JSON, then the data files and the tokenizer files separately;
3. the tokenizer, built (it is cheap): it gives the padded vocabulary the memory estimate needs;
4. each config dataclass's own ``validate()`` (model, parallel layout, batch, optimizer, schedule, data,
   ...) and the DeepSpeed JSON against the flags; then, when all of them pass, the rules across them
   (``RunConfig.validate``, which stops at its first) and the vocabulary's padding.

An unknown flag is reported and left out, so the rest is still checked.

A check whose inputs failed an earlier one does not run, and ``not_checked`` says which and why.
Last, the public path itself (``run_config_from_argv``) runs on the same command line, so whatever it
checks is checked (a problem only it finds is added to the list).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
from typing import Mapping, Optional, Sequence

from megatron.arguments.build import assemble_run_config, resolve_vocab_size, run_config_from_argv
from megatron.arguments.parse import (_check_files, _check_required, _derive_parallel, _load_deepspeed_json,
                                      _parse_data, logger, merge_skip_ranges, parse_namespace,
                                      resolve_model_spellings)
from megatron.arguments.parser import build_parser
from megatron.config import RunConfig
from megatron.config.deepspeed import build_deepspeed_config
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


class _Problems(list):
    def add(self, message: str) -> None:
        if message not in self:  # the same check reached twice (e.g. by the final public-path run)
            self.append(message)

    def run(self, check, *args) -> bool:
        """``check(*args)``; a ValueError is recorded. True when it passed."""
        try:
            check(*args)
        except ValueError as error:
            self.add(str(error))
            return False
        return True


def _with(args: argparse.Namespace, **values) -> argparse.Namespace:
    out = copy.copy(args)
    vars(out).update(values)
    return out


@contextlib.contextmanager
def _startup_warnings_unlogged():
    """parse_namespace logs the startup warnings; the dry run reports them itself, once."""
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def check_argv(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> ArgvCheck:
    """Every problem of ``argv`` (pretrain_gpt.py's flags, ``--world-size`` included) that can be found
    without starting the job; the world size is ``--world-size``, else ``planned_world_size(env)``."""
    argv, problems = list(argv), _Problems()
    parser = build_parser()
    parser.exit_on_error = False
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as error:
        return ArgvCheck(None, "unknown", [str(error)], ["everything else: the flags could not be read"])
    if unknown:
        problems.add(f"unrecognized arguments: {' '.join(unknown)}")
        argv = _without_unknown(parser, argv, args, unknown)
    config_argv, unread = argv, ()
    if argv is not None:
        config_argv, args, unread = _unread_split_files_left_out(parser, argv, args, problems)
    world, source = args.dry_run_world_size, "--world-size"
    if world is None:
        try:
            world, source = planned_world_size(env)
        except ValueError as error:
            problems.add(str(error))
            source = "unknown"
    result = ArgvCheck(world, source, problems, dry_run_options=args)
    result.not_checked += [f"the data files of --{split}-weighted-split-paths-path: it could not be read"
                           for split in unread]
    with _startup_warnings_unlogged():
        flags_ok, tokenizer_files_ok = _check_flags(args, world, problems, unread)
        if flags_ok and argv is not None and world is not None:
            _check_config(config_argv, argv, world, result, tokenizer_files_ok)
        else:
            result.not_checked.append("the settings' own rules (model, parallel layout, batch, optimizer, schedule, "
                                      "...), the tokenizer and the DeepSpeed JSON merge: they need the problems "
                                      "above fixed first")
    return result


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


def _unread_split_files_left_out(parser, argv: list[str], args, problems: _Problems):
    """A ``--SPLIT-weighted-split-paths-path FILE`` that cannot be read (on a laptop, the cluster's split
    files are not there) is a problem; for the other checks and the plan it is replaced by a one-dataset
    stand-in group (``--SPLIT-weighted-split-paths "unread: 1 0:1 FILE"``), as what the plan needs of the
    data is only whether there is some. Returns (argv, args, the splits left out)."""
    unread = []
    for split in ("train", "valid", "test"):
        flag, path = f"--{split}-weighted-split-paths-path", getattr(args, f"{split}_weighted_split_paths_path")
        if path is None or getattr(args, f"{split}_weighted_split_paths"):
            continue
        try:
            read_groups_file(path, flag)
        except ValueError as error:
            problems.add(str(error))
            at = next(i for i, token in enumerate(argv) if token == flag or token.startswith(flag + "="))
            value = [] if "=" in argv[at] else argv[at + 1:at + 2]
            argv = argv[:at] + [f"--{split}-weighted-split-paths", f"unread: 1 0:1 {path}"] + argv[at + 1 + len(value):]
            unread.append(split)
    return (argv, parser.parse_known_args(argv)[0], unread) if unread else (argv, args, unread)


def _check_flags(args: argparse.Namespace, world: Optional[int], problems: _Problems,
                 unread: Sequence[str] = ()) -> tuple[bool, bool]:
    """The checks of ``parse_namespace``, each on its own. Returns (the config can be assembled: the data
    and tokenizer files do not matter for that, the tokenizer's files are there). ``unread``: the splits
    whose groups are stand-ins (their data files are not checked)."""
    args = _with(args, world_size=world, rank=0)
    ok = [problems.run(_check_required, copy.copy(args)),
          problems.run(resolve_model_spellings, copy.copy(args)),
          world is not None and problems.run(_derive_parallel, copy.copy(args)),
          problems.run(merge_skip_ranges, args.skip_train_iteration_range),
          problems.run(_load_deepspeed_json, args.deepspeed_config)]
    data = copy.copy(args)
    if problems.run(_parse_data, data):
        stand_ins = {f"{split}_weighted_split_groups": () for split in unread}
        problems.run(_check_files, _with(data, tokenizer_type=None, **stand_ins))  # the data files alone
    else:
        ok.append(False)
    no_data = {"data_path_pairs": (), "train_weighted_split_groups": (), "valid_weighted_split_groups": (),
               "test_weighted_split_groups": ()}
    tokenizer_files_ok = problems.run(_check_files, _with(args, **no_data))  # the tokenizer files alone
    return all(ok), tokenizer_files_ok


def _check_config(config_argv: list[str], argv: list[str], world: int, result: ArgvCheck,
                  tokenizer_files_ok: bool) -> None:
    """The settings of ``config_argv`` (``argv`` with stand-ins for unreadable split files), then the public
    path on ``argv`` itself."""
    problems = result.problems
    try:
        args = parse_namespace(config_argv, world, check_files=False)
        config = assemble_run_config(args)
    except ValueError as error:  # a check parse_namespace has and _check_flags does not
        problems.add(str(error))
        result.not_checked.append("the settings' own rules: parse_namespace stopped first")
        return
    result.warnings = config.startup_warnings
    tokenizer = _build_tokenizer(config, result) if tokenizer_files_ok else None
    if not tokenizer_files_ok:
        result.not_checked.append("the tokenizer and the padded vocabulary: its files are missing")
    tp, dp = config.parallel.tensor_model_parallel_size, config.parallel.data_parallel_size
    standin = dataclasses.replace(config.model, padded_vocab_size=tp)  # the vocabulary is not known yet
    parts = [problems.run(part.validate) for part in (
        config.parallel, config.optimizer, config.lr_schedule, config.precision, config.data, config.training,
        config.logging, config.checkpoint, config.exit)]
    parts += [problems.run(standin.validate, tp), problems.run(config.batch.validate, dp),
              problems.run(build_deepspeed_config, config, config.deepspeed_user_config)]  # the JSON vs the flags
    if not all(parts):
        result.not_checked.append("the rules across settings (pipeline stages vs layers, schedule vs run length, "
                                  "validation data): a setting above is wrong")
        return
    if not problems.run(config.validate):
        return
    if tokenizer is not None:
        try:
            config = resolve_vocab_size(config, tokenizer)
        except ValueError as error:  # e.g. a vocabulary larger than --pad-vocab-size-to
            problems.add(str(error))
            return
    result.run_config = config
    try:  # the public path, on the same command line: whatever it checks is checked
        final = run_config_from_argv(argv, world_size=world, tokenizer=tokenizer, with_vocab=tokenizer is not None)
    except ValueError as error:
        problems.add(str(error))
    else:
        result.run_config = final


def _build_tokenizer(config: RunConfig, result: ArgvCheck):
    """The tokenizer the flags name, or None (a problem says why, unless its flags are wrong: the data
    settings' check has said so already)."""
    from megatron.data.tokenizers import build_tokenizer  # tokenizers / sentencepiece: only when one is built

    try:
        config.data.tokenizer.validate()
    except ValueError:
        return None
    try:
        return build_tokenizer(config.data.tokenizer)
    except ValueError as error:
        result.problems.add(str(error))
    except Exception as error:  # a broken file raises whatever its library raises
        result.problems.add(f"the tokenizer ({config.data.tokenizer.tokenizer_type}) could not be built: "
                            f"{type(error).__name__}: {error}")
    result.not_checked.append("the padded vocabulary: the tokenizer could not be built")
    return None
