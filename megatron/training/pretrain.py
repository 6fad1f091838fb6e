"""``pretrain(run_config)``: everything between the parsed flags and the trained model.

1. join the process group (torchrun, the DeepSpeed launcher or srun) and build ``ParallelState``;
2. seed python / numpy / torch (+100 per pipeline stage, as Megatron) and the TP RNG tracker;
3. build the datasets and this rank's iterators (data-parallel slice, from the consumed samples);
4. build the DeepSpeed pipeline engine from the DeepSpeed config the flags give;
5. resume from ``--load`` if it holds a checkpoint; 6. train; 7. test; save on the way out.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import numpy as np
import torch.distributed as dist

from megatron.checkpoint import run_state, tags, training_io
from megatron.config import RunConfig
from megatron.model.layout import LAYOUT
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
    """Megatron's seeding: one seed per pipeline stage, equal across TP and DP ranks; TP-distinct tracker."""
    stage_seed = seed + 100 * state.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    return model_parallel_rng_seed(stage_seed, state.tp_rank, RNGStatesTracker())


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
            UNIVERSAL_CHECKPOINT_INFO: universal_checkpoint_info(rc.model),
            "args": run_state.megatron_args(rc, counters), "checkpoint_version": run_state.MEGATRON_CHECKPOINT_VERSION}


def pretrain(rc: RunConfig) -> PretrainResult:
    start = time.time()
    p = rc.parallel
    info = init_process_group(p.distributed_backend, p.distributed_timeout_minutes)
    init_deepspeed_comm(p.distributed_backend, timeout_s=60.0 * p.distributed_timeout_minutes)
    state = ParallelState.create(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    tracker = set_seeds(rc.training.seed, state)

    datasets = build_datasets(rc)
    engine = build_engine(rc, state, tracker=tracker)
    t = rc.training
    lr_scheduler = LRScheduler.from_run_config(engine.optimizer, rc)
    progress = _resume(rc, engine, lr_scheduler, tracker)

    dp = dict(dp_rank=state.dp_rank, dp_size=state.dp_size)
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
    print_rank_0(f"setup done in {time.time() - start:.1f} s ({info.launcher} launch, {dist.get_world_size()} ranks, "
                 f"TP={state.tp_size} PP={state.pp_size} DP={state.dp_size}); training")
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
        monitor.restore_signal_handlers()
        if writer is not None:
            writer.close()
    return PretrainResult(reason, progress, trainer.history, trainer.last_validation, test, engine)


def _resume(rc: RunConfig, engine, lr_scheduler, tracker) -> Progress:
    ck = rc.checkpoint
    if not ck.load:
        return Progress()
    tag = tags.resolve_tag(ck.load, universal=ck.universal_checkpoint)
    if tag is None:
        print_rank_0(f"no checkpoint in {ck.load} yet: starting from scratch")
        return Progress()
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
    client = training_io.load_checkpoint(engine, ck.load, tag, load_optimizer_states=not (ck.no_load_optim or ck.finetune))
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
