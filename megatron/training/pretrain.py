"""``pretrain(run_config)``: everything between the parsed flags and the trained model.

1. join the process group (torchrun, the DeepSpeed launcher or srun) and build ``ParallelState``;
2. seed python / numpy / torch (+100 per pipeline stage, as Megatron) and the TP RNG tracker;
3. build the datasets and this rank's iterators (data-parallel slice, from the consumed samples);
4. build the DeepSpeed pipeline engine from the DeepSpeed config the flags give;
5. resume from ``--load`` if it holds a checkpoint; 6. train; 7. test; save on the way out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import time
import warnings
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.checkpoint import lock as save_lock
from megatron.checkpoint import run_state, tags, training_io
from megatron.checkpoint.integrity import verify_checksums
from megatron.checkpoint.safe_load import only_safe_loading
from megatron.config import RunConfig
from megatron.model.layout import LAYOUT
from megatron.engine.checkpoint_engine import DEEPSPEED_GLOBALS
from megatron.engine.checks import check_finite_after_load
from megatron.engine.initialize import build_engine, init_deepspeed_comm
from megatron.engine.optimizer import sync_tp_duplicated
from megatron.checkpoint.universal import UNIVERSAL_CHECKPOINT_INFO, universal_checkpoint_info
from megatron.parallel.random import RNGStatesTracker, model_parallel_rng_seed
from megatron.parallel.state import ParallelState
from megatron.training.data import build_datasets, micro_batch_iterator
from megatron.training.distributed import init_process_group
from megatron.training.exit import ExitMonitor
from megatron.training.loop import Progress, Trainer
from megatron.training.lr_schedule import LRScheduler
from megatron.training.metrics import TrainingLogger
from megatron.training.microbatches import build_num_microbatches_calculator
from megatron.training.profiling import check_profiler_device


@dataclasses.dataclass
class PretrainResult:
    exit_reason: str           # '' (schedule finished), 'signal', 'kill-switch', 'exit-duration', 'exit-interval'
    progress: Progress
    history: list              # IterationRecord per iteration run in this process
    valid: dict[str, float]    # the last validation losses, by group name ('' for the --split validation set)
    test: dict[str, float]     # the test losses at the end of the schedule
    engine: object = None      # the DeepSpeed engine (for inspection by tests and tools)


def print_rank_0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def set_seeds(seed: int, state: ParallelState) -> RNGStatesTracker:
    """Megatron's seeding: one seed per pipeline stage, equal across TP and DP ranks; a tracker distinct per
    TP rank and, with Ulysses, per SP rank (attention dropout: each holds other heads after the all-to-all)."""
    stage_seed = seed + 100 * state.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    return model_parallel_rng_seed(stage_seed, state.sp_rank * state.tp_size + state.tp_rank, RNGStatesTracker())


def _tensorboard_writer(rc: RunConfig, is_last_rank: bool):
    if not rc.logging.tensorboard_dir or not is_last_rank:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=rc.logging.tensorboard_dir, max_queue=rc.logging.tensorboard_queue_size)


def _client_state(rc: RunConfig, progress: Progress, lr_scheduler, tracker) -> dict:
    """Saved by DeepSpeed with the weights (in mp_rank_XX_model_states.pt): what a resume restores, and
    Megatron's own top-level keys ('args', 'checkpoint_version'; 'iteration' is added by the writer)."""
    counters = dataclasses.asdict(progress)
    return {"progress": counters, "lr_scheduler": lr_scheduler.state_dict(), "rng": training_io.rng_state(tracker),
            UNIVERSAL_CHECKPOINT_INFO: universal_checkpoint_info(rc.model, rc.deepspeed_engine),
            "args": run_state.megatron_args(rc, counters), "checkpoint_version": run_state.MEGATRON_CHECKPOINT_VERSION}


