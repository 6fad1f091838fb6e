"""Measure on a live DeepSpeed engine what the planner predicts: bytes per rank of parameters,
gradients and optimizer state, and the collectives of one training step.

It runs real training steps (``megatron.training.pretrain`` on either DeepSpeed engine), so it sits at the
level of an entry point, above the planner whose predictions it checks.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron.arguments import run_config_from_argv
from megatron.engine.model_engine import ModelEngine
from megatron.parallel.state import group_layout
from megatron.planner.candidate import Layout
from megatron.planner.comm_count import (
    CollectiveRecorder,
    StepShape,
    analytic_step_counts,
    analytic_ulysses_counts,
    classify,
)
from megatron.planner.comm_zero import ModuleParams, ZeroSettings, analytic_zero_counts
from megatron.planner.memory import RESIDENT, stage_param_counts, static_bytes
from megatron.planner.specs import ModelShape
from megatron.training.pretrain import pretrain


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def engine_static_bytes(engine) -> dict[str, int]:
    """Bytes this rank holds in weights, the modules' .grad, BF16_Optimizer's fp32 gradient buffer,
    fp32 masters and Adam states, read from the engine's module and optimizer."""
    opt = engine.optimizer
    params = [p for p in engine.module.parameters()]
    if hasattr(opt, "bf16_groups_flat"):  # BF16_Optimizer: flat (padded) buffers back the parameters
        inner = opt.optimizer
        return {"weights": _nbytes(opt.bf16_groups_flat), "grads": _nbytes(p.grad for p in params),
                "grad_buffer": _nbytes(opt.fp32_groups_gradients_flat),
                "master": _nbytes(opt.fp32_groups_flat_partition),
                "adam": _nbytes(t for st in inner.state.values() for t in st.values()
                                if torch.is_tensor(t) and t.dim() > 0)}
    inner = getattr(opt, "optimizer", opt)
    adam = _nbytes(t for st in inner.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    grads = _nbytes(p.grad for p in params)
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3: partitions of weights, masters and gradients
        # (plus the full copies of parameters small enough to stay gathered: stage3_param_persistence_threshold)
        return {"weights": _nbytes(opt.fp16_partitioned_groups_flat) + _nbytes(p.data for p in params),
                "grads": grads, "grad_buffer": _nbytes([opt.grad_partitions_flat_buffer]),
                "master": _nbytes(opt.fp32_partitioned_groups_flat), "adam": adam}
    if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1/2 (DeepSpeedZeroOptimizer): full flat weights
        return {"weights": _nbytes(opt.bit16_groups_flat), "grads": grads, "grad_buffer": 0,
                "master": _nbytes(opt.single_partition_of_fp32_groups), "adam": adam}
    return {"weights": _nbytes(params), "grads": grads, "grad_buffer": 0, "master": 0, "adam": adam}


def optimizer_group_numels(engine) -> list[int]:
    """This rank's parameter count per optimizer group (decay, no-decay), unpadded."""
    opt = engine.optimizer
    if hasattr(opt, "bf16_groups"):
        return [sum(p.numel() for p in group) for group in opt.bf16_groups]
    inner = getattr(opt, "optimizer", opt)
    return [sum(p.numel() for p in g["params"]) for g in inner.param_groups]


def zero_facts(engine, rc) -> Optional[dict]:
    """What megatron.planner.comm_zero needs about a ZeRO-2/3 engine: its zero_optimization settings, the
    full parameter count per optimizer group, and each module's own parameters (comm_zero.ModuleParams's
    fields, as plain lists); None on the pipeline engine."""
    opt = engine.optimizer
    groups = getattr(opt, "fp16_groups", None) if rc.deepspeed_zero_stage == 3 else getattr(opt, "bit16_groups", None)
    if rc.deepspeed_zero_stage < 2 or groups is None:
        return None
    def numel(p) -> int:  # a ZeRO-3 parameter holds no data between uses: its full size is ds_numel
        return int(getattr(p, "ds_numel", p.numel()))

    pre, layers, post = [], [], []
    for name, module in engine.module.named_modules():
        if type(module).__name__ == "TransformerLayer":
            layers.append([])
        own = tuple(numel(p) for p in module.parameters(recurse=False))
        if own:
            (layers[-1] if layers and name.startswith("layers.") else post if layers else pre).append((name, own))
    z = engine._config.zero_config
    return {"settings": {"stage": rc.deepspeed_zero_stage, "reduce_bucket_size": int(z.reduce_bucket_size),
                         "param_persistence_threshold": int(z.param_persistence_threshold),
                         "prefetch_bucket_size": int(z.prefetch_bucket_size),
                         "max_reuse_distance": int(z.max_reuse_distance),
                         "max_live_parameters": int(z.max_live_parameters),
                         "hpz_partition_size": int(z.zero_hpz_partition_size),
                         "check_grad_overflow": bool(getattr(opt, "check_grad_overflow", False))},
            "group_numels": [sum(numel(p) for p in g) for g in groups],
            "modules": {"pre": pre, "layers": layers, "post": post,
                        "tied_embedding": "embedding.word_embeddings" if rc.model.tied_embeddings else None}}


def run_recorded(argv: list[str], world_size: int, record_call: int = 2, rank: Optional[int] = None) -> dict:
    """Train ``argv`` with pretrain() in this (already joined) process; record the collectives of the
    ``record_call``-th ``train_batch`` (later calls: no one-off metadata sends); return per-rank facts."""


    rc = run_config_from_argv(argv, world_size=world_size)
    p = rc.parallel
    layout = group_layout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size,
                          p.ds_sequence_parallel_size)
    engine_class = ModelEngine if rc.on_model_engine else PipelineEngine
    original = engine_class.train_batch
    calls = {"n": 0}
    hpz_axis = {"axis": None}  # where ZeRO++'s secondary gathers are counted
    with CollectiveRecorder(layout) as recorder:
        def train_batch(self, *args, **kwargs):
            calls["n"] += 1
            hpz = getattr(self, "hpz_ranks", None)
            if hpz and len(hpz) < layout.dp * layout.sp:  # ZeRO++'s secondary groups, inside ZeRO's (dp x sp)
                # a group the layout also has (under Ulysses, hpZ = SP: the SP ranks of a replica) keeps its
                # axis, which every collective on those ranks is counted under; any other is "hpz"
                hpz_axis["axis"] = classify("all_gather_into_tensor", tuple(hpz), layout)
                if hpz_axis["axis"] in ("other", "world"):
                    hpz_axis["axis"] = "hpz"
                    recorder.extra_groups["hpz"] = [tuple(hpz)]
            recorder.active = calls["n"] == record_call
            try:
                return original(self, *args, **kwargs)
            finally:
                recorder.active = False

        engine_class.train_batch = train_batch
        try:
            result = pretrain(rc)
        finally:
            engine_class.train_batch = original
    engine = result.engine
    stage_layers = sum(1 for m in engine.module.modules() if type(m).__name__ == "TransformerLayer")
    return {"rank": dist.get_rank(), "summary": {f"{a}/{o}": v for (a, o), v in recorder.summary().items()},
            "records": [(r.op, r.axis, r.ranks, r.numel, r.nbytes) for r in recorder.records],
            "group_numels": optimizer_group_numels(engine), "stage_layers": stage_layers,
            "static_bytes": engine_static_bytes(engine), "losses": [h.loss for h in result.history],
            "optimizer": type(engine.optimizer).__name__, "zero": zero_facts(engine, rc),
            "config": {"seq_length": rc.data.seq_length, "micro_batch_size": rc.batch.micro_batch_size,
                       "global_batch_size": rc.batch.global_batch_size, "hidden_size": rc.model.hidden_size,
                       "num_layers": rc.model.num_layers, "num_attention_heads": rc.model.num_attention_heads,
                       "padded_vocab_size": rc.model.padded_vocab_size, "bf16": rc.bf16,
                       "num_kv_heads": rc.model.num_kv_heads, "head_dim": rc.model.head_dim,
                       "zero_stage": rc.deepspeed_zero_stage, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                       "sp": layout.sp, "hpz_axis": hpz_axis["axis"],
                       "checkpoint_activations": rc.training.checkpoint_activations}}


