"""Shared test set-up: DeepSpeed's CPU accelerator, the reference data folder, the tiny corpus, the
command-line tests' data files. Shared code (not fixtures) lives in ``tests.helpers``."""

import json
import os
import pathlib
import shutil
import sys

import pytest

# The comparisons the test modules share (assert_same_run, ...) are asserted in tests/helpers: rewritten like a
# test module's, their failures show both numbers and the tolerance report (below) sees them.
pytest.register_assert_rewrite("tests.helpers")

from megatron.testing.tiny_corpus import write_stand_in_dataset  # noqa: E402 (after the rewrite registration)
from megatron.testing.tolerance_report import record as record_tolerance  # noqa: E402
from tests.helpers.paths import REPO_ROOT, SHARED_DATA, make_read_only, make_writable  # noqa: E402

# DeepSpeed picks its accelerator at import time; on these machines it is the CPU one.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Never reach a model hub from a test.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """The reference data folder (../shared/data); tests that need it skip where it is absent."""
    if not (SHARED_DATA / "gpt2").is_dir():
        pytest.skip(f"reference data not found at {SHARED_DATA} (set MEGATRON_TEST_DATA to its folder)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> dict:
    """``megatron.testing.make_tiny_corpus`` once per session (train with ``megatron.testing.tiny_argv``)."""
    from megatron.testing.tiny_corpus import make_tiny_corpus

    return make_tiny_corpus(str(tmp_path_factory.mktemp("tiny_corpus")))


@pytest.fixture
def read_only_folder():
    """``read_only_folder(path)``: ``make_read_only(path)`` until the test ends."""
    folders = []

    def lock(folder) -> bool:
        folders.append(folder)
        return make_read_only(folder)

    yield lock
    for folder in folders:
        make_writable(folder)


@pytest.fixture
def files(tmp_path):
    """Two small data prefixes (their index headers are read) and GPT-2 tokenizer files that exist
    (empty: only their existence is checked)."""
    for name in ("a", "b"):
        write_stand_in_dataset(tmp_path / name)
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    return tmp_path


@pytest.fixture
def tokenizer_files(files, tiny_corpus):
    """``files`` with a real GPT-2 tokenizer (the tiny corpus's) in place of the empty files: for the dry
    run, which builds it."""
    shutil.copy(tiny_corpus["vocab_file"], files / "vocab.json")
    shutil.copy(tiny_corpus["merge_file"], files / "merges.txt")
    return files


# Tiny models on a shared 2-core machine: extra intra-op threads only contend (measured: 30 AdamW
# steps of a tiny model took 4.5 s with the default threads under load, 0.14 s with one).
ONE_THREAD_PACKAGES = ("model", "inference", "checkpoint")


@pytest.fixture
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# How long each test module took in a measured run of the suite (setup, calls and teardown summed), for the order
# below. Rewrite it after adding or changing a long module: MEGATRON_RECORD_DURATIONS=tests/module_seconds.json
# make test. A module it does not name counts as UNKNOWN_MULTIPROCESS_S if it has multi-process tests, else 1 s.
MODULE_SECONDS_FILE = REPO_ROOT / "tests" / "module_seconds.json"
MODULE_SECONDS = json.loads(MODULE_SECONDS_FILE.read_text()) if MODULE_SECONDS_FILE.is_file() else {}
UNKNOWN_MULTIPROCESS_S = 60.0


def pytest_collection_modifyitems(config, items):
    for item in items:
        package = pathlib.Path(str(item.fspath)).relative_to(REPO_ROOT / "tests").parts[0]
        if package in ONE_THREAD_PACKAGES:
            item.add_marker(pytest.mark.usefixtures("one_torch_thread"))
    # The longest modules first. `make test`'s two workers (pytest-xdist, --dist loadfile --no-loadscope-reorder)
    # take whole modules in this order as they become free, so the short ones come last and fill the gaps: a
    # long module that started when the other worker had nothing left would be the run's tail (Graham's
    # longest-processing-time-first rule; xdist's own order, most tests first, left a 3-minute module to the end).
    multiprocess = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("multiprocess")}

    def seconds(item) -> float:
        module = item.nodeid.split("::")[0]
        return MODULE_SECONDS.get(module, UNKNOWN_MULTIPROCESS_S if module in multiprocess else 1.0)

    items.sort(key=lambda item: -seconds(item))  # stable: a module's tests keep their order


_RECORD_DURATIONS = os.environ.get("MEGATRON_RECORD_DURATIONS")
_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if _RECORD_DURATIONS:  # in the controller, the workers' reports arrive here too
        module = report.nodeid.split("::")[0]
        _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_sessionfinish(session):
    if _RECORD_DURATIONS and not hasattr(session.config, "workerinput") and _module_seconds:
        ordered = dict(sorted(((m, round(s, 1)) for m, s in _module_seconds.items()), key=lambda kv: -kv[1]))
        pathlib.Path(_RECORD_DURATIONS).write_text(json.dumps(ordered, indent=1) + "\n")


# .ci/run: every passing tolerance comparison, with both of its numbers (megatron/testing/tolerance_report.py;
# needs pytest -o enable_assertion_pass_hook=true).
TOLERANCE_REPORT = os.environ.get("MEGATRON_TOLERANCE_REPORT")


def pytest_assertion_pass(item, lineno, orig, expl):
    if TOLERANCE_REPORT:
        test_file = pathlib.Path(str(item.fspath)).relative_to(REPO_ROOT)
        asserted_in = _asserting_file(lineno, orig)
        via = f" via {asserted_in}" if asserted_in and asserted_in != test_file else ""
        where = f"{test_file}{via}, line {lineno}: {orig}"
        record_tolerance(TOLERANCE_REPORT, item.nodeid, where, expl)


def _asserting_file(lineno, orig):
    """The file of the frame that asserted (a test module, or a helper in tests/helpers it called): the
    innermost caller of this hook that is at ``lineno`` in a file of this repository."""
    frame = sys._getframe(2)
    while frame is not None:
        path = pathlib.Path(frame.f_code.co_filename)
        if (frame.f_lineno == lineno and path.is_relative_to(REPO_ROOT) and path.name != "conftest.py"
                and not path.is_relative_to(REPO_ROOT / ".venv")):
            return path.relative_to(REPO_ROOT)
        frame = frame.f_back
    return None
