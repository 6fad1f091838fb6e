#!/usr/bin/env python
"""Say, flag by flag, what this engine makes of a Megatron-LM or Megatron-DeepSpeed launch's flags: what a porting
team wants to see before its first job.

    python tools/port_megatron_args.py --world-size 32 -- --use-mcore-models --num-layers 32 ... (the script's flags)
    python tools/port_megatron_args.py --world-size 8 --args-file flags.txt     (the flags, whitespace-separated;
                                                                                 # starts a comment line)

Each flag gets one line: ``implemented`` (a flag of this engine, with the upstream name and meaning), ``no effect
here`` or ``refused`` (the table in megatron/arguments/upstream_flags.py, with why), or ``unknown`` (not a flag
here: the job would stop on it). Then the verdict of ``pretrain_gpt.py --dry-run`` on the same flags: the
problems it finds (missing files included) and the lines the job would log at startup. Exit status 0 when the
dry run passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = []
    if "--" in argv:
        cut = argv.index("--")
        argv, flags = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, required=True, help="the launch's number of processes (GPUs)")
    p.add_argument("--args-file", default=None, help="a file holding the flags (instead of after --)")
    args = p.parse_args(argv)
    if args.args_file is not None:
        with open(args.args_file, encoding="utf-8") as f:
            flags += shlex.split(f.read(), comments=True)
    if not flags:
        p.error("give the launch's flags after -- or in --args-file")
    return args, flags


def classify(flags: list[str]) -> list[tuple[str, str, str]]:
    """(flag as given, verdict, why) for each flag token of ``flags`` (values are skipped), in order."""
    from megatron.arguments import build_parser  # noqa: PLC0415 (the parser imports the config package: after --help)
    from megatron.arguments.upstream_flags import BY_FLAG, NO_EFFECT  # noqa: PLC0415

    known = build_parser()._option_string_actions
    out = []
    for token in flags:
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        if name in BY_FLAG:
            row = BY_FLAG[name]
            out.append((name, "no effect here" if row.effect == NO_EFFECT else "refused", row.why))
        elif name in known:
            help_text = (known[name].help or "").split(". ")[0]
            out.append((name, "implemented", help_text))
        else:
            out.append((name, "unknown", "not a flag of this engine: the job stops on it"))
    return out


def main(argv=None) -> int:
    args, flags = parse_args(argv)
    from megatron.arguments.check import check_argv  # noqa: PLC0415

    rows = classify(flags)
    width = max(len(flag) for flag, _, _ in rows)
    for flag, verdict, why in rows:
        print(f"{flag:<{width}}  {verdict:<14}  {why}")
    counts = {v: sum(1 for _, verdict, _ in rows if verdict == v)
              for v in ("implemented", "no effect here", "refused", "unknown")}
    print("\n" + ", ".join(f"{n} {v}" for v, n in counts.items()))
    check = check_argv(flags + ["--dry-run", "--world-size", str(args.world_size)])
    verdict = "passes" if check.ok else f"{len(check.problems)} problem(s)"
    print(f"\npretrain_gpt.py --dry-run at {args.world_size} processes: {verdict}")
    for problem in check.problems:
        print(f"  problem: {problem}")
    for line in check.not_checked:
        print(f"  not checked: {line}")
    for warning in check.warnings:
        print(f"  at startup: {warning}")
    return 0 if check.ok else 1


if __name__ == "__main__":
    sys.exit(main())
