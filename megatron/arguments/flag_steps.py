"""The flag steps of the argument pipeline (``megatron.arguments.runner``): each takes the parsed
``argparse.Namespace``, checks one thing or fills in Megatron's derived values, and raises ValueError
naming the values and the fix.

The checks here are the ones that need the command line as a whole, the environment or the file system
(world size, data prefixes, tokenizer files, the DeepSpeed JSON); the rules of the settings themselves live
in ``megatron.config``'s ``validate()`` methods. Nothing the user asked for is changed: a contradiction is a
ValueError, a setting with no effect here, or one that runs as its DeepSpeed equivalent (BLOOM's
``--bf16 --zero-stage 0``), or a redundant combination Megatron-DeepSpeed accepts, is kept and reported once
in the startup log (``RunConfig.startup_warnings``).
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from megatron.arguments.flags import ATTENTION_BACKEND_ALIASES, DRY_RUN_OPTIONS, POSITION_EMBEDDING_ALIASES
from megatron.arguments.fp8_flags import fp8_warnings
from megatron.arguments.moe_flags import moe_warnings
from megatron.arguments.muon_flags import muon_warnings
from megatron.arguments.upstream_flags import upstream_warnings
from megatron.config import TOKENIZER_FILES, deepspeed_zero_stage, parallel_dims
from megatron.data.dataset_utils import document_range, parse_data_path, parse_split, parse_weighted_split_paths
from megatron.data.hf_cache import resolve_tokenizer_path
from megatron.data.indexed_dataset import sequence_count

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr")
FP16_ONLY = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
SPLITS = ("train", "valid", "test")


def check_dry_run_flags(args) -> None:
    given = [flag for flag, dest in DRY_RUN_OPTIONS if getattr(args, dest) is not None]
    if given and not args.dry_run:
        raise ValueError(f"{', '.join(given)} only apply with --dry-run; add --dry-run to check the job (a real run "
                         "takes its world size from the launcher)")


def check_required(args) -> None:
    missing = [f"--{name.replace('_', '-')}" for name in REQUIRED if getattr(args, name) is None]
    if missing:
        raise ValueError(f"missing required flag(s): {', '.join(missing)}")


def check_megatron_lm_values(args) -> None:
    """Megatron-LM flags accepted at the value that means what this engine does, refused at another."""
    if args.rotary_percent != 1.0:
        raise ValueError(f"--rotary-percent {args.rotary_percent}: partial rotary positions are not implemented "
                         "here (every head dimension is rotated); drop the flag or pass 1.0")
    factor = args.rotary_seq_len_interpolation_factor
    if factor is not None and factor != 1.0:
        raise ValueError(f"--rotary-seq-len-interpolation-factor {factor}: linear position interpolation is not "
                         "implemented here; drop the flag or pass 1 (positions unchanged), or extend the context "
                         "with YaRN (--rotary-scaling-factor) or Llama 3.1's scaling")
    if args.no_pipeline_parallel and args.pipeline_model_parallel_size > 1:
        raise ValueError(f"--no-pipeline-parallel with --pipeline-model-parallel-size "
                         f"{args.pipeline_model_parallel_size}: drop one of them")
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(args, name) == "fp8":
            raise ValueError(f"--{name.replace('_', '-')} fp8: FP8 optimizer states are not implemented here (no FP8 "
                             "training); use bf16 or fp16")
    if args.main_grads_dtype != "fp32" or args.main_params_dtype != "fp32":
        raise ValueError(f"--main-grads-dtype {args.main_grads_dtype} / --main-params-dtype {args.main_params_dtype}: "
                         "DeepSpeed's optimizer wrappers accumulate gradients and keep master weights in fp32 here; "
                         "drop the flags (fp32)")
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ValueError("--grad-reduce-in-bf16 reduces bf16 runs' gradients in bf16; it needs --bf16 (add it, or "
                         "drop the flag)")


def resolve_model_spellings(args) -> None:
    """One value each for what Megatron-DeepSpeed and Megatron-LM spell in several ways: the position
    type (``--position-embedding-type``, ``--use-rotary-position-embeddings``, ``--no-position-embedding``)
    and the key / value heads (``--num-key-value-heads``, ``--group-query-attention --num-query-groups``).
    Spellings that contradict each other are a ValueError naming both. Megatron-LM's --attention-backend names
    (fused, local) become ours."""
    args.attention_backend_alias = args.attention_backend if args.attention_backend in ATTENTION_BACKEND_ALIASES else None
    args.attention_backend = ATTENTION_BACKEND_ALIASES.get(args.attention_backend, args.attention_backend)
    given = args.position_embedding_type
    args.position_embedding_yarn = given == "yarn"  # rotary with YaRN scaling (megatron.arguments.yarn_flags)
    position = "rotary" if given == "yarn" else POSITION_EMBEDDING_ALIASES.get(given, given)
    if args.use_rotary_position_embeddings:
        if position not in (None, "rotary"):
            raise ValueError(f"--use-rotary-position-embeddings contradicts --position-embedding-type {given}; "
                             "drop one of them")
        position = "rotary"
    if not args.add_position_embedding:
        if position == "absolute":
            raise ValueError(f"--no-position-embedding contradicts --position-embedding-type {given} (learned "
                             "positions); drop one of them")
        position = position or "none"
    args.position_embedding_type = position or "absolute"

    groups = args.num_query_groups
    if groups is not None and not args.group_query_attention:
        raise ValueError(f"--num-query-groups {groups} needs --group-query-attention (Megatron-LM ignores the group "
                         f"count without it); add it, or use --num-key-value-heads {groups}")
    if args.group_query_attention and groups is None:
        raise ValueError("--group-query-attention needs --num-query-groups N (or use --num-key-value-heads N)")
    if groups is not None:
        if args.num_key_value_heads not in (None, groups):
            raise ValueError(f"--num-query-groups {groups} and --num-key-value-heads {args.num_key_value_heads} are "
                             "two names for the same count and differ; give one")
        args.num_key_value_heads = groups


def resolve_recompute_spellings(args) -> None:
    """Megatron-LM's --recompute-granularity / -method / -num-layers onto Megatron-DeepSpeed's
    --checkpoint-activations / --checkpoint-num-layers (full) and ``recompute_core_attention`` (selective)."""
    if args.recompute_activations:  # Megatron-LM's older spelling of selective recomputation
        if args.recompute_granularity == "full":
            raise ValueError("--recompute-activations (selective recomputation) contradicts --recompute-granularity "
                             "full; drop one of them")
        args.recompute_granularity = "selective"
    if args.moe_layer_recompute:  # Megatron-LM's deprecated spelling of selective recomputation of "moe"
        if args.recompute_granularity == "full":
            raise ValueError("--moe-layer-recompute recomputes the MoE layers alone (selective recomputation); do not "
                             "set it with --recompute-granularity full, which recomputes whole layers already")
        args.recompute_granularity = "selective"
        args.recompute_modules = list(args.recompute_modules if args.recompute_modules is not None else
                                      ["core_attn"]) + ["moe"]
    granularity, method, num_layers = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    # With --checkpoint-activations too, full recomputation wins: it already recomputes the attention core
    # (Megatron-DeepSpeed runs both, nesting a second recomputation of the core; a startup warning says so).
    selective = granularity == "selective" and not args.checkpoint_activations
    modules = args.recompute_modules if args.recompute_modules is not None else ["core_attn"]  # Megatron's default
    args.recompute_core_attention = selective and "core_attn" in modules
    args.recompute_module_parts = tuple(dict.fromkeys(m for m in modules if m != "core_attn")) if selective else ()
    if granularity != "full":
        if (method is not None or num_layers is not None) and not _uniform_beside_checkpoint_activations(args):
            raise ValueError(f"--recompute-method / --recompute-num-layers apply to --recompute-granularity full; "
                             f"got granularity {granularity}: drop them or use full")
        return
    if method == "block":
        raise ValueError("--recompute-method block (recompute only the first --recompute-num-layers layers of each "
                         "stage) is not available on DeepSpeed's pipeline engine; use uniform")
    if num_layers is not None:
        if args.checkpoint_activations and args.checkpoint_num_layers not in (1, num_layers):
            raise ValueError(f"--recompute-num-layers {num_layers} and --checkpoint-num-layers "
                             f"{args.checkpoint_num_layers} are two names for the same count and differ; give one")
        args.checkpoint_num_layers = num_layers
    args.checkpoint_activations = True


def _uniform_beside_checkpoint_activations(args) -> bool:
    """--checkpoint-activations --recompute-method uniform (no granularity): uniform chunks are what
    --checkpoint-activations recomputes already; Megatron-DeepSpeed accepts the pair, and so does this (a
    startup warning says the method changes nothing)."""
    return (args.recompute_granularity is None and args.checkpoint_activations and args.recompute_method == "uniform"
            and args.recompute_num_layers is None)


def derive_parallel(args) -> None:
    """``data_parallel_size`` = world size / the other factors of the world (TP x PP x SP x CP,
    ``megatron.config.parallel_dims``)."""
    sizes = {d.name: getattr(args, d.field) for d in parallel_dims.WORLD if d.flag}
    args.data_parallel_size = parallel_dims.divide_world(args.world_size, sizes)


def fill_defaults(args) -> None:
    """Megatron's defaults for what the flags leave open (the global batch size is the run configuration's:
    it needs the data-parallel size)."""
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if _cuda_available() else "gloo"
    args.profile_ranks = tuple(args.profile_ranks)


def merge_iteration_ranges(args) -> None:
    args.skip_train_iteration_range = merge_skip_ranges(args.skip_train_iteration_range)


def merge_skip_ranges(ranges: Optional[Sequence[str]]) -> tuple[tuple[int, int], ...]:
    """``["101-200", "150-300", "5-6"]`` -> ``((5, 6), (101, 300))``, as Megatron-DeepSpeed merges them."""
    parsed = []
    for text in ranges or ():
        parts = text.split("-")
        try:
            start, end = (int(x) for x in parts)
        except ValueError:
            raise ValueError(f"--skip-train-iteration-range {text!r} is not START-END (two integers)") from None
        if end < start:
            raise ValueError(f"--skip-train-iteration-range {text!r}: END {end} is before START {start}")
        parsed.append((start, end))
    merged: list[list[int]] = []
    for start, end in sorted(parsed):
        if merged and merged[-1][1] >= start:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple((s, e) for s, e in merged)


def parse_data_flags(args) -> None:
    """``data_path_pairs`` and ``{train,valid,test}_weighted_split_groups``, and Megatron's default --split (a
    quoted one unquoted)."""
    args.data_path_pairs = parse_data_path(args.data_path)
    for split in SPLITS:
        groups = parse_weighted_split_paths(getattr(args, f"{split}_weighted_split_paths"), split,
                                            getattr(args, f"{split}_weighted_split_paths_path"))
        setattr(args, f"{split}_weighted_split_groups", groups)
    weighted = args.train_weighted_split_groups or args.valid_weighted_split_groups or args.test_weighted_split_groups
    if args.data_path_pairs and args.split is None and not weighted:
        args.split = "969, 30, 1"  # Megatron's default, for mode 1 only
    if args.split is not None:
        # Megatron-LM reads the numbers out of the text: a script's "--split '99,1,0'" (quotes kept by the shell
        # from an array element) trains on 99,1,0 there, and here.
        args.split = args.split.strip().strip("'\"").strip()


def data_prefixes(args, stand_in_splits: Sequence[str] = ()) -> list[str]:
    """Every dataset prefix the data flags name, but those of ``stand_in_splits`` (groups standing in for a
    split file the dry run could not read)."""
    prefixes = [prefix for _, prefix in args.data_path_pairs]
    for split in (s for s in SPLITS if s not in stand_in_splits):
        for group in getattr(args, f"{split}_weighted_split_groups"):
            prefixes += [d.prefix for d in group.datasets]
    return prefixes


def missing_prefixes(prefixes: Sequence[str]) -> list[str]:
    """``prefix.bin`` / ``prefix.idx`` files that do not exist."""
    missing = []
    for prefix in dict.fromkeys(prefixes):
        missing += [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    return missing


def check_data_files(args, stand_in_splits: Sequence[str] = ()) -> None:
    missing = missing_prefixes(data_prefixes(args, stand_in_splits))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"data files not found: {shown}; each prefix needs PREFIX.bin and PREFIX.idx "
                         "(build them with tools/preprocess_data.py)")


def check_tokenizer_files(args) -> None:
    for name in TOKENIZER_FILES.get(args.tokenizer_type, ()):
        path = getattr(args, name)
        if path is None:
            continue
        if args.tokenizer_type in ("PretrainedFromHF", "HuggingFaceTokenizer"):
            resolve_tokenizer_path(path)  # the tokenizer builder's own lookup (a folder, a file or a cached name)
        elif not os.path.exists(path):
            raise ValueError(f"--{name.replace('_', '-')} {path!r}: no such file or directory")


def check_output_folders(args) -> None:
    """Found now, not at the first save or log line (after a save interval of work)."""
    for flag, path in (("--data-cache-path", args.data_cache_path), ("--save", args.save),
                       ("--tensorboard-dir", args.tensorboard_dir),
                       ("--wandb-save-dir", args.wandb_save_dir if args.wandb_project else None)):
        _check_writable_folder(flag, path)


def check_training_documents(args, stand_in_splits: Sequence[str] = ()) -> None:
    """Every dataset of the training data holds documents for the training split: found now, not as a
    TypeError after the whole set-up (an empty preprocessing output, --split 0,50,50)."""
    if args.data_path_pairs and args.split is not None:  # mode 1 (with both modes, validate names the conflict)
        for _, prefix in args.data_path_pairs:
            num = sequence_count(prefix)
            bounds = parse_split(args.split, num)
            if bounds[1] <= bounds[0]:
                raise ValueError(f"--data-path {prefix}: {num} documents, of which --split {args.split!r} leaves "
                                 f"none for training; " + ("rebuild the dataset (tools/preprocess_data.py) from a "
                                                           "non-empty input" if num == 0 else
                                                           "give the training part a share of the documents"))
    for group in () if "train" in stand_in_splits else args.train_weighted_split_groups:
        for entry in group.datasets:
            num = sequence_count(entry.prefix)
            start, end = document_range(entry, num)
            if end <= start:
                raise ValueError(f"--train-weighted-split-paths group {group.name!r}: range {entry.start}:{entry.end} "
                                 f"of {entry.prefix} ({num} documents) holds no documents")


def _check_writable_folder(flag: str, path: Optional[str]) -> None:
    """``path`` is a folder this process may write in, or one it may create (its nearest existing parent is)."""
    if path is None:
        return
    folder = os.path.abspath(path)
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {path!r}: {existing!r} is not a directory; pass a folder path")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "is not writable" if existing == folder else f"cannot be created: {existing!r} is not writable"
        raise ValueError(f"{flag} {path!r} {where} by this user (uid {os.getuid()}); pass a folder you can "
                         "write to, shared by every node")


def load_deepspeed_json(args) -> None:
    """``deepspeed_user_config``: the --deepspeed_config JSON (None without one), and the ZeRO stage it implies."""
    args.deepspeed_user_config = read_deepspeed_json(args.deepspeed_config)
    if args.zero_stage is None:
        stage = (args.deepspeed_user_config or {}).get("zero_optimization", {}).get("stage")
        # bf16: ZeRO-1 partitions BF16_Optimizer's fp32 master weights over DP. fp32/fp16: stage 0, as a
        # ZeRO wrapper refuses the fp32 path's grad-norm-clipping client optimizer (megatron.engine.optimizer)
        args.zero_stage = (int(stage) if stage is not None
                           else 1 if args.bf16 or args.use_distributed_optimizer else 0)
    if args.use_distributed_optimizer and args.zero_stage == 0 and not args.bf16:
        raise ValueError("--use-distributed-optimizer shards the optimizer states over the data-parallel ranks, "
                         "which --zero-stage 0 (or the JSON's stage 0) does not; drop one of them (stage 1 is the "
                         "distributed optimizer)")


def read_deepspeed_json(path: Optional[str]) -> Optional[dict]:
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed_config {path!r}: no such file")
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--deepspeed_config {path!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--deepspeed_config {path!r} must hold a JSON object, got {type(config).__name__}")
    return config


def collect_startup_warnings(args) -> None:
    """``startup_warnings``: settings that are accepted but change nothing in this run, or run as their
    equivalent (the real launch logs them once, the dry run lists them)."""
    args.startup_warnings = tuple(_no_effect_warnings(args))


def _no_effect_warnings(args) -> list[str]:
    out = []
    stage = deepspeed_zero_stage(args.zero_stage, args.bf16)
    if stage != args.zero_stage:
        out.append(f"--zero-stage {args.zero_stage} with --bf16 runs DeepSpeed's BF16_Optimizer (ZeRO stage {stage}), "
                   "BLOOM's optimizer: fp32 master weights and Adam states sharded over the data-parallel ranks, "
                   "what bigscience's DeepSpeed ran under stage 0 (DeepSpeed selects it by stage 1)")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        out.append("--sequence-parallel has no effect with --tensor-model-parallel-size 1 (there is no tensor-parallel "
                   "group to split the sequence over); the model runs without it")
    if not args.fp16:
        given = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in FP16_ONLY if getattr(args, n) is not None]
        if given:
            out.append(f"{', '.join(given)} ignored: loss scaling applies to --fp16 only")
    if args.max_position_embeddings is not None and args.position_embedding_type != "absolute":
        out.append(f"--max-position-embeddings {args.max_position_embeddings} has no effect with "
                   f"--position-embedding-type {args.position_embedding_type} (no learned positions)")
    if args.rope_scaling_factor != 8.0 and not args.use_rope_scaling:
        out.append(f"--rope-scaling-factor {args.rope_scaling_factor} has no effect without --use-rope-scaling")
    if args.add_qkv_bias and args.add_bias_linear:
        out.append("--add-qkv-bias has no effect without --disable-bias-linear (every linear layer has a bias)")
    if args.recompute_granularity == "selective" and args.checkpoint_activations:
        out.append("--recompute-granularity selective has no effect with --checkpoint-activations: full "
                   "recomputation already recomputes the attention core, so only full layers are recomputed "
                   "(Megatron-DeepSpeed runs both, recomputing the core a second time inside each layer)")
    if args.recompute_modules is not None and args.recompute_granularity != "selective":
        out.append(f"--recompute-modules {' '.join(args.recompute_modules)} has no effect without "
                   f"--recompute-granularity selective")
    if args.moe_layer_recompute:
        out.append("--moe-layer-recompute is deprecated (Megatron-LM): it runs as --recompute-granularity selective "
                   "--recompute-modules ... moe")
    if _uniform_beside_checkpoint_activations(args):
        out.append("--recompute-method uniform changes nothing beside --checkpoint-activations, which already "
                   "recomputes uniform chunks of --checkpoint-num-layers layers")
    if args.deepspeed_activation_checkpointing and not args.checkpoint_activations:
        out.append("--deepspeed-activation-checkpointing has no effect without --checkpoint-activations")
    if getattr(args, "attention_backend_alias", None):
        out.append(f"--attention-backend {args.attention_backend_alias} (Megatron-LM's name) runs as "
                   f"--attention-backend {args.attention_backend}: the same math on torch's kernels")
    out += moe_warnings(args) + muon_warnings(args) + fp8_warnings(args) + upstream_warnings(args)
    if args.distributed_backend == "nccl" and not _cuda_available():
        out.append("--distributed-backend nccl but CUDA is not available on this machine: the process group "
                   "cannot start here (use gloo on CPU)")
    return out


def _cuda_available() -> bool:
    import torch  # noqa: PLC0415 (the flag checks run without torch: it is read only for the device count)

    return torch.cuda.is_available()
