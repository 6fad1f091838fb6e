"""The import rule the README states, checked on the source: no package imports one above it, and
deepspeed is imported only where the README says (every import counts, function-level ones too); only
megatron/engine/deepspeed_compat.py names DeepSpeed versions (its workarounds are checked against them)."""

import ast
import pathlib
import re

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
    "training": {"config", "parallel", "model", "data", "engine", "checkpoint", "evaluation"},
    "inference": {"config", "parallel", "model", "data", "checkpoint"},
    # lm-evaluation-harness on a checkpoint's model: beside inference, whose loading and decoding it uses
    "evaluation": {"config", "parallel", "model", "data", "checkpoint", "inference"},
    "testing": {"config", "data"},
    "planner": {"config", "parallel"},
    "cli": {"config", "inference"},
    "dry_run": {"config", "arguments", "parallel", "model", "engine", "training", "planner"},
    # harnesses that run the real thing, at the level of an entry point
    "benchmarking": {"config", "arguments", "parallel", "model", "data", "engine", "checkpoint", "training",
                     "testing", "planner"},
}
DEEPSPEED_IMPORTERS = ("engine/", "checkpoint/universal/patterns.py", "checkpoint/zero_files.py", "benchmarking/")
VERSION_NAMER = "engine/deepspeed_compat.py"
# a DeepSpeed-like version: 0.1x or 0.1x.y ("0.19", "0.19.8", "0.18.0"); not a float such as 0.125
DEEPSPEED_VERSION_STRING = re.compile(r"(?<![\d.])0\.1\d(?:\.(?:\d+|x))?\b(?!\.\d)")


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
        allowed = ALLOWED[package] | {package}
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


def test_only_the_compat_module_names_deepspeed_versions():
    """A workaround written for one DeepSpeed release lives in engine/deepspeed_compat.py, behind its version
    check; elsewhere a version number in the source is knowledge the next upgrade would not find."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == VERSION_NAMER:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if DEEPSPEED_VERSION_STRING.search(line):
                problems.append(f"{relative}:{number}: {line.strip()}")
    assert not problems, "DeepSpeed versions named outside " + VERSION_NAMER + ":\n" + "\n".join(problems)


def test_the_version_pattern_finds_versions_and_nothing_else():
    found = [text for text in ("deepspeed 0.19.8", "DeepSpeed 0.19's", "0.18.0 breaks", "avoid 0.17.x", "lr 0.125",
                               "eps 0.1", "10.19.8", "std 0.015") if DEEPSPEED_VERSION_STRING.search(text)]
    assert found == ["deepspeed 0.19.8", "DeepSpeed 0.19's", "0.18.0 breaks", "avoid 0.17.x"]


# Tests and benchmarks: test modules share code through tests/helpers only (Megatron-LM's test_utilities.py
# pattern), and nothing edits sys.path (run a script as a process, or import it as a module of its package).
TESTS = REPO_ROOT / "tests"
SHARED_TEST_CODE = "tests.helpers"


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree``; ``from tests import x`` counts as ``tests.x``, a relative
    import as ``.`` followed by its module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            out.append((node.lineno, "." * node.level + (node.module or "")))
        elif isinstance(node, ast.ImportFrom) and node.module == "tests":
            out += [(node.lineno, f"tests.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, node.module))
    return out


def test_no_test_module_imports_another_test_module():
    problems = []
    for path in sorted(TESTS.rglob("*.py")):
        relative = path.relative_to(REPO_ROOT).as_posix()
        for line, module in _imported_modules(ast.parse(path.read_text())):
            shared = module == SHARED_TEST_CODE or module.startswith(SHARED_TEST_CODE + ".")
            if module.startswith(".") or (module.split(".")[0] == "tests" and not shared):
                problems.append(f"{relative}:{line} imports {module}")
    assert not problems, f"test code shared other than through {SHARED_TEST_CODE}:\n" + "\n".join(problems)


def test_tests_and_benchmarks_leave_sys_path_alone():
    problems = []
    for folder in ("tests", "benchmarks"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                edits = (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                         and node.value.id == "sys")
                edits |= (isinstance(node, ast.ImportFrom) and node.module == "sys"
                          and any(alias.name == "path" for alias in node.names))
                if edits:
                    problems.append(f"{path.relative_to(REPO_ROOT).as_posix()}:{node.lineno}")
    assert not problems, "sys.path used (import the module from its package, or run it as a process):\n" + \
        "\n".join(problems)


ENVIRONMENT_READERS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def test_model_and_parallel_read_the_environment_by_no_name():
    """os.getenv and ``from os import environ`` read the environment as os.environ does."""
    problems = []
    for package in ("model", "parallel"):
        for path in sorted((PACKAGE / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                reads = (isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT_READERS
                         and isinstance(node.value, ast.Name) and node.value.id == "os")
                reads |= (isinstance(node, ast.ImportFrom) and node.module == "os"
                          and any(alias.name in ENVIRONMENT_READERS for alias in node.names))
                if reads:
                    problems.append(f"{path.relative_to(REPO_ROOT).as_posix()}:{node.lineno}")
    assert not problems, "the environment read in model/ or parallel/:\n" + "\n".join(problems)
