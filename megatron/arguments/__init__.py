"""The command line -> the run configuration: Megatron-DeepSpeed's flag names, checked.

    run_config = run_config_from_argv(argv)   # megatron.config.RunConfig: frozen, validated, vocabulary padded

Everything impossible is rejected here, before any process group starts. ``flags`` holds the
flags; ``steps`` declares the pipeline from the parsed flags to the RunConfig, once, in order, and
``runner`` runs it, stopping at the first problem (``run_config_from_argv``) or, for ``--dry-run``,
collecting them all (``check.check_argv``); ``flag_steps`` holds the flag steps (environment, files),
``build`` the Namespace -> RunConfig step and the vocabulary. The data-naming formats (--data-path,
weighted split paths) are parsed by megatron.data.dataset_utils, the parser the dataset builders use
too. Imports megatron.config and (for the tokenizer and those formats) megatron.data; never deepspeed.

One module per feature's argument group and its step:

    moe_flags          the mixture-of-experts flags: Megatron-LM's names, and Megatron-DeepSpeed's where they agree
    fp8_flags          the FP8 training flags (``--fp8-format``, ``--fp8-recipe``, ..., Megatron-LM's names)
    mla_flags          the multi-head latent attention flags (``--multi-latent-attention``, ``--q-lora-rank``, ...)
    yarn_flags         the YaRN long-context rotary flags (``--position-embedding-type yarn``, ``--rope-type``, ...)
    mtp_flags          the multi-token prediction flags (``--mtp-num-layers``, ``--mtp-loss-scaling-factor``)
    async_save_flags   ``--async-save`` (Megatron-LM's name): checkpoints written by a background thread
    resilience_flags   ``--log-straggler``, ``--straggler-minmax-count`` (Megatron-LM's) and our ``--hang-watchdog-*``
    muon_flags         the Muon optimizer's flags (``--muon-*``, Megatron-LM's names) for ``--optimizer muon``
    interleaved_flags  Megatron-LM's interleaved-pipeline and pipeline-layout flags: one names the virtual stages
    zero_bubble_flags  the zero-bubble pipeline flags, Megatron-DeepSpeed's names (rules: megatron.config.zero_bubble)
    upstream_flags     the one table of Megatron-LM / Megatron-DeepSpeed flags accepted with no effect here, or refused
"""

from megatron.arguments.build import resolve_vocab_size
from megatron.arguments.flag_steps import merge_skip_ranges
from megatron.arguments.flags import build_parser
from megatron.arguments.runner import run_config_from_argv

__all__ = ["run_config_from_argv", "build_parser", "resolve_vocab_size", "merge_skip_ranges"]
