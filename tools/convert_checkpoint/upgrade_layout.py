#!/usr/bin/env python
"""Convert a checkpoint of this project's first layout (before 2026-12-01) to BLOOM's numbering.

    python tools/convert_checkpoint/upgrade_layout.py --load OLD_DIR --save NEW_DIR [--tag global_stepN]

The old layout numbered the layer files 00 (embedding), 01..L (blocks), L+1 (final LayerNorm) and
named the embedding LayerNorm ``embed_layernorm.*``; BLOOM's (``megatron.model.layout``) numbers
them 01, 03..L+2, L+4 and names it ``word_embeddings.norm.*``. Everything else is copied as it is:
the optimizer states do not depend on the numbering (the parameters keep their order), only the
parameter names recorded beside them (DeepSpeed's ``param_slice_mappings`` and ``param_shapes``,
which ``ds_to_universal`` reads) are renumbered, and the universal-checkpoint info is made anew.
The result resumes exactly where the old checkpoint stopped (tests/training/test_reference_losses.py).
Every file is read with ``megatron.checkpoint.safe_load`` (no code in a checkpoint runs); NEW_DIR
must not hold that tag yet. The old checkpoint is left untouched.
"""

import argparse
import json
import os
import re
import shutil

import torch

from megatron.checkpoint import run_state as records
from megatron.checkpoint.integrity import record_checksums
from megatron.checkpoint.safe_load import safe_load
from megatron.checkpoint.tags import COMPLETE_MARKER, LATEST, RUN_STATE, resolve_tag, write_atomically
from megatron.model.layout import LAYOUT, LEGACY_LAYOUT, TIED_MODULE_PREFIX, file_key, pipeline_items

_LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="the old checkpoint directory (holding 'latest')")
    parser.add_argument("--tag", default=None, help="a tag inside --load (default: the one 'latest' names)")
    parser.add_argument("--save", required=True, help="where the converted checkpoint goes (its own 'latest')")
    return parser.parse_args(argv)


def index_map(config) -> dict[int, int]:
    """Old pipeline index -> BLOOM's, for every layer that owns parameters."""
    def owners(layout):
        return [item.index for item in pipeline_items(config, layout) if item.prefix is not None]

    return dict(zip(owners(LEGACY_LAYOUT), owners(LAYOUT)))


def _renumber(name: str, indices: dict[int, int]) -> str:
    """A pipeline module parameter name (``3.mlp...``) in the new numbering; tied names are unchanged."""
    head, dot, rest = name.partition(".")
    if name.startswith(TIED_MODULE_PREFIX) or not head.isdigit():
        return name
    return f"{indices[int(head)]}{dot}{rest}"


def _renamed_keys(mapping, indices: dict[int, int]):
    return type(mapping)((_renumber(k, indices), v) for k, v in mapping.items())


def _upgrade_layer_file(src: str, dst_dir: str, index: int, rank: int, indices: dict[int, int]) -> None:
    tensors = safe_load(src)
    renamed = {file_key(key) if index == 0 else key: value for key, value in tensors.items()}
    torch.save(renamed, os.path.join(dst_dir, f"layer_{indices[index]:02d}-model_{rank:02d}-model_states.pt"))


def _upgrade_model_states(src: str, dst: str, config, record: dict, indices: dict[int, int]) -> None:
    from megatron.checkpoint.universal.patterns import UNIVERSAL_CHECKPOINT_INFO, universal_checkpoint_info

    state = safe_load(src)
    if state.get("param_shapes"):
        state["param_shapes"] = [_renamed_keys(group, indices) for group in state["param_shapes"]]
    state[UNIVERSAL_CHECKPOINT_INFO] = universal_checkpoint_info(config)
    parallel, progress = record.get("parallel", {}), record.get("progress", {})
    state.setdefault("args", argparse.Namespace(**record["model_config"], **parallel,
                                                iteration=progress.get("iteration", 0),
                                                consumed_train_samples=progress.get("consumed_samples", 0)))
    state.setdefault("checkpoint_version", records.MEGATRON_CHECKPOINT_VERSION)
    torch.save(state, dst)


def _upgrade_optimizer_states(src: str, dst: str, indices: dict[int, int]) -> None:
    from megatron.engine.deepspeed_compat import DEEPSPEED_GLOBALS  # the DeepSpeed class these files hold

    state = safe_load(src, extra_globals=DEEPSPEED_GLOBALS)
    inner = state.get("optimizer_state_dict", {})
    if inner.get("param_slice_mappings"):
        inner["param_slice_mappings"] = [_renamed_keys(group, indices) for group in inner["param_slice_mappings"]]
    torch.save(state, dst)


def upgrade(load: str, save: str, tag=None) -> str:
    """Write the BLOOM-numbered copy of ``load``'s tag under ``save``; return the new tag directory."""
    tag = resolve_tag(load, tag, required=True)
    record = records.load_run_state(load, tag)
    if records.checkpoint_layout(record) != LEGACY_LAYOUT:
        raise ValueError(f"{os.path.join(load, tag)} is already in the {records.checkpoint_layout(record)!r} layout")
    config = records.model_config_from_dict(record["model_config"])
    indices = index_map(config)
    src_dir, dst_dir = os.path.join(load, tag), os.path.join(save, tag)
    if os.path.exists(dst_dir):
        raise ValueError(f"{dst_dir} already exists; choose another --save directory")
    os.makedirs(dst_dir)
    for entry in sorted(os.listdir(src_dir)):
        src, dst = os.path.join(src_dir, entry), os.path.join(dst_dir, entry)
        layer = _LAYER_FILE.match(entry)
        if layer:
            _upgrade_layer_file(src, dst_dir, int(layer.group(1)), int(layer.group(2)), indices)
        elif entry.startswith("mp_rank_") and entry.endswith("_model_states.pt"):
            _upgrade_model_states(src, dst, config, record, indices)
        elif entry.endswith("optim_states.pt"):
            _upgrade_optimizer_states(src, dst, indices)
        elif entry not in (RUN_STATE, COMPLETE_MARKER):
            shutil.copy2(src, dst)
    write_atomically(os.path.join(dst_dir, RUN_STATE),
                     json.dumps(dict(record, checkpoint_layout=LAYOUT), indent=1, sort_keys=True))
    record_checksums(dst_dir, distributed=False)
    write_atomically(os.path.join(dst_dir, COMPLETE_MARKER), f"upgraded from {src_dir}\n")
    write_atomically(os.path.join(save, LATEST), tag)
    return dst_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"wrote {upgrade(args.load, args.save, args.tag)} (BLOOM's pipeline numbering)")
    return 0


if __name__ == "__main__":
    from megatron.cli import run_tool

    run_tool(main)
