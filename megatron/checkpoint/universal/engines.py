"""One universal checkpoint, loadable by either DeepSpeed engine: renaming its ``zero/`` folders.

DeepSpeed's ``ds_to_universal`` writes one folder per parameter under ``TAG/zero/``, named as the engine
that saved the checkpoint names its parameters, and each engine's loader finds its parameters by its own
names (``engine.param_names``) and reads its own files:

    engine     runs                 parameter folders
    pipeline   --zero-stage 0 / 1   3.mlp.dense_4h_to_h.weight, tied_modules.embed.word_embeddings.weight,
                                    6.weight (the final norm)
    model      --zero-stage 2 / 3   layers.0.mlp.dense_4h_to_h.weight, embedding.word_embeddings.weight,
               (megatron.engine.    final_layernorm.weight
               sharded, PP = 1)

and the model-states files: ``zero_pp_rank_0_mp_rank_XX_model_states.pt`` under ZeRO-3,
``mp_rank_XX_model_states.pt`` otherwise.

``retarget`` rewrites a converted checkpoint for the other engine (or, in GPTModel's names, for both
ZeRO-2 and ZeRO-3), every name through
``megatron.model.layout`` (each parameter mapped, none dropped; a folder the layout does not know is an
error naming it):

- the tied word embedding is one folder either way (the pipeline engine loads it on the first and the
  last stage from the same folder); an untied head (``output_layer.weight``) is its own folder too;
- the tensors are rewritten in one form both loaders read: ZeRO-3 at TP = 1 gives flat tensors without
  DeepSpeed's record of how to split them, and ZeRO-1/2's loader (the pipeline engine's) cuts each
  tensor into its TP slices along ``cat_dim`` (1 for row-parallel weights) and pads the rows of a
  ``vocab_tensor``, so each file gets its full shape and those keys from the layout, and each folder a
  ``step.pt`` (that loader's Adam step count; ZeRO-3's reads it from ``optimizer_state.pt``);
- ``zero/optimizer_state.pt`` holds what either loader reads (ZeRO-3 the step count under
  ``optimizer_state_dict``, ZeRO-1/2 the DeepSpeed version), from the source's;
- the model-states files (DeepSpeed's counters and our client state: progress, schedule, RNG), one per
  model-parallel rank of the saving run (DeepSpeed's loader checks their number), take the names the
  target engine looks for (for GPTModel's names both ZeRO-2's and ZeRO-3's), without the module
  weights (a universal load takes them from ``zero/``).

Every file is read weights-only (``megatron.checkpoint.safe_load``). The caller records checksums and the
``complete`` marker afterwards (tools/convert_checkpoint/ds_to_universal.py), so a retargeted folder is
verified at ``--load`` like any other.
"""

from __future__ import annotations

import glob
import os
import shutil
from typing import Optional

import torch

from megatron.checkpoint.safe_load import safe_load
from megatron.checkpoint.tags import CheckpointFormatError
from megatron.checkpoint.universal.patterns import C
from megatron.checkpoint.zero_files import DEEPSPEED_GLOBALS
from megatron.config import ModelConfig
from megatron.model.layout import ParameterLayout, parameter_layout, pipeline_name

__all__ = ["ENGINES", "retarget", "folder_names"]

ENGINES = ("pipeline", "model")
_STATES = ("fp32", "exp_avg", "exp_avg_sq")
_OPTIMIZER_STATE = "optimizer_state.pt"
# DeepSpeed's model-states files, one per model-parallel rank of the saving run (its loader checks their
# number): ZeRO-3 names them after the DP rank too (DP rank 0's are kept), every other stage does not
_STAGE3_STATES, _STATES_FILE = "zero_pp_rank_0_mp_rank_{:02d}_model_states.pt", "mp_rank_{:02d}_model_states.pt"
_TARGET_STATES = {"pipeline": (_STATES_FILE,), "model": (_STATES_FILE, _STAGE3_STATES)}  # model: ZeRO-2 and 3


