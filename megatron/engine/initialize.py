"""``deepspeed.initialize`` on our topology: the pipeline module, the client optimizer, the config.

    engine = build_engine(run_config, state, tracker=tracker)
    loss = engine.train_batch(data_iterator)

The returned object is DeepSpeed's ``PipelineEngine`` (also for a single stage, so there is one code
path), except with ``--zero-stage`` 2 or 3 or ``--ds-sequence-parallel-size`` > 1: DeepSpeed's model engine behind the same
``train_batch`` / ``eval_batch`` (``megatron.engine.model_engine``; MoE expert parallelism on either engine, marked
by ``megatron.engine.expert_parallel``). Its optimizer: in bf16 with
``zero_optimization.stage`` 1 and fp32 gradient accumulation (what
``--bf16`` with ``--zero-stage`` 0 or 1 gives), ``BF16_Optimizer`` (BLOOM's path); in fp32 with
ZeRO-1, ``DeepSpeedZeroOptimizer`` (its grad norm counts replicated parameters on TP rank 0 of every
stage, correctly); in fp32 without ZeRO, the client optimizer wrapped by our grad-norm clipper
(DeepSpeed's plain clipping would miscount).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
from typing import Optional

import deepspeed
import torch.distributed as dist

from megatron.config import RunConfig
from megatron.config.deepspeed import build_deepspeed_config
from megatron.config.schedules import schedule_name
from megatron.engine.cpu import check_cpu_compiler, on_cpu_accelerator
from megatron.engine.deepspeed_compat import (
    avoid_cpu_jit_builds,
    check_bf16_stage_0,
    pipeline_engine_class,
    skip_unused_muon_import,
    use_safe_loading,
)
from megatron.engine.expert_parallel import check_expert_parallel_engine, mark_expert_parameters
from megatron.engine.model_engine import DeepSpeedMPU, ModelEngine, build_model_module, set_hpz_group
from megatron.engine.muon import attach_partitioned
from megatron.engine.optimizer import GradNormClippingOptimizer, build_client_optimizer
from megatron.engine.partition import virtual_stage_bounds
from megatron.engine.pipeline import build_pipeline_module
from megatron.engine.schedules import ENGINE_CLASSES
from megatron.model.compile import compile_transformer_layers
from megatron.parallel.random import RNGStatesTracker
from megatron.parallel.state import ParallelState

logger = logging.getLogger(__name__)


def init_deepspeed_comm(backend: str, timeout_s: float = 600.0) -> None:
    """Let ``deepspeed.comm`` wrap the already initialized torch.distributed default group."""
    avoid_cpu_jit_builds()
    skip_unused_muon_import()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, dist_init_required=False,
                               timeout=datetime.timedelta(seconds=timeout_s))


def build_engine(rc: RunConfig, state: ParallelState, *, tracker: Optional[RNGStatesTracker] = None,
                 ds_config: Optional[dict] = None):
    """Build this rank's pipeline stage and hand it to ``deepspeed.initialize``; return the engine.

    Each part reads its own piece of ``rc``: the stage ``rc.model``, ``rc.parallel`` and the
    recomputation flags of ``rc.training``; the client optimizer ``rc.optimizer``; DeepSpeed the
    config ``build_deepspeed_config(rc)`` gives (``ds_config`` replaces it, for tests of DeepSpeed's
    own options), with the universal-checkpoint loader when ``--universal-checkpoint`` is set.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before build_engine")
    config = copy.deepcopy(ds_config) if ds_config is not None else build_deepspeed_config(rc, rc.deepspeed_user_config)
    if rc.checkpoint.universal_checkpoint:
        # Only loading reads the universal layout; saves keep DeepSpeed's regular one, so a later plain
        # --load continues (the flag is not sticky).
        config["checkpoint"] = dict(config.get("checkpoint", {}), load_universal=True)
    if config.get("fp16", {}).get("enabled") and on_cpu_accelerator():
        raise ValueError("--fp16 needs a GPU: DeepSpeed's CPU accelerator has no fp16 support; use --bf16 (or fp32) "
                         "on CPU")
    check_bf16_stage_0(rc.precision.zero_stage, rc.bf16)
    if rc.on_model_engine:
        return _build_sharded_engine(rc, state, config, tracker)
    t = rc.training
    module = build_pipeline_module(rc.model, state, partition_method=rc.parallel.pp_partition_method,
                                   activation_checkpoint_interval=t.checkpoint_num_layers if t.checkpoint_activations
                                   else 0, tracker=tracker,
                                   num_virtual_stages=rc.parallel.num_virtual_stages_per_pipeline_rank,
                                   parts=pipeline_layout_parts(rc))
    if t.torch_compile:
        _compile_layers(module)
    experts = mark_expert_parameters(module, rc.model, state)  # MoE with EP > 1 (megatron.engine.expert_parallel)
    client = _fp32_clipping(_client(module, rc, state), config, rc, state)
    # the registry's chooser (megatron.config.schedules), the engine per schedule (megatron.engine.schedules);
    # no class: DeepSpeed's PipelineEngine (1F1B)
    engine_class, set_up, _ = ENGINE_CLASSES[schedule_name(rc)]
    with pipeline_engine_class(engine_class) if engine_class else contextlib.nullcontext():
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=client, config=config)
    attach_partitioned(client, engine.optimizer)  # Muon under ZeRO / BF16_Optimizer: where its matrices lie
    use_safe_loading(engine)  # --load never unpickles code (megatron.engine.deepspeed_compat)
    if set_up is not None:
        engine = set_up(engine)  # ZB-H1: megatron.engine.schedules.zero_bubble.enable_zero_bubble
    check_expert_parallel_engine(engine, experts, state)
    return engine


