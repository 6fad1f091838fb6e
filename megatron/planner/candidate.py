"""One candidate parallel layout and how it splits the model's layers over pipeline stages."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.config import parallel_dims
from megatron.config.schedules import get as get_schedule
from megatron.parallel.pipeline_partition import stage_bounds
from megatron.parallel.state import _check_expert_size as check_expert_size
from megatron.planner.schedule_costs import LABELS, SCHEDULES
from megatron.planner.specs import ModelShape


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    recompute: bool = True              # full activation checkpointing of every transformer layer
    zero_stage: int = 1                 # 1: fp32 masters + Adam states sharded over DP; 0: replicated
    precision: str = "bf16"             # bf16 (BF16_Optimizer, fp32 grad accumulation) | fp16 (ZeRO 0) | fp32
    partition_method: str = "type:transformer"  # or "type:transformer|embedding" (BLOOM-176B)
    # transformer layers on each stage when known from the real partition (pretrain_gpt.py --dry-run
    # takes the engine's); None: ``layers_per_stage``'s, the same rule on the planner's model shape
    stage_layers: Optional[tuple[int, ...]] = None
    # stage_layers placed by the run's pipeline layout flags (megatron.config.pipeline_layout): interleaved chunks
    # need not be equal (the run checked them); False: interleaving needs layers divisible into PP x v chunks
    layout_flags: bool = False
    hpz: int = 1                        # ZeRO-3 only: ZeRO++ hpZ, a secondary weight shard per group of hpz DP ranks
    # Megatron sequence parallelism inside the TP group: norms, dropout and residuals on [s/t, b, h]
    # shards, each TP all-reduce a reduce-scatter + all-gather (a no-op at tp = 1)
    sequence_parallel: bool = False
    ulysses: int = 1                    # DeepSpeed-Ulysses degree: every layer on s/u tokens, all-to-all around attention
    # the core attention keeps its [np, s, s] softmax and dropout output for backward (Korthikanti's 5as/h);
    # False: a fused kernel (flash / flex / SDPA's fused ones) or selective recomputation of the core attention
    store_attention_scores: bool = True
    # expert parallelism: each MoE layer's experts split over ep of the DP ranks (megatron.planner.moe); with
    # etp = 1 below tp (--expert-tensor-parallel-size) the experts are whole and ep spans the stage's TP ranks too
    ep: int = 1
    etp: int = 0                        # 0: tp (the experts split over TP as the dense layers)
    # context parallelism (ring attention): every layer on s/cp tokens, key / value blocks passed around the ring
    # (megatron.planner.context_parallel); its ranks hold the same weights, like DP's
    cp: int = 1
    # the pipeline schedule (megatron.planner.schedule_costs): "1f1b", "zbh1" or "interleaved" with virtual_stages
    # chunks of layers per rank (Megatron-LM's --num-virtual-stages-per-pipeline-rank)
    schedule: str = "1f1b"
    virtual_stages: int = 1
    # bytes of Adam's two moments per parameter: 8 in fp32, 4 with both stored in bf16 / fp16 (Megatron-LM's
    # precision-aware optimizer, --exp-avg-dtype / --exp-avg-sq-dtype)
    adam_state_bytes: int = 8
    # --recompute-modules (selective; Megatron-LM's names): the parts of each layer kept as their inputs only
    # (megatron.planner.memory.recompute_saved_bytes); core_attn here drops the stored scores, as
    # store_attention_scores=False does
    recompute_modules: tuple[str, ...] = ()

    def __post_init__(self):
        if self.ulysses < 1 or self.cp < 1:
            raise ValueError(f"the Ulysses degree and the context-parallel size must be at least 1 (got "
                             f"{self.ulysses} and {self.cp})")
        if self.ulysses > 1 and self.cp > 1:
            raise ValueError(f"Ulysses {self.ulysses} and context parallelism {self.cp} both split the sequence; "
                             f"the run refuses them together: pick one")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {self.schedule!r} is not one the planner models; pick one of "
                             f"{SCHEDULES}")
        if (self.virtual_stages != 1) != get_schedule(self.schedule).uses_virtual_stages or self.virtual_stages < 1:
            raise ValueError(f"virtual_stages {self.virtual_stages} with schedule {self.schedule!r}: interleaved "
                             f"runs v >= 2 chunks per rank, the other schedules 1")
        # the run's own rule (EP divides DP; with etp < tp the stage's tp x seq x dp ranks)
        check_expert_size(self.dp, self.ep, self.tp, self.etp or None, self.ulysses * self.cp)

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts: the expert-data-parallel group, DP / EP (ZeRO shards the experts'
        optimizer state over them); with etp < tp, the stage's tp x seq x dp ranks / (etp x ep)."""
        return self.weight_replicas * self.tp // (self.expert_tp * self.ep)

    @property
    def expert_tp(self) -> int:
        """The ranks each expert is split over (``etp``; tp where it is 0)."""
        return self.etp or self.tp

    @property
    def zero_label(self) -> str:
        return f"{self.zero_stage}+hpZ{self.hpz}" if self.hpz > 1 else str(self.zero_stage)

    def sizes(self) -> dict[str, int]:
        """The run's parallel dimensions (``megatron.config.parallel_dims``) by short name."""
        return dict(tp=self.tp, pp=self.pp, dp=self.dp, sp=self.ulysses, cp=self.cp, ep=self.ep,
                    vp=self.virtual_stages)

    @property
    def world_size(self) -> int:
        return parallel_dims.world_size(self.sizes())

    @property
    def weight_replicas(self) -> int:
        """Ranks holding the same weights: DP x Ulysses x CP (a sequence group's ranks see the same parameters
        and different tokens). ZeRO shards over them and gradients are averaged over them."""
        return parallel_dims.zero_shards(self.sizes())

    @property
    def sequence_split(self) -> int:
        """How many ranks share one sample's tokens outside the TP region: Ulysses x CP x (TP with SP)."""
        return self.ulysses * self.cp * (self.tp if self.sequence_parallel else 1)

    @property
    def token_split(self) -> int:
        """How many ranks share one sample's tokens everywhere, the TP region included: Ulysses x CP."""
        return self.ulysses * self.cp

    def num_micro_batches(self, global_batch_size: int) -> int:
        per_step = self.micro_batch_size * self.dp
        if global_batch_size % per_step:
            raise ValueError(f"global batch {global_batch_size} is not divisible by micro-batch "
                             f"{self.micro_batch_size} x DP {self.dp}")
        return global_batch_size // per_step

    @property
    def sequence_label(self) -> str:
        """"SP", "U2", "SP+U2", "CP2", "SP+CP2" or "" (none)."""
        parts = (["SP"] if self.sequence_parallel else []) + ([f"U{self.ulysses}"] if self.ulysses > 1 else [])
        parts += [f"CP{self.cp}"] if self.cp > 1 else []
        return "+".join(parts)

    @property
    def schedule_label(self) -> str:
        """"1F1B", "ZB-H1" or "interleaved 1F1B v=2"."""
        return LABELS[self.schedule] + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")

    def short(self) -> str:
        seq = f" {self.sequence_label}" if self.sequence_label else ""
        seq += f" EP={self.ep}" if self.ep > 1 else ""
        schedule = f" {self.schedule_label}" if self.schedule != "1f1b" else ""
        return (f"TP={self.tp} PP={self.pp} DP={self.dp}{seq} MBS={self.micro_batch_size} "
                f"{'recompute' if self.recompute else 'no-recompute'} ZeRO-{self.zero_label} {self.precision}{schedule}")


