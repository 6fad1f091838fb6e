"""The tiny corpus fixture of the training tests."""

from tests.training.conftest import tiny_corpus  # noqa: F401  (a pytest fixture)
