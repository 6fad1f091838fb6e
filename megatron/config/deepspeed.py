"""The DeepSpeed config dict, built from the run's flags and merged with the user's --deepspeed_config JSON.

Pure dict logic; must not import deepspeed (it runs during argument validation, before any process).

Keys derived from flags (a user JSON value that differs is a ValueError naming key, JSON value, flag):

====================================================  ===========================================
key                                                   flag
====================================================  ===========================================
train_batch_size                                      --global-batch-size (the final size; during a
                                                      rampup the loop calls set_train_batch_size);
                                                      x --context-parallel-size in the built config
train_micro_batch_size_per_gpu                        --micro-batch-size
gradient_accumulation_steps                           global / (micro x data-parallel size)
gradient_clipping                                     --clip-grad
bf16.enabled / fp16.enabled                           --bf16 / --fp16 (fp32: both false)
data_types.grad_accum_dtype = "fp32" (bf16 only)      --bf16: with zero_optimization.stage 1 this
                                                      selects DeepSpeed's BF16_Optimizer (BLOOM's path)
zero_optimization.zero_hpz_partition_size             --zero-hpz-partition-size (when above 1)
zero_optimization.stage                               --zero-stage; the JSON's must equal the flag, and
                                                      the built config holds the stage that runs
                                                      (``RunConfig.deepspeed_zero_stage``: --bf16 with
                                                      0, BLOOM's setting, runs as 1)
pipeline.pipe_partitioned / grad_partitioned = false  --sequence-parallel (with TP > 1): each TP rank's
                                                      activation is its own sequence shard, so DeepSpeed
                                                      must not send 1/TP of it and rebuild the rest from
                                                      the TP peers (that assumes replicated activations)
communication_data_type = "bf16"                      --grad-reduce-in-bf16 (DeepSpeed's default for bf16
                                                      runs too: the gradients are reduced in bf16)
zero_allow_untested_optimizer = true                  --optimizer muon, or --exp-avg-dtype / --exp-avg-sq-dtype
                                                      below fp32, under ZeRO or BF16_Optimizer (client
                                                      optimizers stepping on DeepSpeed's flat partitions)
fp16.loss_scale                                       --loss-scale (0: dynamic), when given
fp16.initial_scale_power                              log2(--initial-loss-scale), when given
fp16.min_loss_scale / loss_scale_window / hysteresis  --min-loss-scale / --loss-scale-window /
                                                      --hysteresis, when given
====================================================  ===========================================

Defaults that a user JSON may change freely: ``steps_per_print`` (large: the loop logs itself),
``wall_clock_breakdown`` false, fp16's dynamic-scaling values for flags not given (DeepSpeed's own,
which Megatron-DeepSpeed runs got: scale 2**16, min 1, window 1000, hysteresis 2), and with
--deepspeed-activation-checkpointing an
``activation_checkpointing`` section (no partitioning, no CPU offload, number_checkpoints =
--num-layers, as Megatron-DeepSpeed configured it). Other user keys are kept as they are.

Never emitted, and refused in the JSON: ``optimizer`` and ``scheduler``. The client passes a torch
optimizer and runs the learning-rate schedule itself (megatron.training.lr_schedule), which also
avoids DeepSpeed's JIT FusedAdam build on CPU.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

STEPS_PER_PRINT = 10 ** 9  # DeepSpeed's own step log would duplicate ours
REFUSED_SECTIONS = {"optimizer": "the optimizer comes from --optimizer, --lr, --adam-* and --weight-decay",
                    "scheduler": "the learning-rate schedule comes from the --lr-* flags"}


def build_deepspeed_config(run_config, user_config: Optional[dict] = None) -> dict:
    """The config for ``deepspeed.initialize``: defaults < the user's JSON < values derived from flags."""
    user = copy.deepcopy(user_config or {})
    if not isinstance(user, dict):
        raise ValueError(f"the DeepSpeed config must be a JSON object, got {type(user).__name__}")
    for section, why in REFUSED_SECTIONS.items():
        if section in user:
            raise ValueError(f"the DeepSpeed config has a '{section}' section; remove it: {why}")
    if "bfloat16" in user:  # DeepSpeed's older spelling of the bf16 section
        if "bf16" in user:
            raise ValueError("the DeepSpeed config has both 'bf16' and 'bfloat16' sections; keep one")
        user["bf16"] = user.pop("bfloat16")
    derived = _derived(run_config)
    for path, value, flag in derived:
        present, user_value = _lookup(user, path)
        if present and not _same(user_value, value):
            raise ValueError(f"DeepSpeed config key {'.'.join(path)} = {user_value!r} (from "
                             f"{run_config.deepspeed_config or 'the user config'}) contradicts {flag}, which "
                             f"gives {value!r}; change the JSON or the flag so they agree")
    config = _merge(_defaults(run_config), user)
    for path, value, _ in derived:
        _assign(config, path, value)
    config["zero_optimization"]["stage"] = run_config.deepspeed_zero_stage  # checked above as asked for
    # Context parallelism on the pipeline engine: DeepSpeed's data axis holds the dp x cp ranks, each reading
    # every sample of its DP rank (1/cp of its tokens), so in DeepSpeed's count the batch is cp times the samples.
    # The JSON keeps Megatron's meaning (checked above against --global-batch-size).
    config["train_batch_size"] *= deepspeed_batch_factor(run_config)
    return config


