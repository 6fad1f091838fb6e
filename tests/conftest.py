"""Shared test set-up: DeepSpeed's CPU accelerator, the reference data folder, the tiny corpus."""

import os
import pathlib
import shutil
import subprocess

import pytest

from megatron.testing.tolerance_report import record as record_tolerance

# DeepSpeed picks its accelerator at import time; on these machines it is the CPU one.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Never reach a model hub from a test.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = pathlib.Path(os.environ.get("MEGATRON_TEST_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """The reference data folder (../shared/data); tests that need it skip where it is absent."""
    if not (SHARED_DATA / "gpt2").is_dir():
        pytest.skip(f"reference data not found at {SHARED_DATA} (set MEGATRON_TEST_DATA to its folder)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> dict:
    """``megatron.testing.make_tiny_corpus`` once per session (train with ``megatron.testing.tiny_argv``)."""
    from megatron.testing.corpus import make_tiny_corpus

    return make_tiny_corpus(str(tmp_path_factory.mktemp("tiny_corpus")))


def make_read_only(folder) -> bool:
    """Make ``folder`` refuse new entries, for root too where the filesystem allows it (``chattr +i``);
    True when it did. Undo with ``make_writable``."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
    elif not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        return False  # e.g. a filesystem without the immutable attribute
    return not os.access(folder, os.W_OK)


def make_writable(folder) -> None:
    if os.geteuid() != 0:
        os.chmod(folder, 0o755)
    elif shutil.which("chattr"):
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)


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


def pytest_collection_modifyitems(config, items):
    for item in items:
        package = pathlib.Path(str(item.fspath)).relative_to(REPO_ROOT / "tests").parts[0]
        if package in ONE_THREAD_PACKAGES:
            item.add_marker(pytest.mark.usefixtures("one_torch_thread"))


# .ci/run: every passing tolerance comparison, with both of its numbers (megatron/testing/tolerance_report.py;
# needs pytest -o enable_assertion_pass_hook=true).
TOLERANCE_REPORT = os.environ.get("MEGATRON_TOLERANCE_REPORT")


def pytest_assertion_pass(item, lineno, orig, expl):
    if TOLERANCE_REPORT:
        # The line is in the module that asserted, which may be a helper of another test file: orig says which.
        where = f"{pathlib.Path(str(item.fspath)).relative_to(REPO_ROOT)}, line {lineno}: {orig}"
        record_tolerance(TOLERANCE_REPORT, item.nodeid, where, expl)
