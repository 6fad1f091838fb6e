"""How close each tolerance of the suite comes to failing, measured on the machine it runs on.

pytest calls ``pytest_assertion_pass`` for every assertion that held when ``enable_assertion_pass_hook``
is on; tests/conftest.py then hands it to ``record`` while ``MEGATRON_TOLERANCE_REPORT`` names a file.
Every passing ``value < bound`` or ``value <= bound`` whose bound is a tolerance (a positive number below
``MAX_BOUND``: 1e-5, a derived ``model_tolerance(...)``, ``1e-5 * abs(a)``) becomes one JSON line: the
assertion's place, the test, both numbers and the CPU kernels torch ran (AVX512, AVX2). .ci/run records
both of its passes (native, then the AVX2 kernels) and prints

    python -m megatron.testing.tolerance_report main.jsonl avx2.jsonl

the tightest places first: for each, bound / value at its closest on each kind (the margin; inf where the
two computations were bit-identical). Comparisons pytest cannot show as numbers (``torch.allclose``,
``pytest.approx``) are not seen.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import operator
import re
import sys
from typing import Optional

__all__ = ["parse", "record", "margins", "main"]

MAX_BOUND = 0.5  # a bound at or above this is a threshold of another kind (counts, probabilities), not a tolerance
_COMPARISON = re.compile(r"^(?P<value>[-+0-9.eE]+|inf|nan) (?P<op><=|<) (?P<bound>[-+0-9.eE*/() ]+)$")
_OPERATORS = {ast.Mult: operator.mul, ast.Div: operator.truediv, ast.Add: operator.add, ast.Sub: operator.sub}


def _number(node) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_number(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_number(node.left), _number(node.right))
    raise ValueError(f"not a number: {ast.dump(node)}")


def parse(expl: str) -> Optional[tuple[float, float]]:
    """(value, bound) of a passing tolerance comparison from pytest's explanation of it, else None."""
    match = _COMPARISON.match(expl.split("\n", 1)[0].strip())
    if not match:
        return None
    try:
        value = float(match["value"])
        bound = _number(ast.parse(match["bound"], mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError):
        return None
    if not (0 < bound < MAX_BOUND) or not value >= 0:
        return None
    return value, bound


def record(path: str, nodeid: str, where: str, expl: str) -> None:
    """Append one JSON line for a passing tolerance comparison (nothing for any other assertion)."""
    parsed = parse(expl)
    if parsed is None:
        return
    import torch  # noqa: PLC0415 (the report reads JSON; torch only for the dtypes' epsilon)

    line = {"where": where, "test": nodeid, "value": parsed[0], "bound": parsed[1],
            "kernels": torch.backends.cpu.get_cpu_capability()}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def margins(paths: list[str]) -> dict[str, dict[str, float]]:
    """{place: {kernels: the smallest bound / value there}} over the records in ``paths``."""
    out: dict[str, dict[str, float]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                margin = r["bound"] / r["value"] if r["value"] > 0 else math.inf
                kinds = out.setdefault(r["where"], {})
                kinds[r["kernels"]] = min(kinds.get(r["kernels"], math.inf), margin)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="JSON-lines files written with MEGATRON_TOLERANCE_REPORT")
    parser.add_argument("--top", type=int, default=25, help="how many of the tightest places to list")
    args = parser.parse_args(argv)
    table = margins(args.reports)
    kinds = sorted({k for v in table.values() for k in v})
    rows = sorted(table.items(), key=lambda item: min(item[1].values()))
    print(f"{len(table)} tolerance comparisons seen; margin = bound / largest value (inf: bit-identical)")
    print("  ".join(f"{k:>8}" for k in kinds) + "  where")
    for where, by_kind in rows[:args.top]:
        print("  ".join(f"{by_kind.get(k, math.nan):8.3g}" for k in kinds) + f"  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
