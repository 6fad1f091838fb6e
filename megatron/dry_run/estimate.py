"""The planner's memory per GPU and step time for a checked job's own layout (``megatron.planner``).

The planner's ``Layout`` gets the job's TP / PP / DP, micro-batch, recomputation, precision, the ZeRO
stage DeepSpeed will run, and the transformer layers of each stage as DeepSpeed partitions them (the
dry run's layout section), so the estimate and the printed stages cannot disagree. The GPU and the
fabric are assumptions (``--dry-run-gpu``, ``--dry-run-cluster``), said in the report.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.config import RunConfig
from megatron.config.hardware import fp8_capability_problem
from megatron.config.moe import routes_tp_shards
from megatron.config.pipeline_layout import LAYOUT_FIELDS
from megatron.config.schedules import get as get_schedule
from megatron.config.schedules import schedule_name, virtual_stages_of
from megatron.model.layout import EMBEDDING, FINAL_NORM, HEAD, TRANSFORMER, pipeline_items
from megatron.planner import CLUSTERS, GPUS, Layout, ModelShape, estimate_memory, estimate_step
from megatron.planner.context_parallel import (
    ring_bandwidth_gbps,
    ring_buffer_bytes,
    ring_bytes,
    ring_exposed_s,
    step_ring_bytes,
)
from megatron.planner.fp8 import fp8_stage_bytes, stage_fp8_layers
from megatron.planner.memory import MEMORY_HEADROOM, activation_terms, stage_expert_param_counts
from megatron.planner.moe import step_all_to_all_bytes
from megatron.planner.performance import ATTENTION_EFFICIENCY
from megatron.planner.schedule_costs import in_flight, p2p_bytes_per_step
from megatron.planner.specs import DEFAULT_CLUSTER, GiB, model_shape_of

STATE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # an Adam moment's bytes per value, by its dtype

DEFAULT_GPU = "A100-80GB"  # what BLOOM-176B trained on (Jean Zay), the GPU these flags were written for
DEFAULT_FP8_GPU = "H100-80GB"  # an FP8 job's (--fp8-format): the A100 has no FP8 tensor cores


def hardware(gpu: Optional[str], cluster: Optional[str], fp8: bool = False):
    """(GPUSpec, ClusterSpec) named by --dry-run-gpu / --dry-run-cluster (without --dry-run-gpu an FP8 job assumes
    DEFAULT_FP8_GPU, others DEFAULT_GPU); ValueError listing the known names."""
    gpu = gpu or (DEFAULT_FP8_GPU if fp8 else DEFAULT_GPU)
    if gpu not in GPUS:
        raise ValueError(f"--dry-run-gpu {gpu!r} is not a GPU the planner knows; pick one of {', '.join(sorted(GPUS))}")
    cluster = cluster or DEFAULT_CLUSTER[gpu]
    if cluster not in CLUSTERS:
        raise ValueError(f"--dry-run-cluster {cluster!r} is not a fabric the planner knows; pick one of "
                         f"{', '.join(sorted(CLUSTERS))}")
    return GPUS[gpu], CLUSTERS[cluster]


def vocabulary_rows(rc: RunConfig) -> Optional[int]:
    """The padded vocabulary: the tokenizer's, else --pad-vocab-size-to (the size it pads to), else unknown."""
    return rc.model.padded_vocab_size or rc.data.pad_vocab_size_to


def model_shape(rc: RunConfig) -> ModelShape:
    m, vocab = rc.model, vocabulary_rows(rc)
    if vocab is None:
        raise ValueError("the padded vocabulary is unknown (the tokenizer was not built and there is no "
                         "--pad-vocab-size-to)")
    return model_shape_of(m, vocab)


def item_param_counts(rc: RunConfig) -> list[int]:
    """Parameters of each pipeline item on one TP rank, as DeepSpeed's 'parameters' partition counts them
    (it builds each layer spec: the head's module is the word embedding alone)."""
    shape, tp, ep = model_shape(rc), rc.parallel.tensor_model_parallel_size, rc.parallel.expert_model_parallel_size
    etp = rc.parallel.expert_tp
    h, word = shape.hidden_size, shape.vocab_size * shape.hidden_size // tp
    per_kind = {EMBEDDING: word + shape.learned_positions * h + (shape.norm_params if shape.embed_layernorm else 0),
                FINAL_NORM: shape.norm_params, HEAD: word}
    layers = iter(range(shape.num_layers))  # an MoE layer counts this EP rank's experts
    return [sum(shape.layer_params_split(next(layers), tp, ep, etp)) if item.kind == TRANSFORMER
            else per_kind.get(item.kind, 0) for item in pipeline_items(rc.model)]


