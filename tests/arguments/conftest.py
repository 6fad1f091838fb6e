"""The ``files`` fixture of the command-line tests."""

import pytest


@pytest.fixture
def files(tmp_path):
    """A data prefix and GPT-2 tokenizer files that exist (empty: only their existence is checked)."""
    for name in ("a.bin", "a.idx", "b.bin", "b.idx", "vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    return tmp_path
