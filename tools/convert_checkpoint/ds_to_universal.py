#!/usr/bin/env python
"""Convert a DeepSpeed checkpoint tag into a universal checkpoint, loadable on any TP, PP and DP.

    tools/convert_checkpoint/ds_to_universal.py --input_folder CKPT/global_stepN \\
        --output_folder CKPT/global_stepN_universal [--target-engine pipeline|model]
    pretrain_gpt.py ... --load CKPT --universal-checkpoint     # any new layout

``--target-engine`` names the DeepSpeed engine of the run that will load it: ``pipeline`` for
``--zero-stage`` 0 / 1 (any TP, PP, DP), ``model`` for ``--zero-stage 2`` and ``3`` (PP = 1, any TP and
DP); by default the engine of the run that saved it. Except from the pipeline engine to itself, the
parameter folders are renamed and their files rewritten for the target's loaders
(``megatron.checkpoint.universal.engines``), and ``run_state.json`` records the target
(``universal_engine``), which ``--load`` checks.

Wraps DeepSpeed's own converter (``deepspeed.checkpoint.ds_to_universal``), which writes
``CKPT/latest_universal``. Around it, this wrapper
  - refuses an incomplete input tag, and one whose files do not match their checksums (naming them);
  - refuses a ZeRO-0 checkpoint (its optimizer state is not in the ZeRO partition files DeepSpeed's converter
    reads), before writing anything, naming the ways it can move instead;
  - runs the converter with every ``torch.load`` made safe (``megatron.engine.deepspeed_compat.
    safe_loading``: DeepSpeed's own calls unpickle anything), so a crafted pickle in any input
    file is refused, naming the file, and its code never runs;
  - records the checksums of every output file (after the renaming), writes our ``run_state.json`` and marks the output
    ``complete`` last (our loader refuses tags without it), so a crashed conversion is never loaded
    and a damaged one is named when loaded.
  - for an MoE model, gives every expert parameter one folder holding all the experts (at EP > 1 DeepSpeed's
    converter reads a copy of the tag with per-EP-rank expert names) and keeps the routers' expert biases
    (``megatron.checkpoint.universal.expert_folders``), so the run moves between EP sizes too;
ZeRO-2 and ZeRO-3 checkpoints convert too, for ZeRO-2 / ZeRO-3 runs or (``--target-engine pipeline``) a
3D one; a 3D checkpoint converts for them with ``--target-engine model``.
Options other than the two folders and ``--target-engine`` are passed through to DeepSpeed's converter.
"""

import argparse
import glob
import json
import os
import shutil
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(argv=None) -> int:
    from deepspeed.checkpoint import ds_to_universal as converter

    from megatron.checkpoint.integrity import record_checksums, verify_checksums
    from megatron.checkpoint.run_state import UNIVERSAL_ENGINE, load_run_state, model_config_from_dict, reader_for
    from megatron.checkpoint.tags import COMPLETE_MARKER, RUN_STATE, write_atomically, write_complete_marker
    from megatron.checkpoint.universal.engines import ENGINES, retarget
    from megatron.checkpoint.universal.expert_folders import save_fp8_state
    from megatron.engine.deepspeed_compat import safe_loading

    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--input_folder", required=True)
    ours.add_argument("--output_folder", required=True)
    ours.add_argument("--target-engine", choices=ENGINES, default=None)
    known, rest = ours.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not os.path.isfile(os.path.join(known.input_folder, COMPLETE_MARKER)):
        raise SystemExit(f"{known.input_folder} has no '{COMPLETE_MARKER}' marker: it is not a finished checkpoint "
                         f"(was the save interrupted?); convert a complete one")
    tag_dir = os.path.normpath(known.input_folder)
    record = load_run_state(os.path.dirname(tag_dir), os.path.basename(tag_dir))
    _refuse_unpartitioned(tag_dir, record)
    source = reader_for(record)  # a regular checkpoint: the engine that saved it
    target = known.target_engine or source
    problems = verify_checksums(known.input_folder, distributed=False)
    if problems:
        raise SystemExit(f"{known.input_folder} is damaged: " + "; ".join(problems)
                         + "; convert an intact checkpoint (an earlier global_step*)")
    config = model_config_from_dict(record["model_config"])
    staging = _stage_experts(tag_dir, known.output_folder, config, source, record)
    args = _parse_with(converter, ["--input_folder", staging or known.input_folder,
                                   "--output_folder", known.output_folder] + rest)
    try:
        with safe_loading():  # DeepSpeed's converter asks torch.load for weights_only=False
            converter.main(args)
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
    _merge_experts(tag_dir, known.output_folder, config, source, record)
    fp8 = save_fp8_state(tag_dir, known.output_folder, config)  # delayed scaling's histories: buffers
    if fp8:
        print(f"FP8: {fp8} scaling-state tensors (amax histories, scales) kept beside the parameters")
    renamed = retarget(known.output_folder, config, source, target)
    if renamed:
        print(f"{renamed} parameters renamed for the {target} engine")
    record_checksums(known.output_folder, distributed=False)
    record[UNIVERSAL_ENGINE] = target
    write_atomically(os.path.join(known.output_folder, RUN_STATE), json.dumps(record, indent=1, sort_keys=True))
    write_complete_marker(known.output_folder, os.path.basename(os.path.normpath(known.input_folder)))
    print(f"universal checkpoint written to {known.output_folder}")
    return 0