def stores_attention_scores(rc: RunConfig) -> bool:
    """Whether the core attention keeps [np, s, s] scores for backward on the GPU the estimate assumes:
    not with selective recomputation, flash or flex, nor with ``auto`` (on CUDA it runs flash, flex or
    SDPA's fused kernels); an explicit ``sdpa`` is counted as materializing them (its math kernel may run). Never
    under context parallelism: the ring kernel keeps one block's scores at a time."""
    m = rc.model
    return (not m.recompute_core_attention and m.attention_backend == "sdpa"
            and rc.parallel.context_parallel_size == 1)


def run_schedule(rc: RunConfig) -> tuple[str, int]:
    """(planner schedule, virtual stages) the run's flags choose: interleaved with v > 1 virtual stages per rank
    (--num-virtual-stages-per-pipeline-rank), ZB-H1 with --enable-zbh1-pipeline, else DeepSpeed's 1F1B: the
    registry's chooser (``megatron.config.schedules.schedule_name``), the one the engine runs."""
    return schedule_name(rc), virtual_stages_of(rc)


def planner_layout(rc: RunConfig, stage_layers: list[int]) -> Layout:
    p = rc.parallel
    schedule, virtual_stages = run_schedule(rc)
    return Layout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size,
                  rc.batch.micro_batch_size, recompute=rc.training.checkpoint_activations,
                  zero_stage=rc.deepspeed_zero_stage, precision=rc.model.params_dtype,
                  partition_method=p.pp_partition_method, stage_layers=tuple(stage_layers),
                  layout_flags=any(getattr(p, field) for field in LAYOUT_FIELDS),
                  hpz=p.zero_hpz_partition_size, sequence_parallel=p.sequence_parallel,
                  ulysses=p.ds_sequence_parallel_size,
                  store_attention_scores=stores_attention_scores(rc), ep=p.expert_model_parallel_size,
                  etp=0 if p.expert_tp == p.tensor_model_parallel_size else p.expert_tp,
                  cp=p.context_parallel_size, schedule=schedule, virtual_stages=virtual_stages,
                  recompute_modules=() if rc.training.checkpoint_activations else rc.model.recompute_modules,
                  adam_state_bytes=sum(STATE_BYTES[d] for d in (rc.optimizer.exp_avg_dtype,
                                                                rc.optimizer.exp_avg_sq_dtype)))


def memory_section(rc: RunConfig, stage_layers: list[int], gpu) -> dict:
    """Bytes per GPU of every stage at the full global batch (the busiest stage decides)."""
    layout = planner_layout(rc, stage_layers)
    memory = estimate_memory(model_shape(rc), layout, rc.data.seq_length, rc.batch.global_batch_size)
    limit = gpu.memory_bytes * MEMORY_HEADROOM
    return {"gpu": gpu.name, "gpu_memory_gib": round(gpu.memory_bytes / GiB, 1), "sequence": layout.sequence_label,
            "attention_scores_stored": layout.store_attention_scores,
            "recompute_modules": list(layout.recompute_modules),
            "limit_gib": round(limit / GiB, 1), "headroom": MEMORY_HEADROOM,
            "peak_gib": round(memory.peak / GiB, 2), "peak_stage": memory.peak_stage, "fits": memory.peak <= limit,
            "per_stage_gib": [{k: round(v / GiB, 2) for k, v in stage.items()} for stage in memory.per_stage]}


def fp8_problem(rc: RunConfig, gpu) -> Optional[str]:
    """Why an FP8 job cannot run on the GPU the estimate assumes (no FP8 tensor cores), or None."""
    if rc.model.fp8 is None or gpu.has_fp8:
        return None
    return fp8_capability_problem(gpu.compute_capability, f"the {gpu.name} (--dry-run-gpu)")


