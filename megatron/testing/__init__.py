"""Utilities for tests and benchmarks: running a function on several CPU processes, a tiny corpus
and the flags of a tiny model trained on it.

    processes         run a function on N local processes joined in a torch.distributed group (gloo on CPU)
    tiny_corpus       a tiny synthetic corpus (text, a byte-level BPE, a .bin/.idx) and ``tiny_argv``, its model's flags
    tolerance         tolerances for two computations of the same numbers, derived from the dtypes and the depth
    tolerance_report  how close each tolerance of the suite comes to failing, measured on the machine it runs on
"""

from megatron.testing.processes import DistributedTestError, find_free_port, run_distributed
from megatron.testing.tiny_corpus import make_tiny_corpus, tiny_argv

__all__ = ["run_distributed", "find_free_port", "DistributedTestError", "make_tiny_corpus", "tiny_argv"]
