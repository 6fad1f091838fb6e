"""Resuming a run from ``--load``: which tag, whether it loads on this run's layout, and the load itself.

    resume_point(rc)             (tag, record) a resume reads, or None; every reason it cannot is a ValueError,
                                 before any process group (file reads only: each rank finds the same)
    intact_resume_point(rc, p)   ``p`` if its files match their checksums, else the newest earlier intact one
    restore(rc, engine, p, ...)  load ``p`` into the engine, the schedule and the RNG; the saved progress

Which DeepSpeed engine may read a checkpoint is the record's answer (``run_state.reader_for``). The
engine is duck-typed; what DeepSpeed's loaders need around the load (safe unpickling, the universal
loaders' mending) is the caller's ``loading`` context (``megatron.engine.deepspeed_compat``): nothing
here imports the engine or the training loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Callable, ContextManager, Optional

import torch.distributed as dist

from megatron.checkpoint import run_state, tags, training_io
from megatron.checkpoint.integrity import verify_checksums
from megatron.checkpoint.universal.fp8_state import load_fp8_state
from megatron.checkpoint.universal.router_state import load_router_state
from megatron.config import RunConfig, parallel_dims
from megatron.model.layout import LAYOUT

__all__ = ["resume_point", "intact_resume_point", "restore"]

Point = Optional[tuple[str, dict]]  # (tag, its run_state record), or None: start from scratch


def _print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def resume_point(rc: RunConfig, tag: Optional[str] = None) -> Point:
    """(tag, its record) that --load resumes from (``tag``: that one), or None; every reason it cannot is
    a ValueError here, before any process group exists (file reads only: each rank finds the same)."""
    ck = rc.checkpoint
    if not ck.load:
        return None
    tag = tags.resolve_tag(ck.load, tag, universal=ck.universal_checkpoint)
    if tag is None:
        return None
    saved = run_state.load_run_state(ck.load, tag)
    if run_state.checkpoint_layout(saved) != LAYOUT:
        raise ValueError(f"{os.path.join(ck.load, tag)} numbers its layer files the way this project did before "
                         f"2026-12-01 (layout {run_state.checkpoint_layout(saved)!r}); convert it once to BLOOM's "
                         f"numbering: python tools/convert_checkpoint/upgrade_layout.py --load {ck.load} "
                         f"--save NEW_DIR, then --load NEW_DIR")
    run_state.check_model_config(saved["model_config"], dataclasses.asdict(rc.model), universal=ck.universal_checkpoint)
    if "written_by" in saved and not ck.finetune:  # a record made from another tool's args
        raise ValueError(f"{os.path.join(ck.load, tag)} was written by {saved['written_by']}: it holds weights but "
                         f"not this project's optimizer state, schedule and RNG; pass --finetune to train from its "
                         f"weights with a new schedule")
    if not ck.universal_checkpoint:
        _check_same_layout(rc, os.path.join(ck.load, tag), saved)
    else:
        _check_universal_engine(rc, os.path.join(ck.load, tag), saved)
    return tag, saved


def _check_universal_engine(rc: RunConfig, tag_dir: str, saved: dict) -> None:
    """A universal checkpoint's parameter folders are named for one DeepSpeed engine (ds_to_universal.py
    --target-engine): the pipeline engine's for ZeRO-0/1 runs, GPTModel's for ZeRO-2/3 runs."""
    stage, tp = rc.deepspeed_zero_stage, rc.parallel.tensor_model_parallel_size
    if (stage == 2 or stage == 3 and tp > 1) and run_state.UNIVERSAL_ENGINE not in saved:
        # older conversions keep DeepSpeed's ZeRO-3 files: flat tensors, without ZeRO-2's model-states names
        raise ValueError(f"{tag_dir} was converted before ds_to_universal.py wrote universal checkpoints that "
                         f"ZeRO-2 runs and ZeRO-3 runs at TP > 1 read; convert its source checkpoint again "
                         f"(--target-engine model), or load it at --zero-stage 3 --tensor-model-parallel-size 1")
    engine, wanted = run_state.reader_for(saved, universal=True), rc.deepspeed_engine
    if engine != wanted:
        runs = {"model": "ZeRO-2 / ZeRO-3 runs", "pipeline": "--zero-stage 0 / 1 runs"}
        raise ValueError(f"{tag_dir} is a universal checkpoint for the {engine} engine ({runs[engine]}); this run "
                         f"(--zero-stage {stage}) is on the {wanted} engine. Convert its source checkpoint again "
                         f"with: python tools/convert_checkpoint/ds_to_universal.py --input_folder SOURCE_TAG "
                         f"--output_folder NEW_TAG --target-engine {wanted}")


def _check_same_layout(rc: RunConfig, tag_dir: str, saved: dict) -> None:
    """A regular checkpoint holds per-TP-rank weight files and per-DP-rank optimizer shards: it loads at
    its own TP and PP (and DP, when the optimizer state is loaded), into the engine that saved it."""
    p, ck, recorded = rc.parallel, rc.checkpoint, saved.get("parallel", {})
    # MoE: each EP rank's experts are in their own file (absent: EP = 1)
    ep = (recorded.get("expert_model_parallel_size", 1), p.expert_model_parallel_size)
    if ep[0] != ep[1]:
        raise ValueError(f"{tag_dir} was saved with --expert-model-parallel-size {ep[0]} (this run: {ep[1]}); a regular MoE "
                         f"checkpoint loads only at its own expert-parallel size: run with "
                         f"--expert-model-parallel-size {ep[0]}, or convert it once: python "
                         f"tools/convert_checkpoint/ds_to_universal.py --input_folder {tag_dir} --output_folder "
                         f"{tag_dir}_universal, then add --universal-checkpoint")
    # the experts' split: which experts (and shards) each (EP, expert-TP) rank's expert file holds (absent: TP)
    saved_tp = recorded.get("tensor_model_parallel_size")
    etp = (recorded.get("expert_tensor_parallel_size", saved_tp), p.expert_tp)
    if rc.model.moe is not None and saved_tp == p.tensor_model_parallel_size and etp[0] != etp[1]:
        raise ValueError(f"{tag_dir} was saved with --expert-tensor-parallel-size {etp[0]} (this run: {etp[1]}); a "
                         f"regular MoE checkpoint loads only at its own expert split: run with "
                         f"--expert-tensor-parallel-size {etp[0]}")
    # TP / PP always (the weight files); with the optimizer state, the ZeRO shards (dp x sp x cp) and which
    # layers a shard holds (virtual stages): megatron.config.parallel_dims' on_resume
    loads_optimizer = not (ck.no_load_optim or ck.finetune)
    sizes = parallel_dims.resume_mismatches(recorded, p.sizes(), loads_optimizer=loads_optimizer)
    # the pipeline layout flags: which layers a rank's optimizer shard (and an MoE rank's expert file) holds
    layouts = (recorded.get("pipeline_layout"), run_state.pipeline_layout_of(rc))
    if layouts[0] != layouts[1] and (loads_optimizer or rc.model.moe is not None):
        split = "--pp-partition-method's split"
        sizes["pipeline layout"] = tuple(split if layout is None else layout for layout in layouts)
    saved_stage = recorded.get("zero_stage")
    if saved_stage is not None and saved_stage != rc.deepspeed_zero_stage and max(saved_stage, rc.deepspeed_zero_stage) >= 2:
        # ZeRO-2 and ZeRO-3 write DeepSpeed's model engine's files, each its own way
        sizes["ZeRO stage"] = (saved_stage, rc.deepspeed_zero_stage)
    # Each engine writes its own files (run_state.WEIGHT_FILE_KINDS), whatever the sizes: only the one
    # that saved a regular checkpoint reads it.
    sizes["DeepSpeed engine"] = (run_state.reader_for(saved), rc.deepspeed_engine)
    differ = {name: pair for name, pair in sizes.items() if pair[0] is not None and pair[0] != pair[1]}
    if differ:
        said = ", ".join(f"{name} {then} (this run: {now})" for name, (then, now) in differ.items())
        if saved_stage == 0:
            # no ZeRO optimizer partitions: ds_to_universal.py refuses it, only the weights can move
            raise ValueError(f"{tag_dir} was saved with {said}; a regular checkpoint loads only on its own layout, "
                             f"and one saved at --zero-stage 0 cannot become a universal checkpoint (it has no ZeRO "
                             f"optimizer partitions). Run with the checkpoint's sizes, or move its weights only: "
                             f"tools/convert_checkpoint/to_hf.py, then from_hf.py at this run's sizes, with --finetune")
        target = f" --target-engine {rc.deepspeed_engine}" if "DeepSpeed engine" in differ else ""
        raise ValueError(f"{tag_dir} was saved with {said}; a regular checkpoint loads only on its own layout. "
                         f"Convert it once: python tools/convert_checkpoint/ds_to_universal.py --input_folder "
                         f"{tag_dir} --output_folder {tag_dir}_universal{target}, then add --universal-checkpoint "
                         f"(or run with the checkpoint's sizes)")


def intact_resume_point(rc: RunConfig, point: Point) -> Point:
    """``point`` if its files match their checksums, else the newest earlier complete checkpoint that
    does (with a warning), else a ValueError naming what is damaged. Collective (the ranks share the
    hashing). A damaged universal checkpoint, or any with --no-load-fallback, is an error: no fallback."""
    if point is None:
        return point
    ck = rc.checkpoint
    load = ck.load
    problems = verify_checksums(os.path.join(load, point[0]))
    if not problems:
        return point
    if ck.universal_checkpoint or ck.no_load_fallback:
        fix = ("convert an intact checkpoint again with tools/convert_checkpoint/ds_to_universal.py"
               if ck.universal_checkpoint else "drop --no-load-fallback to resume from the newest intact one")
        raise ValueError(f"{os.path.join(load, point[0])} is damaged: " + "; ".join(problems) + f"; {fix}")
    for tag in reversed(tags.complete_tags(load)):
        if tag != point[0] and tags.tag_number(tag) < tags.tag_number(point[0]):
            if not verify_checksums(os.path.join(load, tag)):
                warnings.warn(f"{os.path.join(load, point[0])} is damaged ({'; '.join(problems)}); resuming from "
                              f"the newest intact checkpoint, {tag}")
                return resume_point(rc, tag)
    raise ValueError(f"{os.path.join(load, point[0])} is damaged and no earlier checkpoint in {load} is intact: "
                     + "; ".join(problems))



def restore(rc: RunConfig, engine, point: Point, lr_scheduler, tracker, *,
            loading: Callable[[], ContextManager] = contextlib.nullcontext,
            after_load: Optional[Callable[[str], None]] = None) -> dict:
    """Load ``point`` into ``engine`` (weights, and optimizer state unless --no-load-optim / --finetune), the
    learning-rate schedule into ``lr_scheduler`` and the RNG states (unless --no-load-rng) into ``tracker``;
    the saved progress counters ({} to start from scratch: no checkpoint yet, or --finetune). Collective.

    loading: the context DeepSpeed's loader runs in (``megatron.engine.deepspeed_compat.checkpoint_loading``);
    after_load(tag_dir): a check of the loaded state (non-finite values), on every rank.
    """
    ck = rc.checkpoint
    if point is None:
        if ck.load:
            _print_rank_0(f"no checkpoint in {ck.load} yet: starting from scratch")
        return {}
    tag = point[0]
    tag_dir = os.path.join(ck.load, tag)
    note = run_state.rotary_scaling_change(point[1]["model_config"], dataclasses.asdict(rc.model))
    if note is not None:
        _print_rank_0(note)
    with loading():
        client = training_io.load_checkpoint(engine, ck.load, tag,
                                             load_optimizer_states=not (ck.no_load_optim or ck.finetune))
    if ck.universal_checkpoint:  # MoE routers' expert biases, FP8 scaling state: buffers, beside the parameters
        load_router_state(engine.module, tag_dir, rc.model)
        load_fp8_state(engine.module, tag_dir, rc.model)
    if after_load is not None:
        after_load(tag_dir)
    if ck.finetune:
        _print_rank_0(f"loaded the weights of {tag_dir} (--finetune: iteration 0, new schedule)")
        return {}
    lr_scheduler.load_state_dict(client["lr_scheduler"])
    if not ck.no_load_rng:
        training_io.set_rng_state(client["rng"], tracker)
    progress = client["progress"]
    _print_rank_0(f"resumed from {tag_dir} at iteration {progress['iteration']} "
                  f"({progress['consumed_samples']} samples consumed)")
    return progress