def _ranges(layers: list[int]) -> list[list[int]]:
    """Sorted layer indices as [first, last] runs."""
    out: list[list[int]] = []
    for i in layers:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def fp8_section(rc: RunConfig, stage_layers: list[int], gpu) -> Optional[dict]:
    """An FP8 job's settings, the layers whose GEMMs run FP8 or stay in bf16, and the planner's FP8 figures on the
    assumed GPU (``megatron.planner.fp8``); None without --fp8-format."""
    f8 = rc.model.fp8
    if f8 is None:
        return None
    shape, layout = model_shape(rc), planner_layout(rc, stage_layers)
    pattern = shape.fp8.layer_pattern
    per_stage = stage_fp8_layers(shape, stage_layers)
    memory = [fp8_stage_bytes(shape, layout.tp, *counts) for counts in per_stage]
    return {"format": f8.fp8_format, "recipe": f8.fp8_recipe, "forward_dtype": f8.forward_dtype,
            "grad_dtype": f8.grad_dtype, "wgrad": f8.fp8_wgrad,
            "amax_history_len": f8.fp8_amax_history_len if f8.fp8_recipe == "delayed" else None,
            "amax_compute_algo": f8.fp8_amax_compute_algo if f8.fp8_recipe == "delayed" else None,
            "margin": f8.fp8_margin if f8.fp8_recipe == "delayed" else None,
            "fp8_layers": _ranges([i for i, on in enumerate(pattern) if on]),
            "bf16_layers": _ranges([i for i, on in enumerate(pattern) if not on]),
            "in_fp8": "the transformer layers' linear GEMMs: QKV, attention output, MLP"
                      + (" (an MoE layer's shared expert; not its routed experts)" if shape.moe else ""),
            "in_bf16": "core attention, embedding, output layer (logits), norms"
                       + (", routed experts, router" if shape.moe else ""),
            "gpu": gpu.name, "peak_fp8_tflops": gpu.peak_fp8_tflops, "peak_bf16_tflops": gpu.peak_bf16_tflops,
            "stages": [{"fp8_layers": sum(c), "transient_mib": round(m["fp8_transient"] / 2 ** 20, 2),
                        "scaling_state_mib": round(m["fp8_scaling_state"] / 2 ** 20, 4)}
                       for c, m in zip(per_stage, memory)]}


def experts_section(rc: RunConfig, stage_layers: list[int]) -> Optional[dict]:
    """An MoE job's experts on each rank of each stage and the token all-to-all bytes of one step
    (``megatron.planner.moe``: dropless and balanced; a capacity factor bounds them); None for a dense model."""
    shape, layout = model_shape(rc), planner_layout(rc, stage_layers)
    moe = shape.moe
    if moe is None:
        return None
    moe_layers = moe.stage_moe_layers(stage_layers)
    expert_params = stage_expert_param_counts(shape, layout)
    m = rc.batch.num_micro_batches(layout.dp)
    width = 4 if layout.precision == "fp32" else 2
    p = rc.parallel
    # each TP rank routes its own s / tp tokens under sequence parallelism (Megatron-LM's all-to-all order, or
    # --expert-tensor-parallel-size 1); otherwise every TP rank routes the gathered sequence; CP and Ulysses split it
    own_tokens = routes_tp_shards(rc) or p.expert_tp < p.tensor_model_parallel_size
    split = (p.tensor_model_parallel_size if own_tokens else 1) * p.context_parallel_size * p.ds_sequence_parallel_size
    seq = rc.data.seq_length // split
    traffic = [step_all_to_all_bytes(moe, seq, layout.micro_batch_size, m, shape.hidden_size,
                                     width, layout.ep, n, layout.recompute) for n in moe_layers]
    return {"num_experts": moe.num_experts, "topk": moe.topk, "expert_model_parallel_size": layout.ep,
            "experts_per_rank": moe.num_experts // layout.ep, "expert_data_parallel_size": layout.expert_replicas,
            "dropless": moe.capacity_factor is None,
            "stages": [{"moe_layers": n, "expert_params_per_rank": e, "all_to_all_calls": t["calls"],
                        "all_to_all_gib": round(t["handed"] / GiB, 4), "cross_rank_gib": round(t["cross_rank"] / GiB, 4)}
                       for n, e, t in zip(moe_layers, expert_params, traffic)]}


def step_section(rc: RunConfig, stage_layers: list[int], gpu, cluster, batch_steps) -> dict:
    """Step time at the full batch, and the whole run's time summed over the rampup's smaller batches.

    batch_steps: (global batch, number of steps at it) for every batch size of the run.
    """
    shape, layout, seq = model_shape(rc), planner_layout(rc, stage_layers), rc.data.seq_length
    full = estimate_step(shape, layout, gpu, cluster, seq, rc.batch.global_batch_size)
    run_s = sum(count * estimate_step(shape, layout, gpu, cluster, seq, size).step_s for size, count in batch_steps)
    return {"gpu": gpu.name, "cluster": cluster.name, "step_s": round(full.step_s, 3),
            "bubble_fraction": round(full.bubble_s / full.step_s, 4),
            "model_tflops_per_gpu": round(full.model_tflops_per_gpu, 1),
            "hardware_tflops_per_gpu": round(full.hardware_tflops_per_gpu, 1), "mfu": round(full.mfu, 4),
            "tokens_per_s": round(full.tokens_per_s, 1), "run_days": round(run_s / 86400, 2),
            "mfu_peak_tflops": full.peak_tflops,
            "components_s": {k: round(v, 3) for k, v in full.components_s.items()}}


