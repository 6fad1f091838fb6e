"""Utilities for tests and benchmarks: running a function on several CPU processes, a tiny corpus
and the flags of a tiny model trained on it."""

from megatron.testing.corpus import make_tiny_corpus, tiny_argv
from megatron.testing.distributed import DistributedTestError, find_free_port, run_distributed

__all__ = ["run_distributed", "find_free_port", "DistributedTestError", "make_tiny_corpus", "tiny_argv"]