def folder_names(config: ModelConfig, engine: str) -> dict[str, ParameterLayout]:
    """Every parameter's ``zero/`` folder name under ``engine``'s naming, to its layout."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    layout = parameter_layout(config).values()
    return {(p.name if engine == "model" else pipeline_name(p)): p for p in layout}


def _load(path: str):
    return safe_load(path, extra_globals=DEEPSPEED_GLOBALS)


def _parameter_folders(zero_dir: str) -> set[str]:
    return {name for name in os.listdir(zero_dir) if os.path.isdir(os.path.join(zero_dir, name))}


def _check_complete(zero_dir: str, names: dict[str, ParameterLayout], engine: str) -> None:
    found, expected = _parameter_folders(zero_dir), set(names)
    unknown, missing = sorted(found - expected), sorted(expected - found)
    if unknown or missing:
        raise CheckpointFormatError(
            f"{zero_dir}: the parameter folders do not match the model's layout in the {engine} engine's names "
            + (f"(not in the model: {unknown}) " if unknown else "") + (f"(missing: {missing}) " if missing else "")
            + "; was it converted from a checkpoint of this architecture, with this project's ds_to_universal.py?")


def _model_states(tag_dir: str) -> list[str]:
    """The source's model-states files, by model-parallel rank."""
    pattern = _STAGE3_STATES if os.path.isfile(os.path.join(tag_dir, _STAGE3_STATES.format(0))) else _STATES_FILE
    count = len(glob.glob(os.path.join(tag_dir, pattern.replace("{:02d}", "*"))))
    ranked = [os.path.join(tag_dir, pattern.format(rank)) for rank in range(count)]
    missing = [path for path in ranked if not os.path.isfile(path)]
    if not ranked or missing:
        raise CheckpointFormatError(f"{tag_dir} lacks {missing or pattern.format(0)}: not a universal checkpoint "
                                    f"written by DeepSpeed's converter")
    return ranked


def _full_shapes(model_states: str) -> dict[str, torch.Size]:
    """Parameter shapes a ZeRO-3 run recorded (its TP = 1 shapes are the full ones)."""
    record = _load(model_states)
    return {name: shape for group in record.get(C.PARAM_SHAPES, []) for name, shape in group.items()}


def _step_of(zero_dir: str, names: dict[str, ParameterLayout]):
    """Adam's step count: the per-parameter ``step.pt`` (ZeRO-1 / 2, all equal), else ZeRO-3's record's."""
    paths = [os.path.join(zero_dir, name, "step.pt") for name in names]
    if not all(os.path.isfile(path) for path in paths):
        state = _load(os.path.join(zero_dir, _OPTIMIZER_STATE))[C.OPTIMIZER_STATE_DICT]["state"]
        return next(iter(state.values()))["step"]
    steps = [_load(path) for path in paths]
    values = {float(step) for step in steps}
    if len(values) != 1:
        raise CheckpointFormatError(f"{zero_dir}: the parameters' step counts differ ({sorted(values)})")
    return steps[0]


def _tensor_file(path: str, param: ParameterLayout, shape: Optional[torch.Size]) -> dict:
    """One state of one parameter as both loaders read it: a dict holding the full tensor and, for ZeRO-1's
    loader (which cuts it into TP slices along ``cat_dim``, row-parallel weights along 1, and pads the
    rows of a ``vocab_tensor`` to its padded vocabulary), how it is split; ZeRO-3's reads the tensor only."""
    loaded = _load(path)
    record = dict(loaded) if isinstance(loaded, dict) else {C.PARAM: loaded}
    tensor = record[C.PARAM]
    if shape is not None and tensor.numel() != shape.numel():
        raise CheckpointFormatError(f"{path} holds {tensor.numel()} values, the parameter {param.name} "
                                    f"{tuple(shape)} = {shape.numel()}")
    record[C.PARAM] = tensor if shape is None else tensor.reshape(shape)
    record.pop(C.CAT_DIM, None)
    if not param.replicated:  # a replicated parameter keeps its full shape on every TP rank
        record[C.CAT_DIM] = param.partition_dim
    if param.vocab_parallel:
        record[C.VOCAB_TENSOR] = True
    return record


