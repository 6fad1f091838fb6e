"""Where the checkout and the reference data are, and folders a test makes read-only."""

import os
import pathlib
import shutil
import subprocess

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED_DATA = pathlib.Path(os.environ.get("MEGATRON_TEST_DATA", REPO_ROOT.parent / "shared" / "data"))


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