def _derived(rc) -> list[tuple[tuple[str, ...], Any, str]]:
    b, p, dp = rc.batch, rc.precision, rc.parallel.data_parallel_size
    bf16, fp16 = rc.bf16, rc.fp16
    gas = b.global_batch_size // (b.micro_batch_size * dp)
    out = [
        (("train_batch_size",), b.global_batch_size, f"--global-batch-size {b.global_batch_size}"),
        (("train_micro_batch_size_per_gpu",), b.micro_batch_size, f"--micro-batch-size {b.micro_batch_size}"),
        (("gradient_accumulation_steps",), gas,
         f"--global-batch-size {b.global_batch_size} / (--micro-batch-size {b.micro_batch_size} x data-parallel "
         f"size {dp})"),
        (("gradient_clipping",), rc.optimizer.clip_grad, f"--clip-grad {rc.optimizer.clip_grad}"),
        (("bf16", "enabled"), bf16, "--bf16" if bf16 else "the absence of --bf16"),
        (("fp16", "enabled"), fp16, "--fp16" if fp16 else "the absence of --fp16"),
        (("zero_optimization", "stage"), p.zero_stage, f"--zero-stage {p.zero_stage}"),
    ]
    hpz = rc.parallel.zero_hpz_partition_size
    if hpz > 1:
        out.append((("zero_optimization", "zero_hpz_partition_size"), hpz, f"--zero-hpz-partition-size {hpz}"))
    if rc.model.sequence_parallel:
        why = "--sequence-parallel (TP ranks hold different sequence shards, not copies of one activation)"
        out += [(("pipeline", "pipe_partitioned"), False, why), (("pipeline", "grad_partitioned"), False, why)]
    sp = rc.parallel.ds_sequence_parallel_size
    cp = rc.parallel.context_parallel_size
    if max(sp, cp) > 1 and rc.deepspeed_zero_stage == 3:
        # megatron.engine.ulysses scales the loss for this path's averaging over dp x sp (or dp x cp) ranks
        flag = f"--ds-sequence-parallel-size {sp}" if sp > 1 else f"--context-parallel-size {cp}"
        out.append((("zero_optimization", "reduce_scatter"), True,
                    f"{flag} with --zero-stage 3 (DeepSpeed's reduce-scatter path)"))
    ep = rc.parallel.expert_model_parallel_size
    if ep > 1 and rc.deepspeed_zero_stage == 2:
        # ZeRO-2 reduces a gradient over its expert-data-parallel group only on the reduce-scatter path; its
        # all-reduce path would average the different experts of the whole data-parallel group
        out.append((("zero_optimization", "reduce_scatter"), True,
                    f"--expert-model-parallel-size {ep} with --zero-stage 2 (experts reduced per expert-data group)"))
    if p.grad_reduce_in_bf16:
        out.append((("communication_data_type",), "bf16", "--grad-reduce-in-bf16"))
    if bf16 and rc.deepspeed_zero_stage <= 1:
        # Megatron accumulates bf16 gradients in fp32; DeepSpeed then picks BF16_Optimizer
        out.append((("data_types", "grad_accum_dtype"), "fp32", "--bf16 (gradients accumulate in fp32)"))
    o = rc.optimizer
    untested = o.optimizer == "muon" or (o.exp_avg_dtype, o.exp_avg_sq_dtype) != ("fp32", "fp32")
    if untested and (rc.deepspeed_zero_stage or bf16 or fp16):
        # DeepSpeed's ZeRO / BF16_Optimizer accept only optimizers it knows unless told; megatron.engine.muon steps
        # on their flat partitions (attach_partitioned), AdamWStateDtypes (megatron.engine.adam_state_dtypes) is a
        # plain torch optimizer over them
        why = "--optimizer muon" if o.optimizer == "muon" else "--exp-avg-dtype / --exp-avg-sq-dtype"
        out.append((("zero_allow_untested_optimizer",), True, why))
    if fp16:
        power = None if p.initial_loss_scale is None else int(math.log2(p.initial_loss_scale))
        scaling = {"loss_scale": p.loss_scale, "min_loss_scale": p.min_loss_scale,
                   "loss_scale_window": p.loss_scale_window, "hysteresis": p.hysteresis, "initial_scale_power": power}
        flags = {"loss_scale": "--loss-scale", "min_loss_scale": "--min-loss-scale",
                 "loss_scale_window": "--loss-scale-window", "hysteresis": "--hysteresis",
                 "initial_scale_power": f"--initial-loss-scale {p.initial_loss_scale} (2 to the power)"}
        out += [(("fp16", key), value, f"{flags[key]} {value}" if key != "initial_scale_power" else flags[key])
                for key, value in scaling.items() if value is not None]
    return out