def _optimizer_state(zero_dir: str, target: str, step, ds_version: str) -> dict:
    """``zero/optimizer_state.pt`` with what both loaders read: ZeRO-3 Adam's step under
    ``optimizer_state_dict`` (and every group's hyperparameters from the first: megatron.training.pretrain
    restores the run's own), ZeRO-1 the DeepSpeed version and the parameter groups."""
    saved = _load(os.path.join(zero_dir, _OPTIMIZER_STATE))
    groups = list(saved[C.PARAM_GROUPS])
    if target == "pipeline" and len(groups) == 1:
        # ZeRO-1's loader sets Adam's step only in the groups the record lists; ZeRO-3 runs saved before
        # 2026-12-01 put every parameter in one group (megatron.engine.optimizer.param_groups), ours has two
        groups = groups * 2
    out = {key: saved[key] for key in (C.LOSS_SCALER, "dynamic_loss_scale", "overflow", C.CLIP_GRAD) if key in saved}
    out.update({C.PARAM_GROUPS: groups, C.DS_VERSION: saved.get(C.DS_VERSION, ds_version),
                C.OPTIMIZER_STATE_DICT: {"state": {0: {"step": step}}, "param_groups": groups}})
    return out


def retarget(tag_dir: str, config: ModelConfig, source: str, target: str) -> int:
    """Rewrite the universal checkpoint ``tag_dir`` (DeepSpeed's converter's output, in ``source``'s
    names) for the ``target`` engine; the number of parameters rewritten. A checkpoint of the pipeline
    engine for the pipeline engine is left as DeepSpeed wrote it; one in GPTModel's names for GPTModel's
    is rewritten too, so ZeRO-2 and ZeRO-3 runs both read it."""
    if source not in ENGINES or target not in ENGINES:
        raise ValueError(f"engines must be among {', '.join(ENGINES)}, got {source!r} -> {target!r}")
    if source == target == "pipeline":
        return 0
    zero_dir, staging = os.path.join(tag_dir, "zero"), os.path.join(tag_dir, "zero.retarget")
    shutil.rmtree(staging, ignore_errors=True)  # left by a conversion that died half-way
    old, new = folder_names(config, source), folder_names(config, target)
    _check_complete(zero_dir, old, source)
    states_files = _model_states(tag_dir)
    record = _load(states_files[0])
    # ZeRO-3 at TP = 1 leaves flat tensors (its recorded shapes are the full ones); DeepSpeed merges TP > 1
    # slices into full-shaped tensors, and the other stages' are full-shaped too
    shapes = _full_shapes(states_files[0]) if source == "model" and record.get("mp_world_size", 1) == 1 else {}
    step = _step_of(zero_dir, old)
    renamed = {}
    for old_name, param in old.items():
        new_name = pipeline_name(param) if target == "pipeline" else param.name
        folder = os.path.join(staging, new_name)
        os.makedirs(folder)
        for state in _STATES:
            path = os.path.join(zero_dir, old_name, f"{state}.pt")
            torch.save(_tensor_file(path, param, shapes.get(param.name)), os.path.join(folder, f"{state}.pt"))
        torch.save(step, os.path.join(folder, "step.pt"))  # ZeRO-1/2's loader's Adam step (ZeRO-3 reads the record's)
        renamed[old_name] = new_name
    assert sorted(renamed.values()) == sorted(new), "every parameter is written once under its new name"
    torch.save(_optimizer_state(zero_dir, target, step, record.get(C.DS_VERSION, "")),
               os.path.join(staging, _OPTIMIZER_STATE))
    shutil.rmtree(zero_dir)
    os.replace(staging, zero_dir)
    # The model-states files under the target's names: DeepSpeed's counters and our client state. Their
    # module weights are not read from a universal checkpoint (zero/ holds them): the copies leave them out.
    staged = []
    for rank, path in enumerate(states_files):
        states = _load(path)
        states["module"] = None
        staged.append(os.path.join(tag_dir, f".{rank}.model_states.retarget"))
        torch.save(states, staged[-1])
    for path in glob.glob(os.path.join(tag_dir, "*model_states.pt")):  # ZeRO-3: every DP rank's
        os.remove(path)
    for rank, path in enumerate(staged):
        for name in _TARGET_STATES[target]:
            shutil.copyfile(path, os.path.join(tag_dir, name.format(rank)))
        os.remove(path)
    return len(renamed)
