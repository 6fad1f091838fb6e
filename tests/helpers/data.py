"""Shared by the data tests (and the dry-run tests): a Hugging Face cache laid out by hand."""

import hashlib
import os
import pathlib

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fill_hub_cache(cache: pathlib.Path, repo_id: str, files: dict[str, bytes]) -> pathlib.Path:
    """A cache as ``hf download`` leaves it: ``models--ORG--NAME/blobs/<sha256>``, ``refs/main`` holding
    the commit hash, ``snapshots/<commit>/<file>`` symlinks to the blobs. Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    for folder in (repo / "blobs", repo / "refs", snapshot):
        folder.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)  # no newline, as huggingface_hub writes it
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot
