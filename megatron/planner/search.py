"""Enumerate the layouts of a model on a number of GPUs and rank them by predicted step time.

Candidates: TP a divisor of the GPUs per node that divides the heads and the vocabulary, PP a
divisor of num_gpus / TP no larger than the layer count, DP the rest, every micro-batch size in
``micro_batch_sizes`` that divides global_batch / DP, recomputation on and off, ZeRO stages 0 and 1 (any
PP) and 2 and 3 (PP 1; ZeRO-3 also with hpZ groups of one node).
A layout fits when its busiest stage's predicted memory is at most MEMORY_HEADROOM of the GPU's memory.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

from megatron.planner.layout import Layout
from megatron.planner.memory import MEMORY_HEADROOM, MemoryEstimate, estimate_memory
from megatron.planner.performance import StepEstimate, estimate_step
from megatron.planner.specs import ClusterSpec, GPUSpec, ModelShape


@dataclasses.dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: MemoryEstimate
    step: StepEstimate
    fits: bool

    num_micro_batches: int

    def row(self) -> dict:
        """A flat, JSON-ready summary (memory in GiB)."""
        lay, st = self.layout, self.step
        return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "micro_batch_size": lay.micro_batch_size,
                "num_micro_batches": self.num_micro_batches,
                "recompute": lay.recompute, "zero_stage": lay.zero_stage, "hpz": lay.hpz, "zero": lay.zero_label,
                "memory_gib": round(self.memory.peak / 2 ** 30, 2), "peak_stage": self.memory.peak_stage,
                "fits": self.fits, "step_s": round(st.step_s, 3),
                "hardware_tflops_per_gpu": round(st.hardware_tflops_per_gpu, 1),
                "model_tflops_per_gpu": round(st.model_tflops_per_gpu, 1), "mfu": round(st.mfu, 4),
                "tokens_per_s": round(st.tokens_per_s, 1), "bubble_fraction": round(st.bubble_s / st.step_s, 4),
                "components_s": {k: round(v, 3) for k, v in st.components_s.items()}}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: ModelShape, num_gpus: int, gpus_per_node: int, global_batch_size: int,
                      micro_batch_sizes: Iterable[int] = (1, 2, 4, 8), recompute: Iterable[bool] = (True, False),
                      zero_stages: Iterable[int] = (1, 0, 2, 3), precision: str = "bf16",
                      partition_method: str = "type:transformer") -> list[Layout]:
    out = []
    for tp in _divisors(min(num_gpus, gpus_per_node)):
        if model.num_attention_heads % tp or model.vocab_size % tp:
            continue
        for pp in _divisors(num_gpus // tp):
            min_layers = model.num_layers + (2 if partition_method == "type:transformer|embedding" else 0)
            if pp > model.num_layers or min_layers // pp < 1:
                continue
            dp = num_gpus // (tp * pp)
            for mbs in micro_batch_sizes:
                if global_batch_size % (mbs * dp):
                    continue
                for rc in recompute:
                    for zero in zero_stages:
                        if dp == 1 and zero >= 1:
                            continue  # nothing to shard
                        if zero >= 2 and pp > 1:
                            continue  # ZeRO-2/3 run on DeepSpeed's non-pipeline engine: one stage
                        out.append(Layout(tp, pp, dp, mbs, rc, zero, precision, partition_method))
                        node_group = gpus_per_node // tp  # hpZ: one group per node
                        if zero == 3 and 1 < node_group < dp and dp % node_group == 0:
                            out.append(Layout(tp, pp, dp, mbs, rc, zero, precision, partition_method,
                                              hpz=node_group))
    return out


def plan_layouts(model: ModelShape, gpu: GPUSpec, cluster: ClusterSpec, num_gpus: int, seq_length: int,
                 global_batch_size: int, *, micro_batch_sizes: Iterable[int] = (1, 2, 4, 8),
                 recompute: Iterable[bool] = (True, False), zero_stages: Iterable[int] = (1, 0, 2, 3),
                 partition_method: str = "type:transformer", memory_limit: Optional[float] = None,
                 include_infeasible: bool = False) -> list[Plan]:
    """Every candidate layout with its memory and step estimates; fitting ones first, fastest first."""
    if num_gpus < 1 or global_batch_size < 1 or seq_length < 1:
        raise ValueError(f"num_gpus {num_gpus}, global batch {global_batch_size} and seq length {seq_length} "
                         f"must be positive")
    limit = gpu.memory_bytes * MEMORY_HEADROOM if memory_limit is None else memory_limit
    plans = []
    for layout in candidate_layouts(model, num_gpus, cluster.gpus_per_node, global_batch_size, micro_batch_sizes,
                                    recompute, zero_stages, "bf16", partition_method):
        try:
            memory = estimate_memory(model, layout, seq_length, global_batch_size)
        except ValueError:
            continue  # too few layers for this many stages
        step = estimate_step(model, layout, gpu, cluster, seq_length, global_batch_size)
        fits = memory.peak <= limit
        if fits or include_infeasible:
            plans.append(Plan(layout, memory, step, fits, layout.num_micro_batches(global_batch_size)))
    plans.sort(key=lambda p: (not p.fits, p.step.step_s, p.memory.peak))
    return plans
