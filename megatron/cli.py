"""Shared by the command-line tools: how a tool's ``main`` ends."""

import sys
from typing import Callable, Optional


def run_tool(main: Callable[[], Optional[int]]) -> None:
    """Run ``main()`` and exit with its status; bad input (a ValueError naming the problem and the
    fix) becomes a one-line ``error: ...`` on stderr and exit status 2, without a traceback."""
    try:
        sys.exit(main())
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