def _defaults(rc) -> dict:
    config: dict = {"steps_per_print": STEPS_PER_PRINT, "wall_clock_breakdown": False}
    if rc.fp16:
        config["fp16"] = {"loss_scale": 0, "initial_scale_power": 16, "min_loss_scale": 1,
                          "loss_scale_window": 1000, "hysteresis": 2}
    if rc.deepspeed_zero_stage == 3:
        # True (DeepSpeed's default) makes zero.Init replace torch.nn.functional.linear process-wide.
        config["zero_optimization"] = {"memory_efficient_linear": False}
    if rc.training.deepspeed_activation_checkpointing:
        config["activation_checkpointing"] = {
            "partition_activations": False, "contiguous_memory_optimization": False, "cpu_checkpointing": False,
            "number_checkpoints": rc.model.num_layers, "synchronize_checkpoint_boundary": False, "profile": False}
    return config


def deepspeed_batch_factor(run_config) -> int:
    """DeepSpeed's train_batch_size / --global-batch-size: cp on the pipeline engine with context parallelism
    (its data axis holds dp x cp ranks), else 1 (the model engine's mpu reports dp alone)."""
    p = run_config.parallel
    return p.context_parallel_size if run_config.deepspeed_engine == "pipeline" else 1


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    return a == b


def _lookup(config: dict, path: tuple[str, ...]) -> tuple[bool, Any]:
    node: Any = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _assign(config: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        config = config.setdefault(key, {})
    config[path[-1]] = value


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
