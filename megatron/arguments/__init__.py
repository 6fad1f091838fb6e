"""The command line and the run configuration.

    args = parse_args()                      # flags (Megatron-DeepSpeed names) -> checked Namespace
    run_config = build_run_config(args)      # -> megatron.config.RunConfig (frozen, validated)
    run_config = resolve_vocab_size(run_config)  # builds the tokenizer, fills the padded vocabulary size

Everything impossible is rejected here, before any process group starts. ``parser`` holds the
flags, ``parse`` the environment- and file-dependent checks, ``build`` the Namespace -> RunConfig
step. The data-naming formats (--data-path, weighted split paths) are parsed by
megatron.data.dataset_utils, the parser the dataset builders use too. Imports only megatron.config
(and, lazily, megatron.engine.ds_config, megatron.data.dataset_utils and megatron.data.tokenizers);
never deepspeed.
"""

from megatron.arguments.build import build_run_config, resolve_vocab_size
from megatron.arguments.parse import merge_skip_ranges, parse_args, rank_from_env, world_size_from_env
from megatron.arguments.parser import build_parser

__all__ = ["build_parser", "parse_args", "build_run_config", "resolve_vocab_size", "world_size_from_env",
           "rank_from_env", "merge_skip_ranges"]
