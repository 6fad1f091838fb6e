"""The command line -> the run configuration: Megatron-DeepSpeed's flag names, checked.

    run_config = run_config_from_argv(argv)   # megatron.config.RunConfig: frozen, validated, vocabulary padded

Everything impossible is rejected here, before any process group starts. ``parser`` holds the
flags, ``parse`` the environment- and file-dependent checks, ``build`` the Namespace -> RunConfig
step and the vocabulary. The data-naming formats (--data-path, weighted split paths) are parsed by
megatron.data.dataset_utils, the parser the dataset builders use too. Imports megatron.config and
(for the tokenizer and those formats) megatron.data; never deepspeed.
"""

from megatron.arguments.build import resolve_vocab_size, run_config_from_argv
from megatron.arguments.parse import merge_skip_ranges
from megatron.arguments.parser import build_parser

__all__ = ["run_config_from_argv", "build_parser", "resolve_vocab_size", "merge_skip_ranges"]