def pipeline_layout_parts(rc: RunConfig) -> Optional[list[int]]:
    """The pipeline stages' bounds the layout flags give (``megatron.engine.partition.virtual_stage_bounds``); None
    without them (DeepSpeed's partition method splits, as the engine always did)."""
    if rc.parallel.stage_contents(rc.model.num_layers, rc.model.mtp_num_layers) is None:
        return None
    return virtual_stage_bounds(rc.model, rc.parallel)


def _client(module, rc: RunConfig, state: ParallelState):
    return build_client_optimizer(module, rc.optimizer, tp_group=state.tp_group, model_config=rc.model)


def _fp32_clipping(client, config: dict, rc: RunConfig, state: ParallelState):
    """fp32 without ZeRO: the client optimizer behind our grad-norm clipper, DeepSpeed's clipping off."""
    mixed = config.get("bf16", {}).get("enabled") or config.get("fp16", {}).get("enabled")
    if mixed or config.get("zero_optimization", {}).get("stage", 0):
        return client
    # DeepSpeed's own clipping miscounts replicated parameters on later pipeline stages (see
    # megatron.engine.optimizer), and on its model engine (Ulysses at ZeRO-0) reports no norm; clip
    # with our norm instead. 0 must be explicit: DeepSpeed's default for a missing gradient_clipping is 1.0.
    config["gradient_clipping"] = 0.0
    return GradNormClippingOptimizer(client, clip_grad=rc.optimizer.clip_grad, tp_rank=state.tp_rank,
                                     model_group=state.model_group, expert_group=state.ep_group,
                                     experts_span_tp=state.experts_span_tp)


def _compile_layers(module) -> None:
    """--torch-compile: each transformer layer compiled in place (megatron/model/compile.py)."""
    if on_cpu_accelerator():
        check_cpu_compiler()
    compile_transformer_layers(module)


def _build_sharded_engine(rc: RunConfig, state: ParallelState, config: dict, tracker: Optional[RNGStatesTracker]):
    """ZeRO-2/3 or Ulysses (one stage): the model on DeepSpeed's model engine, our groups as its mpu."""
    mpu = DeepSpeedMPU(state)
    hpz_ranks = set_hpz_group(state, rc.parallel.zero_hpz_partition_size)
    module = build_model_module(rc, state, config, mpu, tracker)
    if rc.training.torch_compile:
        _compile_layers(module)
    # ZeRO-2 (ZeRO-3 is refused with EP > 1: megatron.config.combinations): DeepSpeedZeroOptimizer reduce-scatters a marked
    # expert's gradient over its expert-data-parallel group and shards its state there, as ZeRO-1 does
    experts = mark_expert_parameters(module, rc.model, state)
    client = _fp32_clipping(_client(module, rc, state), config, rc, state)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=client, config=config, mpu=mpu)
    attach_partitioned(client, engine.optimizer)
    use_safe_loading(engine)
    sharded = ModelEngine(engine, state, mpu, hpz_ranks)
    check_expert_parallel_engine(sharded, experts, state)
    return sharded