def pretrain(rc: RunConfig) -> PretrainResult:
    start = time.time()
    point = resume_point(rc)  # a checkpoint that cannot be resumed fails here, before any process group
    check_profiler_device(rc.logging)
    p = rc.parallel
    info = init_process_group(p.distributed_backend, p.distributed_timeout_minutes)
    init_deepspeed_comm(p.distributed_backend, timeout_s=60.0 * p.distributed_timeout_minutes)
    point = intact_resume_point(rc, point)  # every file against its checksum, the hashing shared out
    state = ParallelState.create(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                 sp=p.ds_sequence_parallel_size)
    tracker = set_seeds(rc.training.seed, state)

    datasets = build_datasets(rc)
    engine = build_engine(rc, state, tracker=tracker)
    t = rc.training
    lr_scheduler = LRScheduler.from_run_config(engine.optimizer, rc)
    progress = _resume(rc, engine, lr_scheduler, tracker, point)

    dp = dict(dp_rank=state.dp_rank, dp_size=state.dp_size, sp_rank=state.sp_rank, sp_size=state.sp_size)
    train_iter = micro_batch_iterator(datasets.train, rc, consumed_samples=progress.consumed_samples,
                                      num_workers=rc.data.num_workers, **dp)
    valid_iters = {name: micro_batch_iterator(ds, rc, consumed_samples=0, num_workers=rc.data.valid_num_workers,
                                              **dp) for name, ds in datasets.valid.items()}
    is_last_rank = dist.get_rank() == dist.get_world_size() - 1
    writer = _tensorboard_writer(rc, is_last_rank)
    logger = TrainingLogger(writer, log_timers=rc.logging.log_timers_to_tensorboard,
                            log_batch_size=rc.logging.log_batch_size_to_tensorboard,
                            log_validation_ppl=rc.logging.log_validation_ppl_to_tensorboard,
                            print_fn=print if is_last_rank else (lambda *a, **k: None))

    def save(progress_now: Progress) -> None:
        tag = training_io.save_checkpoint(engine, rc.checkpoint.save, progress_now.iteration,
                                          _client_state(rc, progress_now, lr_scheduler, tracker),
                                          run_state.build_run_state(rc, dataclasses.asdict(progress_now)),
                                          rc.checkpoint.keep_last_n_checkpoints)
        print_rank_0(f"saved checkpoint {os.path.join(rc.checkpoint.save, tag)}")

    sync = (lambda: sync_tp_duplicated(engine.module, state.tp_group)) if t.sync_tp_duplicated_parameters else None
    monitor = ExitMonitor(exit_interval=rc.exit.exit_interval, exit_duration_in_mins=rc.exit.exit_duration_in_mins,
                          kill_switch_path=rc.exit.kill_switch_path, start_time=start)
    trainer = Trainer(rc, engine, lr_scheduler=lr_scheduler,
                      microbatches=build_num_microbatches_calculator(rc.batch, state.dp_size),
                      train_iterator=train_iter, valid_iterators=valid_iters, logger=logger, exit_monitor=monitor,
                      progress=progress, save_fn=save if rc.checkpoint.save else None, sync_fn=sync,
                      world_size=dist.get_world_size())
    lock = _lock_save_folder(rc)  # one writer per --save folder (megatron.checkpoint.lock)
    print_rank_0(f"setup done in {time.time() - start:.1f} s ({info.launcher} launch, {dist.get_world_size()} ranks, "
                 f"TP={state.tp_size}{' (sequence parallel)' if rc.model.sequence_parallel else ''} "
                 f"PP={state.pp_size} DP={state.dp_size}"
                 + (f" SP={state.sp_size} (DeepSpeed-Ulysses)" if state.sp_size > 1 else "")
                 + f", {_sharding_summary(rc)}); training")
    try:
        reason = trainer.train()
        test = {}
        if not reason:
            test_iters = {name: micro_batch_iterator(ds, rc, consumed_samples=0,
                                                     num_workers=rc.data.valid_num_workers, **dp)
                          for name, ds in datasets.test.items()}
            if t.eval_iters and test_iters:
                test = trainer.evaluate(test_iters, test=True)
        else:
            print_rank_0(f"exiting after iteration {progress.iteration}: {reason}")
    finally:
        if lock is not None:
            lock.release()
        monitor.restore_signal_handlers()
        if writer is not None:
            writer.close()
    return PretrainResult(reason, progress, trainer.history, trainer.last_validation, test, engine)


def _sharding_summary(rc: RunConfig) -> str:
    stage, dp = rc.deepspeed_zero_stage, rc.parallel.data_parallel_size
    sharded = {0: "nothing sharded", 1: "optimizer state", 2: "optimizer state and gradients",
               3: "optimizer state, gradients and parameters"}[stage]
    hpz, sp = rc.parallel.zero_hpz_partition_size, rc.parallel.ds_sequence_parallel_size
    secondary = f", a secondary parameter shard in {dp * sp // hpz} groups of {hpz} (hpZ)" if hpz > 1 else ""
    over = f" over DP={dp}" if sp == 1 else f" over DP x SP={dp * sp}"
    return f"ZeRO-{stage}: {sharded}" + (over if stage else "") + secondary


def _lock_save_folder(rc: RunConfig):
    """Rank 0 takes the --save folder's lock; every rank raises the same ValueError if another run holds it."""
    if not rc.checkpoint.save:
        return None
    lock, problem = None, ""
    if dist.get_rank() == 0:
        try:
            lock = save_lock.acquire(rc.checkpoint.save)
        except ValueError as error:
            problem = str(error)
    refused = torch.tensor([1 if problem else 0])
    dist.all_reduce(refused)
    if refused.item():
        raise ValueError(problem or f"--save {rc.checkpoint.save} is in use by another run (rank 0 names it)")
    return lock


