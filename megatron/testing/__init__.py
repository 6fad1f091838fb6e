"""Utilities for tests and benchmarks: running a function on several CPU processes."""

from megatron.testing.distributed import DistributedTestError, find_free_port, run_distributed

__all__ = ["run_distributed", "find_free_port", "DistributedTestError"]
