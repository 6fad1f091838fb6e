"""The import rule the README states, checked on the source: no package imports one above it, and
deepspeed is imported only where the README says (every import counts, function-level ones too)."""

import ast
import pathlib

from tests.helpers.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "megatron"

# What each package may import of megatron (besides itself). Bottom first.
ALLOWED = {
    "config": set(),
    "parallel": {"config"},
    "model": {"config", "parallel"},
    "data": {"config"},
    "checkpoint": {"config", "parallel", "model", "data"},
    "engine": {"config", "parallel", "model", "checkpoint"},
    "arguments": {"config", "data"},
    "training": {"config", "parallel", "model", "data", "engine", "checkpoint"},
    "inference": {"config", "parallel", "model", "data", "checkpoint"},
    "testing": {"config", "data"},
    "planner": {"config", "parallel"},
    "cli": {"config", "inference"},
    "dry_run": {"config", "arguments", "parallel", "model", "engine", "training", "planner"},
}
# Harnesses that run the real thing, at the level of an entry point.
EXTRA = {"planner/measure.py": {"arguments", "training", "testing", "engine"}}
DEEPSPEED_IMPORTERS = ("engine/", "checkpoint/universal.py", "checkpoint/zero_files.py", "planner/measure.py")


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_no_package_imports_one_above_it():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "__init__.py":
            continue
        package = relative.split("/")[0].removesuffix(".py")
        assert package in ALLOWED, f"{relative}: a new package; add it to ALLOWED (and the README)"
        allowed = ALLOWED[package] | EXTRA.get(relative, set()) | {package}
        for module in _imports(path):
            if module.startswith("megatron."):
                target = module.split(".")[1]
                if target not in allowed:
                    problems.append(f"{relative} imports {module}")
            if module.split(".")[0] == "deepspeed" and not relative.startswith(DEEPSPEED_IMPORTERS):
                problems.append(f"{relative} imports {module}")
    assert not problems, "imports against the rule:\n" + "\n".join(problems)


def test_model_and_parallel_read_no_environment_or_global_arguments():
    for package in ("model", "parallel"):
        for path in (PACKAGE / package).rglob("*.py"):
            text = path.read_text()
            assert "os.environ" not in text and "get_args" not in text, path
