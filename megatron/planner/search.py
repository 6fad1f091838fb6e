"""Enumerate the layouts of a model on a number of GPUs and rank them by predicted step time.

Candidates: TP a divisor of the GPUs per node that divides the heads and the vocabulary, a Ulysses
degree u from ``ulysses_sizes`` with the query and key / value heads divisible by TP x u and TP x u
within a node (Ulysses runs on DeepSpeed's model engine: PP 1), a context-parallel degree c from ``cp_sizes``
(the ring: any PP, across nodes too; not with Ulysses), PP a divisor of num_gpus / (TP x u x c) no larger than the
layer count, DP the rest, sequence parallelism off and (at
TP > 1) on, every micro-batch size in ``micro_batch_sizes`` that divides global_batch / DP,
recomputation on and off, ZeRO stages 0 and 1 (any PP) and 2 and 3 (PP 1; ZeRO-3 also with hpZ
groups of one node, cut from the DP x u x c ranks). A layout runs a sequence length divisible by u (x TP with SP),
by 2c under CP (its load-balanced chunks).
Each layout with PP > 1 is tried under every pipeline schedule asked for that runs it (1F1B, ZB-H1, interleaved
with v virtual stages: ``schedule_variants``). A layout fits when its busiest stage's predicted memory is at most
MEMORY_HEADROOM of the GPU's memory.

``longest_sequence`` answers the other question: the longest sequence (a multiple of 256) that some
layout of a family (plain, +SP, +Ulysses, +both) fits, found by doubling and then bisection;
``longest_sequence_of_layout`` the same for one given layout (a context-parallel one, for instance).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

from megatron.config.schedules import get as get_schedule
from megatron.planner.candidate import Layout
from megatron.planner.memory import MEMORY_HEADROOM, MemoryEstimate, estimate_memory
from megatron.planner.performance import StepEstimate, estimate_step
from megatron.planner.schedule_costs import SCHEDULES, check_schedule
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
        return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "sequence_parallel": lay.sequence_parallel,
                "ulysses": lay.ulysses, "cp": lay.cp, "sequence": lay.sequence_label,
                "micro_batch_size": lay.micro_batch_size,
                "num_micro_batches": self.num_micro_batches,
                "recompute": lay.recompute, "zero_stage": lay.zero_stage, "hpz": lay.hpz, "zero": lay.zero_label,
                "memory_gib": round(self.memory.peak / 2 ** 30, 2), "peak_stage": self.memory.peak_stage,
                "fits": self.fits, "step_s": round(st.step_s, 3),
                "hardware_tflops_per_gpu": round(st.hardware_tflops_per_gpu, 1),
                "model_tflops_per_gpu": round(st.model_tflops_per_gpu, 1), "mfu": round(st.mfu, 4),
                "tokens_per_s": round(st.tokens_per_s, 1), "bubble_fraction": round(st.bubble_s / st.step_s, 4),
                "schedule": lay.schedule, "virtual_stages": lay.virtual_stages,
                "components_s": {k: round(v, 3) for k, v in st.components_s.items()}}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: ModelShape, num_gpus: int, gpus_per_node: int, global_batch_size: int,
                      micro_batch_sizes: Iterable[int] = (1, 2, 4, 8), recompute: Iterable[bool] = (True, False),
                      zero_stages: Iterable[int] = (1, 0, 2, 3), precision: str = "bf16",
                      partition_method: str = "type:transformer", sequence_parallel: Iterable[bool] = (False,),
                      ulysses_sizes: Iterable[int] = (1,), store_attention_scores: bool = True,
                      ulysses_across_nodes: bool = False, ep_sizes: Iterable[int] = (1,),
                      cp_sizes: Iterable[int] = (1,)) -> list[Layout]:
    """Every layout of the module docstring's rules; ``ulysses_across_nodes`` lets TP x u exceed a node."""
    out = _dense_candidates(model, num_gpus, gpus_per_node, global_batch_size, micro_batch_sizes, recompute,
                            zero_stages, precision, partition_method, sequence_parallel, ulysses_sizes,
                            store_attention_scores, ulysses_across_nodes, tuple(cp_sizes))
    return [dataclasses.replace(layout, ep=ep) if ep > 1 else layout for layout in out for ep in ep_sizes
            if ep == 1 or (model.moe is not None and _runs_experts(model, layout, ep))]