def _stage_experts(tag_dir: str, output_folder: str, config, source: str, record: dict):
    """MoE at EP > 1: the copy of ``tag_dir`` with per-EP-rank expert names that DeepSpeed's converter reads
    (``megatron.checkpoint.universal.expert_folders``), beside the output; None for other checkpoints."""
    from megatron.checkpoint.universal.expert_folders import stage_expert_names

    parallel = record.get("parallel", {})
    ep = parallel.get("expert_model_parallel_size", 1)
    if config.moe is None or ep == 1:
        return None
    staging = os.path.normpath(output_folder) + ".ep_staging"
    shutil.rmtree(staging, ignore_errors=True)  # left by a conversion that died half-way
    tp = parallel.get("tensor_model_parallel_size", 1)
    stage_expert_names(tag_dir, staging, config, source, ep, tp, parallel.get("expert_tensor_parallel_size", tp),
                       parallel.get("ds_sequence_parallel_size", 1))
    return staging


def _merge_experts(tag_dir: str, output_folder: str, config, source: str, record: dict) -> None:
    """MoE: every expert parameter's folder holds all the experts, and the routers' expert biases are kept."""
    from megatron.checkpoint.universal.expert_folders import (
        extract_whole_experts,
        merge_expert_folders,
        save_router_state,
    )
    from megatron.checkpoint.universal.patterns import C, universal_checkpoint_info

    if config.moe is None:
        return
    parallel = record.get("parallel", {})
    rows = universal_checkpoint_info(config, source)[C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS]
    ep, tp = parallel.get("expert_model_parallel_size", 1), parallel.get("tensor_model_parallel_size", 1)
    etp = parallel.get("expert_tensor_parallel_size", tp)  # below TP: whole experts, hidden from DeepSpeed's converter
    if etp < tp:
        extract_whole_experts(tag_dir, os.path.join(output_folder, "zero"), config, source, ep, tp, etp)
    merged = merge_expert_folders(os.path.join(output_folder, "zero"), config, source, ep, etp, rows)
    biases = save_router_state(tag_dir, output_folder, config)
    print(f"MoE: {merged} expert parameters merged over the expert-parallel ranks, {biases} routers' expert biases")


def _refuse_unpartitioned(tag_dir: str, record: dict) -> None:
    """DeepSpeed's converter reads the optimizer's ZeRO partitions (``*_optim_states.pt``); at ZeRO stage 0 the
    engine keeps the optimizer in its model-states files and writes none, and DeepSpeed 0.19.8's converter then
    stops with a FileNotFoundError about a glob. Refuse such a tag before any work, saying why."""
    stage = record.get("parallel", {}).get("zero_stage")
    if stage == 0 or not glob.glob(os.path.join(tag_dir, "*_optim_states.pt")):
        said = f"was saved at --zero-stage {stage}: it holds" if stage is not None else "holds"
        raise ValueError(f"{tag_dir} {said} no ZeRO optimizer partitions (*_optim_states.pt), which a universal "
                         f"checkpoint is made from. Resume it on its own layout, or move its weights only: "
                         f"tools/convert_checkpoint/to_hf.py, then from_hf.py at the new sizes, loaded with "
                         f"--finetune; runs at --zero-stage 1 or above write checkpoints that convert")


def _parse_with(converter, argv):
    saved = sys.argv
    sys.argv = ["ds_to_universal"] + list(argv)
    try:
        return converter.parse_arguments()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    from megatron.cli import run_tool

    run_tool(main)
