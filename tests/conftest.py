"""Shared test set-up: DeepSpeed's CPU accelerator, the reference data folder, markers."""

import os
import pathlib

import pytest

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
