"""The run's remaining settings (parallel layout, optimizer, schedule, batch, precision, loop,
logging, checkpoints, exits) and RunConfig, which groups them all and checks them together."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from megatron.config import parallel_dims
from megatron.config._checks import _one_of, _positive
from megatron.config.combinations import check_combinations
from megatron.config.context_parallel import check_context_parallel_run
from megatron.config.data import DataConfig, DatasetGroup, DatasetSplit  # noqa: F401 (RunConfig fields)
from megatron.config.model import ModelConfig
from megatron.config.moe import check_moe_run
from megatron.config.optimizer import LR_DECAY_STYLES, OPTIMIZERS, LRScheduleConfig, OptimizerConfig  # noqa: F401
from megatron.config.pipeline_layout import LAYOUT_FIELDS, LAYOUT_FLAGS, StageContents, stage_contents
from megatron.config.pipeline_schedule import check_interleaved_run
from megatron.config.zero_bubble import check_zero_bubble_run

PARTITION_METHODS = ("type:transformer", "type:transformer|embedding", "parameters", "uniform")
DISTRIBUTED_BACKENDS = ("nccl", "gloo", "ccl")
CP_COMM_TYPES = ("p2p",)  # Megatron-LM's --cp-comm-type values implemented here (all_gather, a2a, a2a+p2p are not)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the world's processes are laid out: world = TP x PP x DP x SP x CP (megatron.parallel.state's order)."""

    tensor_model_parallel_size: int = 1    # ranks that split each layer's matrices (whole heads each)
    pipeline_model_parallel_size: int = 1  # pipeline stages; each holds a contiguous run of layers
    data_parallel_size: int = 1            # derived: world_size // (TP * PP * SP), never given directly
    ds_sequence_parallel_size: int = 1     # DeepSpeed-Ulysses: ranks that split each sample's sequence (an
                                           # all-to-all around the core attention); 1: off
    pp_partition_method: str = "type:transformer"  # DeepSpeed PipelineModule partition_method, one of PARTITION_METHODS
    distributed_backend: str = "gloo"      # torch.distributed backend: nccl | gloo | ccl
    distributed_timeout_minutes: float = 10.0  # a collective waiting longer fails the job (every group)
    zero_hpz_partition_size: int = 1       # ZeRO-3 only: a secondary copy of the parameters sharded within
                                           # groups of this many data-parallel ranks (ZeRO++ hpZ); 1: none
    sequence_parallel: bool = False        # --sequence-parallel as asked; the model runs it only with TP > 1
                                           # (ModelConfig.sequence_parallel is what the modules read)
    expert_model_parallel_size: int = 1    # MoE: ranks sharing out each layer's experts, carved from DP
    expert_tensor_parallel_size: Optional[int] = None  # MoE: ranks splitting each expert (None: TP); 1 < TP: EP
                                           # folds over the stage's TP x DP ranks (megatron.parallel.state)
    enable_zbh1_pipeline: bool = False     # ZB-H1 pipeline schedule: weight gradients deferred into the bubble
    enable_zbh1_exact_semantics: bool = False  # ZB-H1: optimizer step only after every deferred weight gradient
    context_parallel_size: int = 1         # ring attention: ranks holding 1/cp of each sample's tokens (chunks i
                                           # and 2cp-1-i); gradients reduced over DP x CP; 1: off
    cp_comm_type: str = "p2p"              # how the key / value blocks travel: p2p (a ring), one of CP_COMM_TYPES
    num_virtual_stages_per_pipeline_rank: int = 1  # interleaved 1F1B: chunks of layers per pipeline rank; 1: off
    # Megatron-LM's pipeline layout flags (megatron.config.pipeline_layout); all unset: --pp-partition-method splits
    pipeline_model_parallel_layout: Optional[str] = None   # every virtual stage's layers, e.g. "Et|(tt|)*30mL"
    decoder_first_pipeline_num_layers: Optional[int] = None  # the first pipeline rank's transformer layers
    decoder_last_pipeline_num_layers: Optional[int] = None   # the last pipeline rank's
    account_for_embedding_in_pipeline_split: bool = False  # the embedding weighs as a layer in the even split
    account_for_loss_in_pipeline_split: bool = False       # the loss (final norm and head) weighs as one

    def stage_contents(self, num_layers: int, mtp_num_layers: int = 0) -> Optional[tuple[StageContents, ...]]:
        """Each virtual stage's layers under the layout flags (``megatron.config.pipeline_layout.stage_contents``);
        None without them (``pp_partition_method`` splits)."""
        return stage_contents(num_layers, self.pipeline_model_parallel_size, self.num_virtual_stages_per_pipeline_rank,
                              layout=self.pipeline_model_parallel_layout, first=self.decoder_first_pipeline_num_layers,
                              last=self.decoder_last_pipeline_num_layers,
                              account_for_embedding=self.account_for_embedding_in_pipeline_split,
                              account_for_loss=self.account_for_loss_in_pipeline_split, mtp_num_layers=mtp_num_layers)

    def sizes(self) -> dict[str, int]:
        """Every parallel dimension's size by its short name (``megatron.config.parallel_dims``: tp, pp, dp, ...)."""
        return {d.name: getattr(self, d.field) for d in parallel_dims.DIMENSIONS}

    @property
    def world_size(self) -> int:
        return parallel_dims.world_size(self.sizes())

    @property
    def expert_tp(self) -> int:
        """The ranks each expert's matrices are split over: --expert-tensor-parallel-size, TP by default."""
        if self.expert_tensor_parallel_size is None:
            return self.tensor_model_parallel_size
        return self.expert_tensor_parallel_size

    def validate(self) -> "ParallelConfig":
        for d in parallel_dims.DIMENSIONS:
            _positive(d.named, getattr(self, d.field))
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type {self.cp_comm_type!r} is not implemented; use one of "
                             f"{', '.join(CP_COMM_TYPES)}")
        _one_of("--pp-partition-method", self.pp_partition_method, PARTITION_METHODS)
        _positive("--zero-hpz-partition-size", self.zero_hpz_partition_size)
        # ZeRO shards over the ranks that hold the same weights: data-parallel, and Ulysses' or CP's ranks too
        sizes = self.sizes()
        shards = parallel_dims.zero_shards(sizes)
        if shards % self.zero_hpz_partition_size:
            dims = [d for d in parallel_dims.ZERO_SHARDED if d.name == "dp" or sizes[d.name] > 1]
            values = " x ".join(str(sizes[d.name]) for d in dims)
            over = f"{parallel_dims.joint_label(dims)} {shards if len(dims) == 1 else f'{values} = {shards}'}"
            raise ValueError(f"--zero-hpz-partition-size {self.zero_hpz_partition_size} does not divide the {over}; "
                             f"use a divisor of it (e.g. the GPUs per node divided by --tensor-model-parallel-size)")
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(f"--distributed-timeout-minutes must be positive, got {self.distributed_timeout_minutes}")
        _one_of("--distributed-backend", self.distributed_backend, DISTRIBUTED_BACKENDS)
        return self


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """Batch sizes in samples (sequences). global = micro x DP x number of micro-batches."""

    micro_batch_size: int = 1              # sequences per rank per forward/backward
    global_batch_size: int = 1             # sequences per optimizer step (after any rampup)
    rampup_batch_size: Optional[tuple[int, int, int]] = None  # (start, increment, ramp samples): Megatron's rampup

    def num_micro_batches(self, data_parallel_size: int) -> int:
        """Micro-batches per step at the full global batch size."""
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)

    def validate(self, data_parallel_size: int = 1) -> "BatchConfig":
        _positive("--micro-batch-size", self.micro_batch_size)
        _positive("--global-batch-size", self.global_batch_size)
        unit = self.micro_batch_size * data_parallel_size
        if self.global_batch_size % unit:
            raise ValueError(f"--global-batch-size {self.global_batch_size} is not a multiple of --micro-batch-size "
                             f"{self.micro_batch_size} x data-parallel size {data_parallel_size} = {unit}; "
                             f"use a multiple of {unit}")
        if self.rampup_batch_size is not None:
            check_rampup_batch_size(self.rampup_batch_size, self.global_batch_size, self.micro_batch_size,
                                    data_parallel_size)
        return self


