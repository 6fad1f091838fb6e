"""``pretrain(run_config)``: everything between the parsed flags and the trained model.

1. join the process group (torchrun, the DeepSpeed launcher or srun) and build ``ParallelState``;
2. seed python / numpy / torch (+100 per pipeline stage, as Megatron) and the TP RNG tracker;
3. build the datasets and this rank's iterators (data-parallel slice, from the consumed samples);
4. build the DeepSpeed pipeline engine from the DeepSpeed config the flags give;
5. resume from ``--load`` if it holds a checkpoint; 6. train; 7. test; save on the way out.

Before anything reads --load or --save, rank 0 takes the --save folder's lock (megatron.checkpoint.lock).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from megatron.checkpoint import lock as save_lock
from megatron.checkpoint import run_state, training_io
from megatron.checkpoint.async_save import AsyncSaver
from megatron.checkpoint.resume import intact_resume_point, restore, resume_point
from megatron.checkpoint.universal.patterns import UNIVERSAL_CHECKPOINT_INFO, universal_checkpoint_info
from megatron.config import RunConfig, parallel_dims
from megatron.config.hardware import check_fp8_device
from megatron.config.moe import routes_tp_shards
from megatron.data.tokenizers import build_tokenizer
from megatron.engine.deepspeed_compat import checkpoint_loading
from megatron.engine.initialize import build_engine, init_deepspeed_comm
from megatron.engine.load_checks import check_finite_after_load
from megatron.engine.optimizer import sync_tp_duplicated
from megatron.model.moe import update_expert_biases
from megatron.model.moe.stats import iteration_stats as moe_iteration_stats
from megatron.model.mtp import iteration_losses as mtp_iteration_losses
from megatron.parallel.fp8_linear import update_fp8_scales
from megatron.parallel.random import RNGStatesTracker, model_parallel_rng_seed
from megatron.parallel.state import ParallelState, collective_device
from megatron.training.batches import context_slice, gpt_micro_batch, sequence_slice
from megatron.training.data_iterators import build_datasets, close_data_iterators, micro_batch_iterator
from megatron.training.distributed import init_process_group
from megatron.training.exit import ExitMonitor
from megatron.training.log_writers import check_wandb_installed, open_writers, wandb_enabled
from megatron.training.loop import Progress, Trainer
from megatron.training.lr_schedule import LRScheduler
from megatron.training.metrics import TrainingLogger
from megatron.training.microbatches import build_num_microbatches_calculator
from megatron.training.profiling import check_profiler_device
from megatron.training.restarts import RestartTracker
from megatron.training.token_count import StepTokenCount


@dataclasses.dataclass
class PretrainResult:
    exit_reason: str           # '' (schedule finished), 'signal', 'kill-switch', 'exit-duration', 'exit-interval'
    progress: Progress
    history: list              # IterationRecord per iteration run in this process
    valid: dict[str, float]    # the last validation losses, by group name ('' for the --split validation set)
    test: dict[str, float]     # the test losses at the end of the schedule
    engine: object = None      # the DeepSpeed engine (for inspection by tests and tools)


def on_every_rank(error: Exception) -> Exception:
    """Mark ``error`` as one every rank raises alike (pretrain_gpt.py then prints it once, from rank 0)."""
    error.on_every_rank = True
    return error


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


def _training_logger(rc: RunConfig):
    """(the writer or None, the TrainingLogger): the last rank logs, as Megatron's does, to TensorBoard and W&B
    (megatron.training.log_writers). Collective: where the last rank cannot open its writers, every rank raises."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_last_rank = rank == world_size - 1
    writer, problem = None, ""
    if is_last_rank:
        try:
            writer = open_writers(rc.logging, rc.checkpoint.save, config=_wandb_config(rc))
        except (ValueError, OSError) as error:
            problem = str(error)
    if (rc.logging.tensorboard_dir or wandb_enabled(rc.logging)) and _any_rank(bool(problem)):
        if world_size == 1:
            raise on_every_rank(ValueError(problem))
        if is_last_rank:
            raise ValueError(problem)  # printed by this rank, with its rank
        raise on_every_rank(ValueError(f"the last rank ({world_size - 1}) could not open its TensorBoard / W&B "
                                       f"writers (its error is printed beside this one)"))
    return writer, TrainingLogger(writer, log_timers=rc.logging.log_timers_to_tensorboard,
                                  log_batch_size=rc.logging.log_batch_size_to_tensorboard,
                                  log_validation_ppl=rc.logging.log_validation_ppl_to_tensorboard,
                                  log_throughput=rc.logging.log_throughput,
                                  print_fn=print if is_last_rank else (lambda *a, **k: None))