def resume_point(rc: RunConfig, tag: Optional[str] = None) -> Optional[tuple[str, dict]]:
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
    engine, wanted = run_state.universal_engine(saved), rc.deepspeed_engine
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
    sizes = {"--tensor-model-parallel-size": (recorded.get("tensor_model_parallel_size"), p.tensor_model_parallel_size),
             "--pipeline-model-parallel-size": (recorded.get("pipeline_model_parallel_size"),
                                                p.pipeline_model_parallel_size)}
    if not (ck.no_load_optim or ck.finetune):
        sizes["data-parallel size"] = (recorded.get("data_parallel_size"), p.data_parallel_size)
        # ZeRO shards the optimizer state over dp x sp ranks
        sizes["--ds-sequence-parallel-size"] = (recorded.get("ds_sequence_parallel_size", 1),
                                                p.ds_sequence_parallel_size)
    saved_stage = recorded.get("zero_stage")
    if saved_stage is not None and saved_stage != rc.deepspeed_zero_stage and max(saved_stage, rc.deepspeed_zero_stage) >= 2:
        # ZeRO-2 and ZeRO-3 write DeepSpeed's non-pipeline engine's files, each its own way
        sizes["ZeRO stage"] = (saved_stage, rc.deepspeed_zero_stage)
    # Each engine writes its own files (megatron.checkpoint.run_state.WEIGHT_FILE_KINDS), whatever the sizes.
    sizes["DeepSpeed engine"] = (run_state.saving_engine(saved), rc.deepspeed_engine)
    differ = {name: pair for name, pair in sizes.items() if pair[0] is not None and pair[0] != pair[1]}
    if differ:
        said = ", ".join(f"{name} {then} (this run: {now})" for name, (then, now) in differ.items())
        target = f" --target-engine {rc.deepspeed_engine}" if "DeepSpeed engine" in differ else ""
        raise ValueError(f"{tag_dir} was saved with {said}; a regular checkpoint loads only on its own layout. "
                         f"Convert it once: python tools/convert_checkpoint/ds_to_universal.py --input_folder "
                         f"{tag_dir} --output_folder {tag_dir}_universal{target}, then add --universal-checkpoint "
                         f"(or run with the checkpoint's sizes)")


def intact_resume_point(rc: RunConfig, point: Optional[tuple[str, dict]]) -> Optional[tuple[str, dict]]:
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


def _mend_universal_optimizer(optimizer, own_groups: list[dict]) -> None:
    """Undo two things DeepSpeed 0.19.8's universal loaders get wrong with more than one parameter group:
    ZeRO-3's gives every group the first group's hyperparameters (weight decay on the biases and norms),
    and hands every group one and the same step tensor, which Adam then counts up once per group per
    step. The groups keep this run's hyperparameters (the learning rate is the scheduler's) and a step each."""
    for group, own in zip(optimizer.param_groups, own_groups, strict=True):
        group.update(own)
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside DeepSpeed's ZeRO wrapper
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def _resume(rc: RunConfig, engine, lr_scheduler, tracker, point: Optional[tuple[str, dict]]) -> Progress:
    ck = rc.checkpoint
    if point is None:
        if ck.load:
            print_rank_0(f"no checkpoint in {ck.load} yet: starting from scratch")
        return Progress()
    tag, _ = point
    # DeepSpeed's universal loaders set every parameter group's hyperparameters from the checkpoint's (ZeRO-3
    # all from its first group); this run's flags say them (the learning rate is the scheduler's)
    own_groups = [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups]
    # DeepSpeed's universal-checkpoint loader reads its files with its own torch.load(weights_only=False),
    # past the safe checkpoint engine: within this, every torch.load of the process is the safe one.
    # ZeRO-3 at TP > 1 (megatron.engine.sharded) has its loader cut the universal tensors to TP slices
    tp_restore = getattr(engine, "universal_tp_restore", None) if ck.universal_checkpoint else None
    with only_safe_loading(DEEPSPEED_GLOBALS), (tp_restore() if tp_restore else contextlib.nullcontext()):
        client = training_io.load_checkpoint(engine, ck.load, tag,
                                             load_optimizer_states=not (ck.no_load_optim or ck.finetune))
    if ck.universal_checkpoint:
        _mend_universal_optimizer(engine.optimizer, own_groups)
    check_finite_after_load(engine, rc.model, os.path.join(ck.load, tag))
    if ck.finetune:
        print_rank_0(f"loaded the weights of {os.path.join(ck.load, tag)} (--finetune: iteration 0, new schedule)")
        return Progress()
    progress = Progress(**client["progress"])
    lr_scheduler.load_state_dict(client["lr_scheduler"])
    if not ck.no_load_rng:
        training_io.set_rng_state(client["rng"], tracker)
    print_rank_0(f"resumed from {os.path.join(ck.load, tag)} at iteration {progress.iteration} "
                 f"({progress.consumed_samples} samples consumed)")
    return progress