def _runs_experts(model: ModelShape, layout: Layout, ep: int) -> bool:
    """EP > 1 on a layout: carved from its DP ranks, an equal share of experts each, and ZeRO-0 / 1 / 2 (expert
    parallelism does not run under ZeRO-3: megatron.config.combinations). With Ulysses too: each rank routes its
    s / u tokens (the all-to-all bytes and activations count s / u), the experts' optimizer state is sharded over
    DP x u / EP ranks (``expert_replicas``)."""
    return (layout.dp % ep == 0 and model.moe.num_experts % ep == 0
            and layout.zero_stage <= 2 and model.moe.expert_ffn % layout.tp == 0)


def _dense_candidates(model, num_gpus, gpus_per_node, global_batch_size, micro_batch_sizes, recompute, zero_stages,
                      precision, partition_method, sequence_parallel, ulysses_sizes, store_attention_scores,
                      ulysses_across_nodes, cp_sizes=(1,)) -> list[Layout]:
    out = []
    kv_heads = model.num_key_value_heads or model.num_attention_heads
    for tp in _divisors(min(num_gpus, gpus_per_node)):
        if model.num_attention_heads % tp or model.vocab_size % tp:
            continue
        for u, c in ((u, c) for u in ulysses_sizes for c in cp_sizes if u == 1 or c == 1):  # one splits the sequence
            if num_gpus % (tp * u * c) or model.num_attention_heads % (tp * u) or kv_heads % (tp * u):
                continue
            if tp * u > gpus_per_node and not ulysses_across_nodes and u > 1:
                continue
            for pp in _divisors(num_gpus // (tp * u * c)):
                min_layers = model.num_layers + (2 if partition_method == "type:transformer|embedding" else 0)
                if pp > model.num_layers or min_layers // pp < 1 or (u > 1 and pp > 1):
                    continue
                dp = num_gpus // (tp * pp * u * c)
                for sp in sequence_parallel:
                    if sp and tp == 1:
                        continue  # nothing to split the sequence over
                    common = dict(sequence_parallel=sp, ulysses=u, cp=c, store_attention_scores=store_attention_scores)
                    out.extend(_batch_variants(tp, pp, dp, global_batch_size, micro_batch_sizes, recompute,
                                               zero_stages, precision, partition_method, gpus_per_node, common))
    return out


def _batch_variants(tp, pp, dp, global_batch_size, micro_batch_sizes, recompute, zero_stages, precision,
                    partition_method, gpus_per_node, common) -> list[Layout]:
    out = []
    replicas = dp * common["ulysses"] * common["cp"]  # ZeRO shards over the data-parallel x sequence ranks
    zero_stages = tuple(zero_stages)
    for mbs in micro_batch_sizes:
        if global_batch_size % (mbs * dp):
            continue
        for rc in recompute:
            for zero in zero_stages:
                if replicas == 1 and zero >= 1:
                    if zero > 1 or 0 in zero_stages:
                        continue  # nothing to shard
                    zero = 0  # ZeRO-1 over one rank: BF16_Optimizer with nothing sharded, the planner's stage 0
                if zero >= 2 and pp > 1:
                    continue  # ZeRO-2/3 run on DeepSpeed's model engine: one stage
                out.append(Layout(tp, pp, dp, mbs, rc, zero, precision, partition_method, **common))
                # hpZ: one group per node, of the dp x u x c ranks ZeRO-3 shards over (consecutive ranks of one TP rank)
                node_group = gpus_per_node // tp
                if zero == 3 and 1 < node_group < replicas and replicas % node_group == 0:
                    out.append(Layout(tp, pp, dp, mbs, rc, zero, precision, partition_method, hpz=node_group,
                                      **common))
    return out


def runs_sequence(layout: Layout, seq_length: int) -> bool:
    """Ulysses splits the sequence over u ranks, SP (within them) over t; CP into 2c chunks."""
    return seq_length % (layout.sequence_split * (2 if layout.cp > 1 else 1)) == 0


def plan_layouts(model: ModelShape, gpu: GPUSpec, cluster: ClusterSpec, num_gpus: int, seq_length: int,
                 global_batch_size: int, *, micro_batch_sizes: Iterable[int] = (1, 2, 4, 8),
                 recompute: Iterable[bool] = (True, False), zero_stages: Iterable[int] = (1, 0, 2, 3),
                 partition_method: str = "type:transformer", memory_limit: Optional[float] = None,
                 include_infeasible: bool = False, sequence_parallel: Iterable[bool] = (False,),
                 ulysses_sizes: Iterable[int] = (1,), store_attention_scores: bool = True,
                 ep_sizes: Iterable[int] = (1,), schedules: Iterable[str] = ("1f1b",),
                 virtual_stages: Iterable[int] = (2,), cp_sizes: Iterable[int] = (1,)) -> list[Plan]:
    """Every candidate layout with its memory and step estimates; fitting ones first, fastest first.
    ``ep_sizes``: the expert-parallel sizes to try on an MoE model (each must divide its experts).
    ``cp_sizes``: the context-parallel (ring attention) sizes to try.
    ``schedules``: the pipeline schedules to try on every layout with PP > 1 where they run (``schedule_variants``;
    "interleaved" with each of ``virtual_stages``)."""
    schedules, virtual_stages = tuple(schedules), tuple(virtual_stages)
    bad = [name for name in schedules if name not in SCHEDULES] + [f"v={v}" for v in virtual_stages if v < 2]
    if bad or not schedules:
        raise ValueError(f"schedules {schedules} / virtual_stages {virtual_stages}: {bad or 'none'} not plannable; "
                         f"use names from {SCHEDULES} and virtual stages >= 2")
    _check_positive(num_gpus, global_batch_size, seq_length)
    ep_sizes = tuple(ep_sizes)
    _check_ep_sizes(model, ep_sizes)
    limit = _limit(gpu, memory_limit)
    plans = []
    for layout in candidate_layouts(model, num_gpus, cluster.gpus_per_node, global_batch_size, micro_batch_sizes,
                                    recompute, zero_stages, "bf16", partition_method, sequence_parallel,
                                    ulysses_sizes, store_attention_scores, ep_sizes=ep_sizes,
                                    cp_sizes=cp_sizes):
        if not runs_sequence(layout, seq_length):
            continue
        for variant in schedule_variants(model, layout, global_batch_size, schedules, virtual_stages):
            try:
                memory = estimate_memory(model, variant, seq_length, global_batch_size)
            except ValueError:
                continue  # too few layers for this many stages
            step = estimate_step(model, variant, gpu, cluster, seq_length, global_batch_size)
            fits = memory.peak <= limit
            if fits or include_infeasible:
                plans.append(Plan(variant, memory, step, fits, variant.num_micro_batches(global_batch_size)))
    plans.sort(key=lambda p: (not p.fits, p.step.step_s, p.memory.peak))
    return plans


def schedule_variants(model: ModelShape, layout: Layout, global_batch_size: int, schedules: tuple,
                      virtual_stages: tuple) -> list[Layout]:
    """``layout`` under each of ``schedules`` that runs it (``megatron.planner.schedule_costs.check_schedule``: ZB-H1 on the
    pipeline engine with m >= p micro-batches in bf16 or at ZeRO 0, interleaved where the layers split into p x v
    equal chunks and m is a multiple of p); at PP 1 there is no pipeline to schedule: the layout itself."""
    if layout.pp == 1:
        return [layout]
    out, m = [], layout.num_micro_batches(global_batch_size)
    for name in schedules:
        chunked = get_schedule(name).uses_virtual_stages
        for v in (virtual_stages if chunked else (1,)):
            try:
                check_schedule(name, layout.pp, m, model.num_layers, v, layout.precision, layout.zero_stage)
            except ValueError:
                continue
            if chunked and layout.stage_layers is not None:
                continue  # an uneven partition: interleaving needs equal chunks
            out.append(dataclasses.replace(layout, schedule=name, virtual_stages=v))
    return out


def _check_ep_sizes(model: ModelShape, ep_sizes: tuple) -> None:
    if any(ep < 1 for ep in ep_sizes):
        raise ValueError(f"expert-parallel sizes {ep_sizes} must be positive")
    if model.moe is None:
        if any(ep > 1 for ep in ep_sizes):
            raise ValueError(f"expert-parallel sizes {ep_sizes} need an MoE model (ModelShape.moe); plan a dense "
                             f"model with EP 1")
        return
    bad = [ep for ep in ep_sizes if model.moe.num_experts % ep]
    if bad:
        raise ValueError(f"expert-parallel sizes {bad} do not divide the {model.moe.num_experts} experts; each EP "
                         f"rank holds an equal share: use divisors of {model.moe.num_experts}")


def _check_positive(num_gpus: int, global_batch_size: int, seq_length: int) -> None:
    if num_gpus < 1 or global_batch_size < 1 or seq_length < 1:
        raise ValueError(f"num_gpus {num_gpus}, global batch {global_batch_size} and seq length {seq_length} "
                         f"must be positive")


def _limit(gpu: GPUSpec, memory_limit: Optional[float]) -> float:
    return gpu.memory_bytes * MEMORY_HEADROOM if memory_limit is None else memory_limit


# (name, sequence parallelism options, whether Ulysses degrees beyond 1 are allowed): +SP and +Ulysses each
# contain 3D/ZeRO, and +SP+Ulysses contains all three, so their longest sequences are at least as long
# (+SP and +Ulysses are not ordered).
SEQUENCE_FAMILIES = (("3D/ZeRO", (False,), False), ("+SP", (False, True), False),
                     ("+Ulysses", (False,), True), ("+SP+Ulysses", (False, True), True))
SEQUENCE_STEP = 256          # the answer is a multiple of this
MAX_SEQUENCE = 1 << 24       # doubling stops here (16M tokens)


@dataclasses.dataclass(frozen=True)
class LongestSequence:
    family: str
    recompute: bool
    seq_length: int                 # 0: not even SEQUENCE_STEP tokens fit
    plan: Optional[Plan]            # the fastest fitting layout at seq_length


def longest_sequence(model: ModelShape, gpu: GPUSpec, cluster: ClusterSpec, num_gpus: int, global_batch_size: int,
                     *, sequence_parallel: Iterable[bool] = (False,), ulysses_sizes: Iterable[int] = (1,),
                     recompute: bool = True, micro_batch_sizes: Iterable[int] = (1,),
                     zero_stages: Iterable[int] = (0, 1, 2, 3), partition_method: str = "type:transformer",
                     store_attention_scores: bool = False, memory_limit: Optional[float] = None,
                     family: str = "") -> LongestSequence:
    """The longest multiple of SEQUENCE_STEP tokens that some candidate layout fits in memory.

    Every layout's memory grows with the sequence, so "some layout fits" is monotone in it: double
    from SEQUENCE_STEP until nothing fits, then bisect between the last fit and the first miss.
    """
    _check_positive(num_gpus, global_batch_size, SEQUENCE_STEP)
    limit = _limit(gpu, memory_limit)
    layouts = candidate_layouts(model, num_gpus, cluster.gpus_per_node, global_batch_size, micro_batch_sizes,
                                (recompute,), zero_stages, "bf16", partition_method, tuple(sequence_parallel),
                                tuple(ulysses_sizes), store_attention_scores)

    def fits(steps: int) -> bool:
        seq = steps * SEQUENCE_STEP
        for layout in layouts:
            if not runs_sequence(layout, seq):
                continue
            try:
                if estimate_memory(model, layout, seq, global_batch_size).peak <= limit:
                    return True
            except ValueError:
                continue
        return False

    if not fits(1):
        return LongestSequence(family, recompute, 0, None)
    seq = _most_steps_that_fit(fits) * SEQUENCE_STEP
    plans = plan_layouts(model, gpu, cluster, num_gpus, seq, global_batch_size, micro_batch_sizes=micro_batch_sizes,
                         recompute=(recompute,), zero_stages=zero_stages, partition_method=partition_method,
                         memory_limit=limit, sequence_parallel=tuple(sequence_parallel),
                         ulysses_sizes=tuple(ulysses_sizes), store_attention_scores=store_attention_scores)
    return LongestSequence(family, recompute, seq, plans[0])


def _most_steps_that_fit(fits) -> int:
    """The largest n with ``fits(n)``, given ``fits(1)`` and that fitting is monotone: doubling, then bisection."""
    good, bad = 1, 2
    while fits(bad):
        good, bad = bad, 2 * bad
        if bad * SEQUENCE_STEP > MAX_SEQUENCE:
            raise ValueError(f"more than {MAX_SEQUENCE} tokens fit: a memory limit this large is not meaningful")
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def longest_sequences(model: ModelShape, gpu: GPUSpec, cluster: ClusterSpec, num_gpus: int, global_batch_size: int,
                      ulysses_sizes: Iterable[int] = (1, 2, 4, 8), **kwargs) -> list[LongestSequence]:
    """``longest_sequence`` for each of SEQUENCE_FAMILIES, with activation checkpointing and without."""
    out = []
    for recompute in (False, True):
        for name, sp, ulysses in SEQUENCE_FAMILIES:
            sizes = tuple(ulysses_sizes) if ulysses else (1,)
            out.append(longest_sequence(model, gpu, cluster, num_gpus, global_batch_size, sequence_parallel=sp,
                                        ulysses_sizes=sizes, recompute=recompute, family=name, **kwargs))
    return out


def longest_sequence_of_layout(model: ModelShape, layout: Layout, gpu: GPUSpec, global_batch_size: int,
                               memory_limit: Optional[float] = None) -> int:
    """The longest multiple of SEQUENCE_STEP tokens that this one layout runs and fits (0: not even one step);
    by doubling and bisection, as ``longest_sequence`` does over a family."""
    limit = _limit(gpu, memory_limit)

    def fits(steps: int) -> bool:
        seq = steps * SEQUENCE_STEP
        return runs_sequence(layout, seq) and estimate_memory(model, layout, seq, global_batch_size).peak <= limit

    if not fits(1):
        return 0
    return _most_steps_that_fit(fits) * SEQUENCE_STEP
