"""One candidate parallel layout and how it splits the model's layers over pipeline stages."""

from __future__ import annotations

import dataclasses
from typing import Optional

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
    # takes DeepSpeed's); None: ``layers_per_stage``'s rule for ``partition_method``
    stage_layers: Optional[tuple[int, ...]] = None
    hpz: int = 1                        # ZeRO-3 only: ZeRO++ hpZ, a secondary weight shard per group of hpz DP ranks
    # Megatron sequence parallelism inside the TP group: norms, dropout and residuals on [s/t, b, h]
    # shards, each TP all-reduce a reduce-scatter + all-gather (a no-op at tp = 1)
    sequence_parallel: bool = False
    ulysses: int = 1                    # DeepSpeed-Ulysses degree: every layer on s/u tokens, all-to-all around attention
    # the core attention keeps its [np, s, s] softmax and dropout output for backward (Korthikanti's 5as/h);
    # False: a fused kernel (flash / flex / SDPA's fused ones) or selective recomputation of the core attention
    store_attention_scores: bool = True

    def __post_init__(self):
        if self.ulysses < 1:
            raise ValueError(f"the Ulysses degree must be at least 1 (got {self.ulysses})")

    @property
    def zero_label(self) -> str:
        return f"{self.zero_stage}+hpZ{self.hpz}" if self.hpz > 1 else str(self.zero_stage)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.ulysses

    @property
    def weight_replicas(self) -> int:
        """Ranks holding the same weights: DP x Ulysses (a sequence group's ranks see the same parameters
        and different tokens). ZeRO shards over them and gradients are averaged over them."""
        return self.dp * self.ulysses

    @property
    def sequence_split(self) -> int:
        """How many ranks share one sample's tokens outside the TP region: Ulysses x (TP with SP)."""
        return self.ulysses * (self.tp if self.sequence_parallel else 1)

    def num_micro_batches(self, global_batch_size: int) -> int:
        per_step = self.micro_batch_size * self.dp
        if global_batch_size % per_step:
            raise ValueError(f"global batch {global_batch_size} is not divisible by micro-batch "
                             f"{self.micro_batch_size} x DP {self.dp}")
        return global_batch_size // per_step

    @property
    def sequence_label(self) -> str:
        """"SP", "U2", "SP+U2" or "" (neither)."""
        parts = (["SP"] if self.sequence_parallel else []) + ([f"U{self.ulysses}"] if self.ulysses > 1 else [])
        return "+".join(parts)

    def short(self) -> str:
        seq = f" {self.sequence_label}" if self.sequence_label else ""
        return (f"TP={self.tp} PP={self.pp} DP={self.dp}{seq} MBS={self.micro_batch_size} "
                f"{'recompute' if self.recompute else 'no-recompute'} ZeRO-{self.zero_label} {self.precision}")


def stage_layer_counts(model: ModelShape, layout: Layout) -> list[int]:
    """Transformer layers on each stage of ``layout``: its ``stage_layers``, else ``layers_per_stage``."""
    if layout.stage_layers is not None:
        if len(layout.stage_layers) != layout.pp or sum(layout.stage_layers) != model.num_layers:
            raise ValueError(f"stage_layers {layout.stage_layers} must give {layout.pp} stages holding "
                             f"{model.num_layers} layers in all")
        return list(layout.stage_layers)
    return layers_per_stage(model, layout.pp, layout.partition_method)


def layers_per_stage(model: ModelShape, pp: int, partition_method: str = "type:transformer") -> list[int]:
    """Transformer layers on each stage, as DeepSpeed's ``partition_balanced`` assigns them.

    Checked against deepspeed 0.19.8: with 'type:transformer' the first L % p stages get one layer
    more (70 layers on 12 stages: 6 x 10, then 5, 5); with 'type:transformer|embedding' the two
    embeddings count as layers of the first and last stage (70 on 12: 5, 6 x 10, 5).
    """
    if partition_method == "type:transformer|embedding":
        units = model.num_layers + 2
        base, extra = divmod(units, pp)
        counts = [base + (1 if i < extra else 0) for i in range(pp)]
        counts[0] -= 1
        counts[-1] -= 1
    else:
        base, extra = divmod(model.num_layers, pp)
        counts = [base + (1 if i < extra else 0) for i in range(pp)]
    if min(counts) < 1 or sum(counts) != model.num_layers:
        raise ValueError(f"{model.num_layers} layers cannot fill {pp} pipeline stages ({counts})")
    return counts