def context_parallel_section(rc: RunConfig, stage_layers: list[int], gpu, cluster) -> Optional[dict]:
    """A context-parallel job's ring: the K / V (and dK / dV) bytes each rank sends per layer and per step, the
    buffers they need, and the part of the ring's time the block computation does not hide
    (``megatron.planner.context_parallel``); None without CP."""
    layout = planner_layout(rc, stage_layers)
    if layout.cp == 1:
        return None
    shape, seq, width = model_shape(rc), rc.data.seq_length, (4 if layout.precision == "fp32" else 2)
    m = rc.batch.num_micro_batches(layout.dp)
    per_layer = ring_bytes(shape, layout, seq, width)
    attention_rate = gpu.peak_bf16_tflops * 1e12 * ATTENTION_EFFICIENCY
    stages = []
    for n in stage_layers:
        step = step_ring_bytes(shape, layout, seq, width, n, m)
        exposed = m * ring_exposed_s(shape, layout, gpu, cluster, seq, n, attention_rate, width)
        stages.append({"layers": n, "sends": int(step["sends"]), "p2p_gib": round(step["total"] / GiB, 4),
                       "exposed_s": round(exposed, 4)})
    return {"context_parallel_size": layout.cp, "tokens_per_rank": seq // layout.cp,
            "bandwidth_gbps": ring_bandwidth_gbps(layout, gpu, cluster),
            "per_layer_mib": {k: round(per_layer[k] / 2 ** 20, 4) for k in ("forward", "backward",
                                                                           "recomputed_forward", "total")},
            "ring_buffers_mib": round(ring_buffer_bytes(shape, layout, seq, width) / 2 ** 20, 3),
            "overlap": "each K / V hop travels while the current block is computed; the dK / dV hop is exposed",
            "stages": stages}


def schedule_section(rc: RunConfig, stage_layers: list[int], gpu, cluster) -> Optional[dict]:
    """The pipeline schedule's bubble, activation memory per stage and p2p bytes per step for the run's own flags,
    beside 1F1B's on the same layout (``megatron.planner.schedule_costs``); None without a pipeline (PP 1)."""
    layout = planner_layout(rc, stage_layers)
    if layout.pp == 1:
        return None
    shape, seq, batch = model_shape(rc), rc.data.seq_length, rc.batch.global_batch_size
    m = layout.num_micro_batches(batch)
    figures = {}
    for name, lay in (("run", layout), ("1f1b", dataclasses.replace(layout, schedule="1f1b", virtual_stages=1))):
        step = estimate_step(shape, lay, gpu, cluster, seq, batch)
        terms = activation_terms(shape, lay, seq, batch)
        figures[name] = {"bubble_fraction": round(step.bubble_s / step.step_s, 4),
                         "activation_gib": [round(sum(t.values()) / GiB, 3) for t in terms]}
    width = 4 if layout.precision == "fp32" else 2
    tensor = width * seq / layout.sequence_split * layout.micro_batch_size * shape.hidden_size
    p2p = p2p_bytes_per_step(layout.schedule, layout.pp, m, tensor, layout.virtual_stages, layout.tp)
    return {"schedule": layout.schedule, "label": layout.schedule_label, "virtual_stages": layout.virtual_stages,
            "num_micro_batches": m, "bubble_fraction": figures["run"]["bubble_fraction"],
            "bubble_fraction_1f1b": figures["1f1b"]["bubble_fraction"],
            "in_flight_micro_batches": [round(in_flight(layout.schedule, layout.pp, m, i, layout.virtual_stages), 3)
                                        for i in range(layout.pp)],
            "deferred_weight_passes": [get_schedule(layout.schedule).deferred_weight_passes(m, i)
                                       for i in range(layout.pp)],
            "activation_gib": figures["run"]["activation_gib"], "activation_gib_1f1b": figures["1f1b"]["activation_gib"],
            "p2p_gib_per_rank": round(p2p["per_rank"] / GiB, 3), "p2p_gib_pipeline": round(p2p["pipeline"] / GiB, 3)}