def check_rampup_batch_size(rampup: tuple[int, int, int], global_batch_size: int, micro_batch_size: int,
                            data_parallel_size: int) -> None:
    """Megatron's rampup rules: every batch size on the way, start included, is a multiple of micro x DP."""
    if len(rampup) != 3:
        raise ValueError(f"--rampup-batch-size takes 3 values (START INCREMENT RAMPUP_SAMPLES), got {rampup!r}")
    start, increment, ramp_samples = rampup
    unit = micro_batch_size * data_parallel_size
    if start < 1 or increment < 1 or ramp_samples < 0:
        raise ValueError(f"--rampup-batch-size {start} {increment} {ramp_samples}: START and INCREMENT must be "
                         f"positive and RAMPUP_SAMPLES >= 0")
    if start >= global_batch_size:
        raise ValueError(f"--rampup-batch-size start {start} must be smaller than --global-batch-size "
                         f"{global_batch_size}; drop --rampup-batch-size for a constant batch size")
    for name, value in (("start", start), ("increment", increment)):
        if value % unit:
            raise ValueError(f"--rampup-batch-size {name} {value} is not a multiple of --micro-batch-size "
                             f"{micro_batch_size} x data-parallel size {data_parallel_size} = {unit}: the "
                             f"batch sizes during rampup could not be split into micro-batches")
    if (global_batch_size - start) % increment:
        raise ValueError(f"--global-batch-size {global_batch_size} minus the rampup start {start} = "
                         f"{global_batch_size - start} is not a multiple of the increment {increment}")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """fp16 loss scaling and the ZeRO stage of DeepSpeed's optimizer wrapper.

    The dtype itself is ``ModelConfig.params_dtype`` (from --bf16 / --fp16), its only home;
    ``RunConfig.bf16`` / ``RunConfig.fp16`` read it.
    """

    loss_scale: Optional[float] = None     # fp16 static loss scale; None (or 0): dynamic scaling
    # fp16 dynamic scaling; None: the DeepSpeed JSON's value, else DeepSpeed's defaults below
    initial_loss_scale: Optional[float] = None  # starting scale, a power of 2 (default 2**16)
    min_loss_scale: Optional[float] = None      # floor (default 1)
    loss_scale_window: Optional[int] = None     # steps without overflow before the scale doubles (default 1000)
    hysteresis: Optional[int] = None            # overflows tolerated before the scale halves (default 2)
    grad_reduce_in_bf16: bool = False      # Megatron-LM's flag: DeepSpeed's communication_data_type "bf16", which
                                           # is also DeepSpeed's default for bf16 runs (megatron.config.deepspeed)
    zero_stage: int = 1                    # the ZeRO stage asked for, 0-3 (2 and 3: one pipeline stage only, on
                                           # DeepSpeed's model engine, megatron.engine.model_engine);
                                           # the command line's default: the JSON's, else 1 with bf16, 0 otherwise.
                                           # What DeepSpeed runs: RunConfig.deepspeed_zero_stage

    def validate(self) -> "PrecisionConfig":
        if self.loss_scale is not None and self.loss_scale < 0:
            raise ValueError(f"--loss-scale must be >= 0 (0: dynamic), got {self.loss_scale}")
        if self.initial_loss_scale is not None:
            power = math.log2(self.initial_loss_scale) if self.initial_loss_scale > 0 else 0.5
            if power != int(power):
                raise ValueError(f"--initial-loss-scale {self.initial_loss_scale} must be a power of 2 "
                                 f"(DeepSpeed takes its exponent); e.g. {2 ** max(0, round(power))}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage {self.zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
        return self


def deepspeed_zero_stage(zero_stage: int, bf16: bool) -> int:
    """The ZeRO stage DeepSpeed is given for ``--zero-stage``: the same, except 1 for bf16 with 0.

    BLOOM-176B ran ``--bf16 --zero-stage 0`` (its JSON: "bf16 must use z0") on bigscience's DeepSpeed
    fork, whose BF16_Optimizer accumulated gradients in fp32 and sharded the fp32 master weights and
    Adam states over DP. The pinned DeepSpeed builds that optimizer from stage 1 + fp32 accumulation; its
    stage 0 with bf16 and fp32 accumulation is NotImplemented in ``deepspeed.initialize``
    (``megatron.engine.deepspeed_compat``: ``bf16_stage_0``, checked against the installed version).
    """
    return 1 if bf16 and zero_stage == 0 else zero_stage


def deepspeed_engine_for(zero_stage: int, ds_sequence_parallel_size: int) -> str:
    """The DeepSpeed engine a run of these sizes trains on: "model" (DeepSpeed's model engine) for ZeRO
    stage 2 or 3 (the pipeline engine refuses them) and for every DeepSpeed-Ulysses run (only that engine
    reduces gradients over the sequence-parallel ranks too), else "pipeline". ``RunConfig.deepspeed_engine``
    and, for records that predate it, ``megatron.checkpoint.run_state.reader_for`` ask this."""
    return "model" if zero_stage >= 2 or ds_sequence_parallel_size > 1 else "pipeline"


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """How long to train, when to evaluate, and per-step behaviour of the loop."""

    train_iters: Optional[int] = None      # iteration-based run length (exclusive with train_samples)
    train_samples: Optional[int] = None    # sample-based run length (needed for batch-size rampup)
    train_tokens: Optional[int] = None     # Megatron-DeepSpeed: also stop once this many tokens are consumed
    calculate_per_token_loss: bool = False  # Megatron-LM: a step's loss = its counted tokens' losses / their count
    eval_interval: int = 1000              # iterations between evaluations
    eval_iters: int = 100                  # iterations per evaluation (per validation group); 0 disables it
    skip_train_iteration_range: tuple[tuple[int, int], ...] = ()  # inclusive [start, end] ranges, merged, sorted
    seed: int = 1234                       # python / numpy / torch seeds (per rank offsets are the loop's business)
    checkpoint_activations: bool = False   # recompute each layer's activations in the backward pass
    checkpoint_num_layers: int = 1         # layers per checkpointed chunk
    deepspeed_activation_checkpointing: bool = False  # use DeepSpeed's checkpointing (only with checkpoint_activations)
    sync_tp_duplicated_parameters: bool = False  # average TP-replicated parameters (norms, biases) every step
    torch_compile: bool = False            # compile each transformer layer with torch.compile (megatron/model/compile.py)
    max_nonfinite_steps: Optional[int] = None    # stop after this many consecutive NaN/inf losses; None: see below
    check_for_nan_in_loss_and_grad: bool = True  # stop at the first NaN/inf loss or grad norm (megatron.training.guards)
    loss_spike_factor: float = 10.0        # report a loss above this many times its running mean; 0: never
    # lm-evaluation-harness tasks scored on the live model every eval_harness_interval iterations
    # (megatron/evaluation/live.py): names, a folder of task YAMLs, and documents per task (None: all)
    eval_harness_tasks: tuple[str, ...] = ()
    eval_harness_interval: Optional[int] = None
    eval_harness_include_path: Optional[str] = None
    eval_harness_limit: Optional[float] = None

    @property
    def sample_based(self) -> bool:
        return self.train_samples is not None

    def validate(self) -> "TrainingConfig":
        if (self.train_iters is None) == (self.train_samples is None):
            raise ValueError(f"give exactly one of --train-iters and --train-samples (got train_iters="
                             f"{self.train_iters}, train_samples={self.train_samples})")
        _positive("--train-iters", self.train_iters, allow_none=True)
        _positive("--train-samples", self.train_samples, allow_none=True)
        _positive("--eval-interval", self.eval_interval)
        if self.eval_iters < 0:
            raise ValueError(f"--eval-iters must be >= 0, got {self.eval_iters}")
        _positive("--checkpoint-num-layers", self.checkpoint_num_layers)
        _positive("--max-nonfinite-steps", self.max_nonfinite_steps, allow_none=True)
        if not self.loss_spike_factor >= 0:
            raise ValueError(f"--loss-spike-factor must be >= 0 (0 disables the report), got {self.loss_spike_factor}")
        for start, end in self.skip_train_iteration_range:
            if not 1 <= start <= end:
                raise ValueError(f"--skip-train-iteration-range {start}-{end}: need 1 <= START <= END")
        self._validate_eval_harness()
        return self

    def _validate_eval_harness(self) -> None:
        _positive("--eval-harness-interval", self.eval_harness_interval, allow_none=True)
        if bool(self.eval_harness_tasks) != (self.eval_harness_interval is not None):
            raise ValueError(f"--eval-harness-tasks {','.join(self.eval_harness_tasks) or '(none)'} and "
                             f"--eval-harness-interval {self.eval_harness_interval} go together: give both (tasks, "
                             f"and the iterations between their evaluations) or neither")
        if self.eval_harness_limit is not None and not self.eval_harness_limit > 0:
            raise ValueError(f"--eval-harness-limit must be > 0 (documents per task, or a fraction below 1), "
                             f"got {self.eval_harness_limit}")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """What is reported, how often, and where (stdout and TensorBoard)."""

    log_interval: int = 100                # iterations between log lines
    tensorboard_dir: Optional[str] = None  # None: no TensorBoard
    tensorboard_queue_size: int = 1000     # events queued before SummaryWriter flushes (its max_queue)
    tensorboard_log_interval: int = 1      # iterations between TensorBoard scalars
    log_timers_to_tensorboard: bool = False
    log_batch_size_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    peak_tflops: Optional[float] = None    # device peak TFLOP/s for utilization (MFU); None: the loop's own guess
    timing_log_level: int = 0              # 0: iteration time only; 1: per-step phases; 2: per-micro-batch ones too
    timing_log_option: str = "minmax"      # across ranks: 'max', 'minmax' or 'all' (every rank)
    log_memory_to_tensorboard: bool = False  # device (CUDA) or process (CPU RSS) memory, each log interval
    # A profiling window over iterations START+1 .. END (Megatron's counting): nsys ranges on CUDA, or
    # torch.profiler with use_pytorch_profiler, its trace written into tensorboard_dir.
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] = ()    # () profiles every rank
    use_pytorch_profiler: bool = False
    # Weights & Biases (Megatron-LM's flags), written by the rank that writes TensorBoard, the same scalars. No
    # project: no W&B. Offline (no network): WANDB_MODE=offline; `wandb sync DIR` uploads the run later.
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None   # the run's name; None: W&B names it
    wandb_save_dir: Optional[str] = None   # None: --save's wandb/ folder, else the working directory
    wandb_entity: Optional[str] = None     # the W&B user or team; None: the logged-in user's default
    # Megatron-LM's --log-throughput: per GPU, model TFLOP/s (its "throughput"), tokens/s and, where the device's
    # peak is known (or --peak-tflops), MFU: on the log line and to TensorBoard / W&B.
    log_throughput: bool = False
    # Megatron-LM's --log-straggler: every log interval, each rank's forward compute time per iteration gathered;
    # the --straggler-minmax-count fastest and slowest ranks named on the log line and to TensorBoard / W&B
    # (megatron.training.straggler).
    log_straggler: bool = False
    straggler_minmax_count: int = 1

    def validate(self) -> "LoggingConfig":
        _positive("--log-interval", self.log_interval)
        _positive("--straggler-minmax-count", self.straggler_minmax_count)
        _positive("--tensorboard-queue-size", self.tensorboard_queue_size)
        _positive("--tensorboard-log-interval", self.tensorboard_log_interval)
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"--peak-tflops must be positive, got {self.peak_tflops}")
        if self.timing_log_level not in (0, 1, 2):
            raise ValueError(f"--timing-log-level must be 0, 1 or 2, got {self.timing_log_level}")
        if self.timing_log_option not in ("max", "minmax", "all"):
            raise ValueError(f"--timing-log-option must be max, minmax or all, got {self.timing_log_option!r}")
        if self.log_memory_to_tensorboard and not self.tensorboard_dir:
            raise ValueError("--log-memory-to-tensorboard needs --tensorboard-dir")
        if self.profile:
            self._validate_profile()
        elif self.use_pytorch_profiler:
            raise ValueError("--use-pytorch-profiler only chooses the profiler of --profile; add --profile")
        return self

    def _validate_profile(self) -> None:
        start, end = self.profile_step_start, self.profile_step_end
        if start < 0 or end <= start:
            raise ValueError(f"--profile-step-start {start} --profile-step-end {end}: need 0 <= START < END "
                             f"(iterations START+1 .. END are profiled)")
        if self.use_pytorch_profiler and not self.tensorboard_dir:
            raise ValueError("--profile --use-pytorch-profiler writes its trace into --tensorboard-dir; give one")
        if any(rank < 0 for rank in self.profile_ranks):
            raise ValueError(f"--profile-ranks must be ranks >= 0, got {list(self.profile_ranks)}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming."""

    save: Optional[str] = None             # directory to save to; None: never save
    load: Optional[str] = None             # directory to resume from (its 'latest' tag); None: start fresh
    save_interval: Optional[int] = None    # iterations between saves (required with save)
    universal_checkpoint: bool = False     # load a universal checkpoint (ds_to_universal), any TP/PP/DP
    no_load_optim: bool = False            # load weights but not the optimizer state
    no_load_rng: bool = False              # do not restore the RNG states
    finetune: bool = False                 # load weights only; iteration and consumed samples restart at 0
    no_load_fallback: bool = False         # a damaged --load checkpoint is an error, not a fallback to an older one
    keep_last_n_checkpoints: Optional[int] = None  # delete older saved checkpoints; None: keep all
    async_save: bool = False               # write checkpoints in a background thread (megatron.checkpoint.async_save)

    def validate(self) -> "CheckpointConfig":
        if self.save is not None and self.save_interval is None:
            raise ValueError(f"--save {self.save!r} needs --save-interval (iterations between checkpoints)")
        _positive("--save-interval", self.save_interval, allow_none=True)
        _positive("--keep-last-n-checkpoints", self.keep_last_n_checkpoints, allow_none=True)
        if self.async_save and self.save is None:
            raise ValueError("--async-save writes the --save checkpoints in the background: pass --save DIR")
        for flag, on in (("--universal-checkpoint", self.universal_checkpoint), ("--finetune", self.finetune),
                         ("--no-load-fallback", self.no_load_fallback)):
            if on and self.load is None:
                raise ValueError(f"{flag} loads a checkpoint: pass --load DIR")
        return self


@dataclasses.dataclass(frozen=True)
class ExitConfig:
    """Conditions that end the run cleanly (after saving, when --save is set)."""

    exit_interval: Optional[int] = None           # exit after the iteration divisible by this
    exit_duration_in_mins: Optional[float] = None # exit once this many minutes have passed since start
    kill_switch_path: Optional[str] = None        # exit when this file appears
    # The hang watchdog (megatron.training.watchdog; not a clean exit: stacks dumped, the job ends non-zero): a
    # training step running longer than FACTOR x the median of the recent steps, and at least MIN_SECONDS, after
    # the first WARMUP_ITERS steps of the launch. None: off.
    hang_watchdog_factor: Optional[float] = None
    hang_watchdog_min_seconds: float = 60.0
    hang_watchdog_warmup_iters: int = 5

    def validate(self) -> "ExitConfig":
        _positive("--exit-interval", self.exit_interval, allow_none=True)
        if self.hang_watchdog_factor is not None and not self.hang_watchdog_factor > 1:
            raise ValueError(f"--hang-watchdog-factor must be above 1 (a multiple of the median step time), got "
                             f"{self.hang_watchdog_factor}")
        if not self.hang_watchdog_min_seconds > 0:
            raise ValueError(f"--hang-watchdog-min-seconds must be positive, got {self.hang_watchdog_min_seconds}")
        if self.hang_watchdog_warmup_iters < 0:
            raise ValueError(f"--hang-watchdog-warmup-iters must be >= 0, got {self.hang_watchdog_warmup_iters}")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise ValueError(f"--exit-duration-in-mins must be positive, got {self.exit_duration_in_mins}")
        return self


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a pretraining run needs, validated before any process group starts.

    ``model.padded_vocab_size`` is None until the tokenizer is known; ``with_vocab_size`` fills it
    (``megatron.arguments.resolve_vocab_size`` builds the tokenizer and pads as Megatron does).
    """

    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    lr_schedule: LRScheduleConfig
    batch: BatchConfig
    precision: PrecisionConfig
    data: DataConfig
    training: TrainingConfig
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    exit: ExitConfig
    deepspeed_config: Optional[str] = None  # path of the user's --deepspeed_config JSON, if any
    # that JSON's content, merged by megatron.config.deepspeed.build_deepspeed_config
    deepspeed_user_config: Optional[dict] = dataclasses.field(default=None, hash=False)
    startup_warnings: tuple[str, ...] = ()  # settings without effect here, or run as their equivalent; logged once
                                            # (rank 0) by megatron.arguments when the flags are parsed

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def bf16(self) -> bool:
        return self.model.params_dtype == "bf16"

    @property
    def fp16(self) -> bool:
        return self.model.params_dtype == "fp16"

    @property
    def deepspeed_zero_stage(self) -> int:
        """The ZeRO stage DeepSpeed runs (``precision.zero_stage`` is the one asked for)."""
        return deepspeed_zero_stage(self.precision.zero_stage, self.bf16)

    @property
    def counts_step_tokens(self) -> bool:
        """Megatron-LM's per-token loss where it is not the mean of micro-batch means: with a loss mask, micro-batches
        count different tokens (megatron.training.token_count). Without one every micro-batch counts micro-batch x
        seq-length tokens and the two are the same number."""
        return self.training.calculate_per_token_loss and self.data.eod_mask_loss

    def lr_schedule_lengths(self) -> tuple[float, float, int]:
        """(warmup, decay, unit): the schedule's lengths in the unit it counts, and that unit in tokens per sample:
        consumed samples (unit 1), or with --lr-decay-tokens consumed tokens (unit --seq-length), as
        Megatron-DeepSpeed's token-based schedule counts them (its warm-up in iterations or samples becomes the
        tokens consumed by its end)."""
        s = self.lr_schedule
        warmup, decay = self.lr_schedule_in_samples(tokens=False)
        if s.lr_decay_tokens is None:
            return warmup, decay, 1
        seq = self.data.seq_length
        return (s.lr_warmup_tokens if s.lr_warmup_tokens is not None else warmup * seq), s.lr_decay_tokens, seq

    def lr_schedule_in_samples(self, tokens: bool = True) -> tuple[float, float]:
        """(warmup, decay) lengths in consumed samples, as Megatron's get_learning_rate_scheduler computes them
        (a token-based schedule's in samples, fractional where a length is not a whole number of samples; with
        ``tokens`` False, the iteration / sample lengths it replaces)."""
        s, t = self.lr_schedule, self.training
        if tokens and s.lr_decay_tokens is not None:
            warmup, decay, seq = self.lr_schedule_lengths()
            return warmup / seq, decay / seq
        if t.sample_based:
            decay = s.lr_decay_samples if s.lr_decay_samples is not None else t.train_samples
            warmup = s.lr_warmup_samples
        else:
            gbs = self.batch.global_batch_size
            decay = (s.lr_decay_iters if s.lr_decay_iters is not None else t.train_iters) * gbs
            warmup = s.lr_warmup_iters * gbs
        if s.lr_warmup_fraction is not None:
            warmup = s.lr_warmup_fraction * decay
        return warmup, decay

    def with_vocab_size(self, original_vocab_size: int, padded_vocab_size: int) -> "RunConfig":
        model = dataclasses.replace(self.model, original_vocab_size=original_vocab_size,
                                    padded_vocab_size=padded_vocab_size)
        return dataclasses.replace(self, model=model).validate()

    def validate(self) -> "RunConfig":
        for part in (self.parallel, self.optimizer, self.lr_schedule, self.precision, self.data, self.training,
                     self.logging, self.checkpoint, self.exit):
            part.validate()
        timeout_s = 60 * self.parallel.distributed_timeout_minutes
        if self.exit.hang_watchdog_factor is not None and self.exit.hang_watchdog_min_seconds >= timeout_s:
            raise ValueError(f"--hang-watchdog-min-seconds {self.exit.hang_watchdog_min_seconds:g} is not below "
                             f"--distributed-timeout-minutes {self.parallel.distributed_timeout_minutes:g} "
                             f"({timeout_s:g} s): a hung collective would end the job first, without the stacks; "
                             f"give a smaller minimum or a longer timeout")
        tp, pp = self.parallel.tensor_model_parallel_size, self.parallel.pipeline_model_parallel_size
        model = self.model
        if model.padded_vocab_size is None:  # not known yet: check everything else with a stand-in
            model = dataclasses.replace(model, padded_vocab_size=tp)
        check_combinations(self, "FP8")  # with fp16 (megatron.config.combinations)
        model.validate(tp)
        check_combinations(self, "MTP")  # the sequence splits MTP's shift does not cross (megatron.config.combinations)
        if model.mtp_num_layers and self.parallel.context_parallel_size > 1 and self.on_model_engine:
            raise ValueError(f"--mtp-num-layers with --context-parallel-size on DeepSpeed's model engine (--zero-stage "
                             f"{self.precision.zero_stage}) does not work yet: that engine takes each rank's per-token "
                             f"loss, and the depths' shifted losses are built into the pipeline engine's loss only; use "
                             f"--zero-stage 0 or 1 (the pipeline engine) with context parallelism")
        check_combinations(self, "MLA")  # the parallelisms MLA is not implemented with (megatron.config.combinations)
        self.batch.validate(self.parallel.data_parallel_size)
        self._validate_pipeline(pp)
        self._validate_sharding()
        self._validate_ulysses()
        self._validate_schedule()
        check_moe_run(self)
        check_zero_bubble_run(self)
        check_context_parallel_run(self)
        check_interleaved_run(self)
        if self.model.seq_length != self.data.seq_length:
            raise ValueError(f"model seq_length {self.model.seq_length} != data seq_length {self.data.seq_length}")
        if self.counts_step_tokens and (self.deepspeed_engine == "model" or self.parallel.context_parallel_size > 1):
            raise ValueError("--calculate-per-token-loss with --eod-mask-loss divides by the global batch's counted "
                             "tokens on DeepSpeed's pipeline engine only; not implemented with ZeRO-2/3, Ulysses or "
                             "context parallelism (whose losses are split over the sequence ranks). Use --zero-stage 0 "
                             "or 1 without them, or drop one of the two flags")
        check_combinations(self, "document attention mask")
        if self.data.reset_position_ids and self.model.position_embedding_type != "absolute":
            raise ValueError(f"--reset-position-ids changes the position ids, which only learned absolute positions "
                             f"read (as in Megatron-LM); --position-embedding-type "
                             f"{self.model.position_embedding_type} takes positions from the token order. Drop "
                             f"the flag, or use --position-embedding-type absolute")
        if self.training.eval_iters > 0 and not self.data.has_validation_data:
            raise ValueError(f"--eval-iters {self.training.eval_iters} asks for evaluation every "
                             f"{self.training.eval_interval} iterations, but there is no validation data (no "
                             f"--valid-weighted-split-paths, or a --split without a validation part); pass "
                             f"validation data or --eval-iters 0")
        check_combinations(self, "Muon")  # the ZeRO stages, precisions and checkpoint formats Muon runs with
        return self

    def _validate_pipeline(self, pp: int) -> None:
        method = self.parallel.pp_partition_method
        stages = self.parallel.stage_contents(self.model.num_layers, self.model.mtp_num_layers)
        if stages is not None:
            asked = [flag for flag, field in zip(LAYOUT_FLAGS, LAYOUT_FIELDS) if getattr(self.parallel, field)]
            if method != ParallelConfig.pp_partition_method:
                raise ValueError(f"{asked[0]} places the layers on the stages itself; --pp-partition-method {method} "
                                 f"would split them too: drop one of them")
            for rank in range(pp):  # an empty chunk passes its input on; a rank needs parameters to optimize
                if all(stage.empty for stage in stages[rank::pp]):
                    raise ValueError(f"{asked[0]}: pipeline rank {rank} holds no layer (its stages "
                                     f"{list(range(rank, len(stages), pp))} are empty); DeepSpeed's pipeline engine "
                                     f"needs parameters on every rank for its optimizer: give it at least one layer")
            return
        # type:transformer|embedding also balances the tied embedding (first and last stage) as layers
        items = self.model.num_layers + (2 if method == "type:transformer|embedding" else 0)
        if items < pp:
            raise ValueError(f"--num-layers {self.model.num_layers} gives {items} layers to partition with "
                             f"--pp-partition-method {method}, fewer than --pipeline-model-parallel-size {pp}: "
                             f"every stage needs at least one; use fewer stages or more layers")

    @property
    def on_model_engine(self) -> bool:
        """On DeepSpeed's model engine (``megatron.engine.model_engine``), else the pipeline engine: ZeRO
        stage 2 or 3 (gradients, and with 3 the parameters, sharded over the data-parallel ranks), and every
        DeepSpeed-Ulysses run (only that engine reduces gradients over the sequence-parallel ranks too)."""
        return self.deepspeed_engine == "model"

    @property
    def deepspeed_engine(self) -> str:
        """The engine this run trains (and saves) with: "model" (DeepSpeed's model engine, GPTModel's
        parameter names; ``on_model_engine``) or "pipeline". Recorded in every checkpoint it saves."""
        return deepspeed_engine_for(self.precision.zero_stage, self.parallel.ds_sequence_parallel_size)

    def _validate_ulysses(self) -> None:
        """DeepSpeed-Ulysses: whole tokens per rank, whole heads (and key / value heads) after the all-to-all."""
        sp = self.parallel.ds_sequence_parallel_size
        if sp == 1:
            return
        tp, m = self.parallel.tensor_model_parallel_size, self.model
        flag = f"--ds-sequence-parallel-size {sp}"
        check_combinations(self, "Ulysses")  # with pipeline parallelism
        if m.seq_length % sp:
            raise ValueError(f"--seq-length {m.seq_length} is not divisible by {flag}: each rank holds seq-length / "
                             f"sp tokens of every sample; use a multiple of {sp}")
        if m.sequence_parallel and m.seq_length % (sp * tp):
            raise ValueError(f"--seq-length {m.seq_length} is not divisible by {flag} x --tensor-model-parallel-size "
                             f"{tp} = {sp * tp}: with --sequence-parallel too, each rank's seq-length / sp tokens are "
                             f"split again across the TP group; use a multiple of {sp * tp}")
        for name, count in (("--num-attention-heads", m.num_attention_heads), ("key / value heads (--num-key-value-"
                            "heads / --num-query-groups)", m.num_kv_heads)):
            if count % (tp * sp):
                raise ValueError(f"{name} {count} is not divisible by --tensor-model-parallel-size {tp} x {flag} = "
                                 f"{tp * sp}: after the all-to-all each rank attends with whole heads; choose sizes "
                                 f"whose product divides it")
        check_combinations(self, "model engine")

    def _validate_sharding(self) -> None:
        stage = self.precision.zero_stage
        hpz = self.parallel.zero_hpz_partition_size
        if hpz > 1 and stage != 3:
            raise ValueError(f"--zero-hpz-partition-size {hpz} shards a secondary copy of the parameters, which only "
                             f"ZeRO-3 has; add --zero-stage 3 (with --pipeline-model-parallel-size 1) or drop it")
        if stage < 2:
            return
        check_combinations(self, "ZeRO-2/3")  # with pipeline parallelism
        # what DeepSpeed's model engine (megatron.engine.model_engine) does not run here: its activation
        # checkpointing, fp16
        check_combinations(self, "model engine")
        check_combinations(self, "sync TP-duplicated parameters")  # with ZeRO-3

    def _validate_schedule(self) -> None:
        s, t = self.lr_schedule, self.training
        if t.sample_based:
            wrong = {"--lr-decay-iters": s.lr_decay_iters, "--lr-warmup-iters": s.lr_warmup_iters or None}
            mode, fix = "sample-based (--train-samples)", "the -samples variants"
        else:
            wrong = {"--lr-decay-samples": s.lr_decay_samples, "--lr-warmup-samples": s.lr_warmup_samples or None,
                     "--rampup-batch-size": self.batch.rampup_batch_size}
            mode, fix = "iteration-based (--train-iters)", "the -iters variants, and no --rampup-batch-size"
        for flag, value in wrong.items():
            if value is not None:
                raise ValueError(f"{flag} {value} does not fit {mode} training; use {fix} "
                                 f"(Megatron: rampup needs --train-samples)")
        warmup, decay = self.lr_schedule_in_samples()
        if warmup >= decay:
            raise ValueError(f"learning-rate warmup ({warmup:g} samples) is not shorter than the decay "
                             f"({decay} samples, warmup included); shorten the warmup or lengthen the decay")
