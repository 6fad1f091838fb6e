"""The parallel dimensions of a run, in one list: what each is called, which flag sets it, how it splits the world.

    name  flag                                    world  ZeRO  on resume of a regular checkpoint
    tp    --tensor-model-parallel-size            x            must match (weight files per TP rank)
    pp    --pipeline-model-parallel-size          x            must match (layer files per stage)
    dp    (derived: world / the other factors)    x      x     must match when the optimizer state loads
    sp    --ds-sequence-parallel-size (Ulysses)   x      x     must match when the optimizer state loads
    cp    --context-parallel-size (ring attn.)    x      x     only dp x cp must match (the weights do not depend on it)
    ep    --expert-model-parallel-size                         must match (one expert file per EP rank); carved from dp
    vp    --num-virtual-stages-per-pipeline-rank               must match when the optimizer state loads (which layers
                                                               a rank's optimizer shard holds)

"world": the size is a factor of the world size (world = tp x pp x dp x sp x cp, ``megatron.parallel.state``'s
rank order, TP innermost). "ZeRO": the ranks along it hold the same weights and ZeRO shards the optimizer state
over them (dp x sp x cp ranks of one (pipe, model) coordinate). The config derivation
(``megatron.arguments.flag_steps.derive_parallel``), ``ParallelConfig``, ``megatron.parallel.state``, the run
record (``megatron.checkpoint.run_state``), the resume checks (``megatron.checkpoint.resume``) and the planner
read this list; a new dimension is one entry here plus its groups in ``megatron.parallel.state``.

Pure: imports nothing of torch or megatron.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

__all__ = ["Dimension", "DIMENSIONS", "BY_NAME", "WORLD", "ZERO_SHARDED", "joint_label", "world_size",
           "zero_shards", "divide_world", "check_world", "recorded_sizes", "resume_mismatches"]


@dataclasses.dataclass(frozen=True)
class Dimension:
    name: str                # short name: tp, pp, dp, sp, cp, ep, vp (GroupLayout's fields)
    field: str               # ParallelConfig's attribute and run_state.json's "parallel" key
    flag: Optional[str]      # the command-line flag; None: derived (dp)
    label: str               # words for messages
    multiplies_world: bool   # a factor of the world size
    shards_zero: bool        # ZeRO shards the optimizer state over its ranks (they hold the same weights)
    # when a regular checkpoint must have been saved at the same size: "always", "optimizer" (only when its
    # optimizer state loads), or "zero_shards" (only through the product of the ZeRO-sharding dimensions)
    on_resume: str
    recorded_always: bool = False  # written into run_state.json even at size 1 (older records have only these)

    @property
    def named(self) -> str:
        """How messages name it: the flag, or the label of a derived size."""
        return self.flag or self.label


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("tp", "tensor_model_parallel_size", "--tensor-model-parallel-size", "tensor-model-parallel size",
              True, False, "always", recorded_always=True),
    Dimension("pp", "pipeline_model_parallel_size", "--pipeline-model-parallel-size", "pipeline-model-parallel size",
              True, False, "always", recorded_always=True),
    Dimension("dp", "data_parallel_size", None, "data-parallel size", True, True, "optimizer", recorded_always=True),
    Dimension("sp", "ds_sequence_parallel_size", "--ds-sequence-parallel-size", "sequence-parallel size",
              True, True, "optimizer"),
    Dimension("cp", "context_parallel_size", "--context-parallel-size", "context-parallel size",
              True, True, "zero_shards"),
    Dimension("ep", "expert_model_parallel_size", "--expert-model-parallel-size", "expert-model-parallel size",
              False, False, "always"),
    Dimension("vp", "num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank",
              "virtual pipeline stages per rank", False, False, "optimizer"),
)
BY_NAME = {d.name: d for d in DIMENSIONS}
WORLD = tuple(d for d in DIMENSIONS if d.multiplies_world)
ZERO_SHARDED = tuple(d for d in DIMENSIONS if d.shards_zero)


def joint_label(dims) -> str:
    """Words for the product of ``dims``: "data-parallel x context-parallel size"."""
    return " x ".join(d.label.removesuffix(" size") for d in dims) + " size"


def world_size(sizes: Mapping[str, int]) -> int:
    """The product of the world's factors in ``sizes`` (short names; an absent one is 1)."""
    return math.prod(sizes.get(d.name, 1) for d in WORLD)


