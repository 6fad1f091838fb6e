"""docs/flags.md read as a user reads it: every row's default is what the parser gives when the flag is left out."""

import re

import pytest

from megatron.arguments import build_parser
from tests.helpers.paths import REPO_ROOT

ROW = re.compile(r"^\| `(?P<flag>--[^`]+)`.*? \| (?P<default>[^|]+?) \| .* \|$")


def _rows() -> list[tuple[str, str]]:
    rows = [(m["flag"], m["default"]) for m in map(ROW.match, (REPO_ROOT / "docs" / "flags.md").read_text()
                                                   .splitlines()) if m]
    assert len(rows) > 50, "docs/flags.md has lost its tables"
    return rows


def _parsed(parser, argv: list[str], dest: str):
    return getattr(parser.parse_args(argv), dest)


def test_every_parser_flag_has_a_row():
    parser = build_parser()
    documented = {flag for flag, _ in _rows()}
    flags = {a.option_strings[0] for a in parser._actions if a.dest != "help"}
    assert documented == flags, (sorted(flags - documented), sorted(documented - flags))


@pytest.mark.parametrize("flag,shown", _rows(), ids=[flag for flag, _ in _rows()])
def test_the_default_shown_is_the_default_parsed(flag, shown):
    parser = build_parser()
    dest = parser._option_string_actions[flag].dest
    left_out = _parsed(parser, [], dest)
    if shown in ("on", "off"):  # a switch is "on" by default when passing it changes nothing
        passed = _parsed(parser, [flag], dest)
        assert (passed == left_out) == (shown == "on"), (flag, shown, left_out, passed)
    elif shown == "unset":
        assert left_out is None, (flag, left_out)
    else:
        assert shown == f"`{left_out}`", (flag, shown, left_out)
