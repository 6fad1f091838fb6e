"""The ``files`` fixtures of the command-line tests."""

import shutil

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


@pytest.fixture
def tokenizer_files(files, tiny_corpus):
    """``files`` with a real GPT-2 tokenizer (the tiny corpus's) in place of the empty files: for the dry
    run, which builds it."""
    shutil.copy(tiny_corpus["vocab_file"], files / "vocab.json")
    shutil.copy(tiny_corpus["merge_file"], files / "merges.txt")
    return files