def zero_shards(sizes: Mapping[str, int]) -> int:
    """Ranks holding the same weights, over which ZeRO shards the optimizer state: dp x sp x cp."""
    return math.prod(sizes.get(d.name, 1) for d in ZERO_SHARDED)


def _factors(sizes: Mapping[str, int], skip: str = "") -> list[Dimension]:
    return [d for d in WORLD if d.name != skip and (sizes.get(d.name, 1) > 1 or d.recorded_always)]


def divide_world(world: int, sizes: Mapping[str, int]) -> int:
    """The data-parallel size: ``world`` over every other factor in ``sizes`` (the flags), or a ValueError
    naming the flags and the fix."""
    given = {d.name: sizes.get(d.name, 1) for d in WORLD if d.name != "dp"}
    bad = [f"{BY_NAME[n].named} {v}" for n, v in given.items() if not isinstance(v, int) or v < 1]
    if bad or world < 1:
        raise ValueError(f"world size {world}, {', '.join(f'{d.named} {given[d.name]}' for d in WORLD if d.flag)} "
                         f"must be positive" + (f" (got {', '.join(bad)})" if bad else ""))
    split = math.prod(given.values())
    if world % split:
        factors = " x ".join(f"{d.flag} {given[d.name]}" for d in _factors(given, skip="dp"))
        changed = "/".join(d.name.upper() for d in _factors(given, skip="dp"))
        raise ValueError(f"world size {world} is not a multiple of {factors} = {split}; launch a multiple of "
                         f"{split} processes or change {changed}")
    return world // split


def check_world(sizes: Mapping[str, int], world: Optional[int] = None) -> None:
    """Every size a positive integer; with ``world``, their product is it (else a ValueError naming each)."""
    for d in DIMENSIONS:
        value = sizes.get(d.name, 1)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{d.label} must be a positive integer, got {value!r}")
    if world is not None and world_size(sizes) != world:
        factors = " x ".join(f"{d.label} {sizes.get(d.name, 1)}" for d in _factors(sizes))
        raise ValueError(f"world size {world} != {factors} = {world_size(sizes)}; choose sizes whose product is the "
                         f"number of processes")


def recorded_sizes(sizes: Mapping[str, int]) -> dict[str, int]:
    """The ``parallel`` sizes of a run record (run_state.json): tp, pp, dp always, the others when > 1."""
    return {d.field: sizes[d.name] for d in DIMENSIONS
            if d.name in sizes and sizes[d.name] is not None and (d.recorded_always or sizes[d.name] > 1)}


def resume_mismatches(recorded: Mapping[str, int], now: Mapping[str, int], loads_optimizer: bool,
                      ) -> dict[str, tuple[Optional[int], int]]:
    """What a regular checkpoint saved with the ``recorded`` sizes (run_state.json's ``parallel``, by field)
    needs of a run with sizes ``now`` (by short name): {how a message names it: (then, now)} for each that
    must match, in DIMENSIONS' order (a size the record lacks: None if recorded always, else 1). The caller
    keeps the pairs that differ. With the ZeRO-sharding dimensions of on_resume "zero_shards" (cp) above 1 on
    either side, their product with the data-parallel size is compared instead of the data-parallel size."""
    then = {d.name: recorded.get(d.field, None if d.recorded_always else 1) for d in DIMENSIONS}
    pairs: dict[str, tuple[Optional[int], int]] = {}
    fold = [f for f in ZERO_SHARDED if f.on_resume == "zero_shards" and max(then[f.name], now.get(f.name, 1)) > 1]
    for d in DIMENSIONS:
        if d.on_resume == "zero_shards" or (d.on_resume == "optimizer" and not loads_optimizer):
            continue
        pair = (then[d.name], now.get(d.name, 1))
        if d.name == "dp" and fold and pair[0] is not None:
            pairs[f"{joint_label([d] + fold)} (ZeRO shards)"] = (
                pair[0] * math.prod(then[f.name] for f in fold), pair[1] * math.prod(now.get(f.name, 1) for f in fold))
        else:
            pairs[d.named] = pair
    return pairs