def _wandb_config(rc: RunConfig) -> dict:
    """W&B's config: the run's flags under Megatron's names (Megatron's ``args``, as its ``config=vars(args)``),
    without the progress counters, not known before a resume."""
    config = vars(run_state.megatron_args(rc, dataclasses.asdict(Progress())))
    for key in ("iteration", "consumed_train_samples", "consumed_train_tokens"):
        config.pop(key)
    return config


def _any_rank(flag: bool) -> bool:
    """Collective: whether ``flag`` is set on any rank (a device tensor under NCCL, which has no CPU collectives)."""
    flags = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(flags)
    return bool(flags.item())


def _client_state(rc: RunConfig, progress: Progress, lr_scheduler, tracker) -> dict:
    """Saved by DeepSpeed with the weights (in mp_rank_XX_model_states.pt): what a resume restores, and
    Megatron's own top-level keys ('args', 'checkpoint_version'; 'iteration' is added by the writer)."""
    counters = dataclasses.asdict(progress)
    state = {"progress": counters, "lr_scheduler": lr_scheduler.state_dict(), "rng": training_io.rng_state(tracker),
             "args": run_state.megatron_args(rc, counters), "checkpoint_version": run_state.MEGATRON_CHECKPOINT_VERSION}
    state[UNIVERSAL_CHECKPOINT_INFO] = universal_checkpoint_info(rc.model, rc.deepspeed_engine)
    return state


def pretrain(rc: RunConfig) -> PretrainResult:
    """Train as ``rc`` says (the module docstring's steps). Collective: every rank calls it. A refusal (another
    run holds --save, a --load checkpoint that cannot be resumed) is the same ValueError on every rank."""
    start = time.time()
    check_profiler_device(rc.logging)
    check_wandb_installed(rc.logging)
    p = rc.parallel
    info = init_process_group(p.distributed_backend, p.distributed_timeout_minutes)
    if rc.model.fp8 is not None:  # FP8 GEMMs on this device: CUDA capability 8.9+, or torch._scaled_mm on CPU
        check_fp8_device()
    init_deepspeed_comm(p.distributed_backend, timeout_s=60.0 * p.distributed_timeout_minutes)
    # The --save lock comes first: a second run on the same folder must not read the first one's checkpoints.
    lock = _lock_save_folder(rc)  # one writer per --save folder (megatron.checkpoint.lock)
    try:
        return _pretrain_locked(rc, start, info)
    finally:
        if lock is not None:
            lock.release()


def _pretrain_locked(rc: RunConfig, start: float, info) -> PretrainResult:
    try:
        point = resume_point(rc)  # file reads only: every rank finds the same, and refuses alike
        point = intact_resume_point(rc, point)  # every file against its checksum, the hashing shared out
    except ValueError as error:
        raise on_every_rank(error)
    # Before the engine is built (minutes for a large model): a W&B login or a tensorboard folder that fails stops
    # the run at once, as Megatron opens its writers before building the model.
    writer, logger = _training_logger(rc)
    try:
        return _build_and_train(rc, start, info, point, logger)
    finally:
        if writer is not None:
            writer.close()


