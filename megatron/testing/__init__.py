"""Utilities for tests and benchmarks: running a function on several CPU processes, a tiny corpus
and the flags of a tiny model trained on it.

    distributed       run a function on N local processes joined in a torch.distributed group (gloo on CPU)
    corpus            a tiny synthetic corpus (text, a byte-level BPE, a .bin/.idx) and ``tiny_argv``, its model's flags
    tolerance         tolerances for two computations of the same numbers, derived from the dtypes and the depth
    tolerance_report  how close each tolerance of the suite comes to failing, measured on the machine it runs on
"""

from megatron.testing.corpus import make_tiny_corpus, tiny_argv
from megatron.testing.distributed import DistributedTestError, find_free_port, run_distributed

__all__ = ["run_distributed", "find_free_port", "DistributedTestError", "make_tiny_corpus", "tiny_argv"]