def stage_layer_counts(model: ModelShape, layout: Layout) -> list[int]:
    """Transformer layers on each stage of ``layout``: its ``stage_layers``, else ``layers_per_stage``."""
    if layout.stage_layers is not None:
        if len(layout.stage_layers) != layout.pp or sum(layout.stage_layers) != model.num_layers:
            raise ValueError(f"stage_layers {layout.stage_layers} must give {layout.pp} stages holding "
                             f"{model.num_layers} layers in all")
        return list(layout.stage_layers)
    return layers_per_stage(model, layout.pp, layout.partition_method, layout.tp)


def pipeline_item_names(model: ModelShape) -> list[str]:
    """The class names of the pipeline engine's items for ``model`` (``megatron.engine.pipeline.layer_specs`` in
    BLOOM's numbering: three parameter-free slots around the embedding and the transformer layers), which a
    ``type:REGEX`` partition matches; tests/planner/test_planner.py checks them against the engine's."""
    head = "LMHeadPipe" if model.tied_embeddings else "OutputLayer"
    return (["pass_through", "EmbeddingPipe", "pass_through"] + ["TransformerLayer"] * model.num_layers
            + ["end_of_layers", "FinalLayerNorm", head])


def pipeline_item_params(model: ModelShape, tp: int = 1) -> list[int]:
    """Each pipeline item's parameters on one TP rank, as the ``parameters`` partition counts them (the tied
    head's module is the word embedding itself), aligned with ``pipeline_item_names``."""
    h, word = model.hidden_size, model.vocab_size * model.hidden_size // tp
    embedding = word + model.learned_positions * h + (model.norm_params if model.embed_layernorm else 0)
    layers = [sum(model.layer_params_split(i, tp)) for i in range(model.num_layers)]
    return [0, embedding, 0] + layers + [0, model.norm_params, word]


def layers_per_stage(model: ModelShape, pp: int, partition_method: str = "type:transformer", tp: int = 1) -> list[int]:
    """Transformer layers on each stage under ``--pp-partition-method partition_method``: the pipeline engine's
    rule (``megatron.parallel.pipeline_partition``) on this model's pipeline items. E.g. 70 layers on 12 stages:
    6 x 10, then 5, 5 with 'type:transformer'; 5, 6 x 10, 5 with 'type:transformer|embedding' (the embedding
    weighs as a layer of the first stage)."""
    names = pipeline_item_names(model)
    params = pipeline_item_params(model, tp) if partition_method == "parameters" else None
    bounds = stage_bounds(partition_method, names, pp, params)
    counts = [names[start:stop].count("TransformerLayer") for start, stop in zip(bounds, bounds[1:])]
    if min(counts) < 1:
        raise ValueError(f"{model.num_layers} layers cannot fill {pp} pipeline stages with --pp-partition-method "
                         f"{partition_method} ({counts} transformer layers per stage)")
    return counts