def _build_and_train(rc: RunConfig, start: float, info, point, logger: TrainingLogger) -> PretrainResult:
    p = rc.parallel
    state = ParallelState.create(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                 sp=p.ds_sequence_parallel_size, ep=p.expert_model_parallel_size,
                                 cp=p.context_parallel_size, etp=p.expert_tp, moe_tp_shards=routes_tp_shards(rc))
    tracker = set_seeds(rc.training.seed, state)

    datasets = build_datasets(rc)
    engine = build_engine(rc, state, tracker=tracker)
    t = rc.training
    lr_scheduler = LRScheduler.from_run_config(engine.optimizer, rc)
    progress = Progress(**restore(rc, engine, point, lr_scheduler, tracker,
                                  loading=lambda: checkpoint_loading(engine, rc.checkpoint.universal_checkpoint),
                                  after_load=lambda where: check_finite_after_load(engine, rc.model, where)))

    restarts = RestartTracker.from_launch(rc.checkpoint.save)  # the job's progress, kept across its restarts
    restart = restarts.resumed(progress.iteration) if restarts is not None else None
    if restart is not None:
        logger.print_fn(restart.message(), flush=True)
        logger.write_scalars(restart.scalars(), progress.iteration)

    dp = dict(dp_rank=state.dp_rank, dp_size=state.dp_size, sp_rank=state.sp_rank, sp_size=state.sp_size,
              cp_rank=state.cp_rank, cp_size=state.cp_size)
    train_iter = micro_batch_iterator(datasets.train, rc, consumed_samples=progress.consumed_samples,
                                      num_workers=rc.data.num_workers, **dp)
    valid_iters = {name: micro_batch_iterator(ds, rc, consumed_samples=0, num_workers=rc.data.valid_num_workers,
                                              **dp) for name, ds in datasets.valid.items()}

    saver = AsyncSaver(engine) if rc.checkpoint.async_save else None  # --async-save: a writer thread per rank
    save_with = saver.save if saver is not None else functools.partial(training_io.save_checkpoint, engine)

    def save(progress_now: Progress) -> None:
        tag = save_with(rc.checkpoint.save, progress_now.iteration,
                        _client_state(rc, progress_now, lr_scheduler, tracker),
                        run_state.build_run_state(rc, dataclasses.asdict(progress_now)),
                        rc.checkpoint.keep_last_n_checkpoints)
        where = os.path.join(rc.checkpoint.save, tag)
        print_rank_0(f"saved checkpoint {where}" if saver is None else f"saving checkpoint {where} in the background")

    def saved(tag) -> None:  # --async-save: a background save finished (complete, 'latest' names it)
        if tag is not None:
            print_rank_0(f"saved checkpoint {os.path.join(rc.checkpoint.save, tag)}")

    def after_step() -> None:
        if t.sync_tp_duplicated_parameters:
            sync_tp_duplicated(engine.module, state.tp_group)
        if rc.model.moe is not None:  # MoE routers' biases: counts summed over every DP and sequence (CP, SP) rank
            update_expert_biases(engine.module, state.routing_data_group)  # (and TP rank, with etp < tp)
        if rc.model.fp8 is not None:  # delayed scaling: the iteration's amaxes over the ranks of this stage
            update_fp8_scales(engine.module, (state.tp_group, state.sp_data_group))

    monitor = ExitMonitor(exit_interval=rc.exit.exit_interval, exit_duration_in_mins=rc.exit.exit_duration_in_mins,
                          kill_switch_path=rc.exit.kill_switch_path, start_time=start)
    trainer = Trainer(rc, engine, lr_scheduler=lr_scheduler,
                      microbatches=build_num_microbatches_calculator(rc.batch, state.dp_size),
                      train_iterator=train_iter, valid_iterators=valid_iters, logger=logger, exit_monitor=monitor,
                      progress=progress, save_fn=save if rc.checkpoint.save else None, sync_fn=after_step,
                      save_poll_fn=(lambda: saved(saver.poll())) if saver is not None else None,
                      save_wait_fn=(lambda: saved(saver.wait())) if saver is not None else None,
                      world_size=dist.get_world_size(), harness_fn=_live_harness(rc, engine, state),
                      token_count=StepTokenCount(engine.module.loss_fn, state.dp_group, state.dp_size)
                      if rc.counts_step_tokens else None,
                      moe_stats_fn=_iteration_stats_fn(rc, engine, state),
                      reached_fn=restarts.reached if restarts is not None else None)
    print_rank_0(f"setup done in {time.time() - start:.1f} s ({info.launcher} launch, {dist.get_world_size()} ranks, "
                 f"TP={state.tp_size}{' (sequence parallel)' if rc.model.sequence_parallel else ''} "
                 f"PP={state.pp_size} DP={state.dp_size}"
                 + (f" SP={state.sp_size} (DeepSpeed-Ulysses)" if state.sp_size > 1 else "")
                 + (f" CP={state.cp_size} (ring attention)" if state.cp_size > 1 else "")
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
        monitor.restore_signal_handlers()
        close_data_iterators()
        if saver is not None:  # a run that ends on an error: no thread of it writes into --save once it has left
            saver.abandon()
    return PretrainResult(reason, progress, trainer.history, trainer.last_validation, test, engine)


def _iteration_stats_fn(rc: RunConfig, engine, state: ParallelState):
    """The collective the trainer calls after each trained iteration for the log and tensorboard: the MoE layers'
    statistics (megatron.model.moe.stats) and the MTP depths' losses (megatron.model.mtp); None with neither."""
    model = rc.model
    if model.moe is None and not model.mtp_num_layers:
        return None

    def stats() -> dict[str, float]:
        out = {}
        if model.moe is not None:
            out.update(moe_iteration_stats(engine.module, model.moe, model.total_layers, state.routing_data_group,
                                           state.pp_group))
        if model.mtp_num_layers:
            # over dp x cp: a CP rank's depth loss is its part times cp (GPTLossFn), their mean the whole one
            out.update(mtp_iteration_losses(engine.module, model.mtp_num_layers, state.sp_data_group, state.pp_group))
        return out

    return stats


def _live_harness(rc: RunConfig, engine, state: ParallelState):
    """--eval-harness-tasks on the live model (megatron.evaluation.live), or None; its tasks are looked up here,
    so that a bad task name or file stops the run before its first step."""
    t = rc.training
    if not t.eval_harness_tasks:
        return None
    from megatron.evaluation.live import LiveHarness  # noqa: PLC0415 (lm_eval, seconds to import: only when asked for)

    # --reset-attention-mask: the harness's batches carry document ids too (one document a row), so that the
    # pipeline stages exchange the (hidden, ids) activations whose shapes DeepSpeed's engine recorded in training
    make_batch = functools.partial(_harness_batch, documents=rc.data.reset_attention_mask, sp_rank=state.sp_rank,
                                   sp_size=state.sp_size, cp_rank=state.cp_rank, cp_size=state.cp_size)
    return LiveHarness(engine, build_tokenizer(rc.data.tokenizer), rc.model, tasks=t.eval_harness_tasks,
                       include_path=t.eval_harness_include_path, limit=t.eval_harness_limit,
                       micro_batch_size=rc.batch.micro_batch_size, tp_group=state.tp_group, make_batch=make_batch,
                       seed=t.seed, cp_group=state.cp_group, sp_group=state.sp_group,
                       model_engine=rc.on_model_engine)


def _harness_batch(tokens: torch.Tensor, *, documents: bool, sp_rank: int, sp_size: int, cp_rank: int,
                   cp_size: int):
    """``gpt_micro_batch(tokens)`` (with ``documents``, document ids 0 for every token: each row of the harness is
    one request), this rank's tokens of it as training lays them out (``MicroBatchIterator``): Ulysses' contiguous
    s / sp, context parallelism's load-balanced s / cp."""
    (input_ids, position_ids), labels = gpt_micro_batch(tokens)
    inputs = (input_ids, position_ids, torch.zeros_like(input_ids)) if documents else (input_ids, position_ids)
    return context_slice(sequence_slice((inputs, labels), sp_rank, sp_size), cp_rank, cp_size)


def _sharding_summary(rc: RunConfig) -> str:
    stage = rc.deepspeed_zero_stage
    sharded = {0: "nothing sharded", 1: "optimizer state", 2: "optimizer state and gradients",
               3: "optimizer state, gradients and parameters"}[stage]
    # ZeRO shards over the ranks holding the same weights: DP, and Ulysses' or CP's ranks
    hpz, sizes = rc.parallel.zero_hpz_partition_size, rc.parallel.sizes()
    shards = parallel_dims.zero_shards(sizes)
    secondary = f", a secondary parameter shard in {shards // hpz} groups of {hpz} (hpZ)" if hpz > 1 else ""
    names = [d.name.upper() for d in parallel_dims.ZERO_SHARDED if d.name == "dp" or sizes[d.name] > 1]
    over = f" over {' x '.join(names)}={shards}"
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
    if _any_rank(bool(problem)):
        raise on_every_rank(ValueError(problem or f"--save {rc.checkpoint.save} is in use by another run (rank 0 "
                                                  f"names it)"))
    return lock
