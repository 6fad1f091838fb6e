"""The ``files`` fixture of the command-line tests."""

import pytest

from megatron.testing.corpus import write_stand_in_dataset


@pytest.fixture
def files(tmp_path):
    """Two small data prefixes (their index headers are read) and GPT-2 tokenizer files that exist
    (empty: only their existence is checked)."""
    for name in ("a", "b"):
        write_stand_in_dataset(tmp_path / name)
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    return tmp_path