def predicted_static_bytes(result: dict) -> dict[str, float]:
    """The planner's resident bytes (weights, fp32 grads, masters, Adam) for the rank ``result``
    (a run_recorded() return value) describes."""
    c = result["config"]
    model = ModelShape(c["num_layers"], c["hidden_size"], c["num_attention_heads"], c["padded_vocab_size"])
    layout = Layout(c["tp"], c["pp"], c["dp"], c["micro_batch_size"], c["checkpoint_activations"],
                    c["zero_stage"], "bf16" if c["bf16"] else "fp32")
    pp_rank = group_layout(c["tp"], c["pp"], c["dp"]).coords(result["rank"])[0]
    n = stage_param_counts(model, layout)[pp_rank]
    return {k: v for k, v in static_bytes(n, layout).items() if k in RESIDENT}


def measured_resident_bytes(result: dict) -> dict[str, float]:
    """The RESIDENT components of run_recorded()'s engine_static_bytes (read after the step, when
    the modules' .grad have been freed)."""
    s = result["static_bytes"]
    return {"weights": s["weights"], "grad_buffer": s["grad_buffer"], "master": s["master"], "adam": s["adam"]}


def analytic_sharded_counts(result: dict) -> dict:
    """The analytic {(axis, op): {"calls", "bytes"}} of a ZeRO-2/3 run_recorded() result: the model's own TP
    collectives (comm_count, one stage) plus ZeRO's (comm_zero); "calls" None where prefetching makes it
    unpredictable."""
    c, z = result["config"], result["zero"]
    sp = c.get("sp", 1)
    m = c["global_batch_size"] // (c["micro_batch_size"] * c["dp"])
    width = 2 if c["bf16"] else 4
    shape = StepShape(c["seq_length"], c["micro_batch_size"], c["hidden_size"], c["padded_vocab_size"], m,
                      width, c["checkpoint_activations"])
    layout = group_layout(c["tp"], 1, c["dp"], sp)
    # the TP collectives of this rank's s/sp tokens (Ulysses), the whole sequence otherwise
    local = dataclasses.replace(shape, seq_length=c["seq_length"] // sp)
    out = {k: dict(v) for k, v in analytic_step_counts(local, layout, result["rank"], result["stage_layers"],
                                                       bf16=False).items()}

    def add(key, v):
        entry = out.setdefault(key, {"calls": 0, "bytes": 0})
        entry["calls"] = None if v["calls"] is None or entry["calls"] is None else entry["calls"] + v["calls"]
        entry["bytes"] += v["bytes"]

    # ZeRO shards over dp x sp: that group is "dp" without Ulysses, "sp" at DP 1, else "sp_dp" (comm_count.classify)
    axis = "dp" if sp == 1 else "sp" if c["dp"] == 1 else "sp_dp"
    zero = analytic_zero_counts(ZeroSettings(**z["settings"]), ModuleParams(**z["modules"]), z["group_numels"],
                                c["dp"] * sp, c["tp"], m, width, c["checkpoint_activations"])
    rename = {"dp": axis, "hpz": c.get("hpz_axis") or "hpz"}
    for (group, op), v in zero.items():
        add((rename.get(group, group), op), v)
    if sp > 1:
        for key, v in analytic_ulysses_counts(shape, layout, c["num_layers"], c["num_attention_heads"],
                                              c["num_kv_heads"], c["head_dim"]).items():
            add(key, v)
        add(("sp", "all_reduce"), {"calls": m, "bytes": 4 * m})  # each micro-batch's loss-mask count, fp32
    return out
