"""Every package docstring is a whole module map: it names every module and subpackage of its folder, and
its listing lines name no module that does not exist.

A package is every folder under megatron/ with an ``__init__.py`` (``megatron`` itself included); its
modules are its ``*.py`` files other than ``__init__.py`` (private ones such as ``_checks`` too), its
subpackages the folders in it with an ``__init__.py``.

- Named: each module's basename (or subpackage's name) occurs in the docstring as a whole word, not as
  the tail of a dotted name: ``(?<![\\w.])name(?![\\w])`` (``megatron.config.moe`` does not name ``moe``).
- Listing lines, where a map states what a module is: a line indented by four or more spaces that starts
  with a lower-case identifier (optionally ending in ``.py``) followed by two or more spaces and the
  description, ``    tags          folder names and markers ...``; or a bullet ``- ``name``: description``.
  (Class names in CamelCase, as megatron.model lists them, are not module names and are not read.)
  The name of every listing line must be a module or subpackage of that folder.
"""

import ast
import re

import pytest

from tests.helpers.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "megatron"

LISTING_LINE = re.compile(r"^ {4,}([a-z_][a-z0-9_]*)(?:\.py)? {2,}\S")
BULLET_LINE = re.compile(r"^- ``([a-z_][a-z0-9_]*)``:")


def _packages():
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


def _members(folder):
    modules = {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
    subpackages = {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return modules | subpackages


def _docstring(folder):
    return ast.get_docstring(ast.parse((folder / "__init__.py").read_text()), clean=False) or ""


def _listed(doc):
    names = []
    for line in doc.splitlines():
        m = LISTING_LINE.match(line) or BULLET_LINE.match(line)
        if m:
            names.append(m.group(1))
    return names


def _name(folder):
    return folder.relative_to(REPO_ROOT).as_posix()


def test_rules_read_the_existing_styles():
    doc = (
        "Intro.\n\n    tags          folder names\n    specs.py        GPU types\n"
        "- ``cpu``: the accelerator;\n    EmbeddingLayer     token ids\n    training -> engine -> model\n"
    )
    assert _listed(doc) == ["tags", "specs", "cpu"]


@pytest.mark.parametrize("folder", _packages(), ids=_name)
def test_package_docstring_is_a_whole_module_map(folder):
    doc = _docstring(folder)
    members = _members(folder)
    missing = sorted(n for n in members if not re.search(r"(?<![\w.])" + re.escape(n) + r"(?![\w])", doc))
    stale = sorted(set(_listed(doc)) - members)
    init = f"{_name(folder)}/__init__.py"
    problems = []
    if missing:
        problems.append(
            f"{_name(folder)}: not named in its docstring: {', '.join(missing)}; add a line for each to "
            f"{init}'s docstring (the module's own docstring, in a few words, in the map's style)"
        )
    if stale:
        problems.append(
            f"{_name(folder)}: its docstring lists modules that do not exist: {', '.join(stale)}; remove or "
            f"rename their lines in {init}'s docstring"
        )
    assert not problems, "\n".join(problems)


def test_package_docstring_lines_fit():
    long = [
        f"{_name(folder)}/__init__.py: {len(line)} chars: {line.strip()[:60]}"
        for folder in _packages()
        for line in _docstring(folder).splitlines()
        if len(line) > 120
    ]
    assert not long, "\n".join(long)
