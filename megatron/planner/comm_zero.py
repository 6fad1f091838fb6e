"""The data-parallel collectives of one optimizer step under DeepSpeed ZeRO-2, ZeRO-3 and hpZ (one pipeline stage).

What one rank issues in one ``ModelEngine.train_batch`` of m micro-batches over d data-parallel ranks (with
DeepSpeed-Ulysses, d = dp x sp: ZeRO shards over the sequence-parallel ranks too; "dp" below is that group)
(derived from deepspeed/runtime/zero/stage_1_and_2.py, stage3.py, partitioned_param_coordinator.py and
partition_parameters.py of the pinned DeepSpeed (``megatron.engine.deepspeed_compat.PINNED_VERSION``), and
measured equal by tests/planner/test_comm_zero.py):

ZeRO-2 (``DeepSpeedZeroOptimizer``, reduce_scatter and use_multi_rank_bucket_allreduce on, DeepSpeed's defaults)
  dp all_reduce       per micro-batch, the gradients in buckets of reduce_bucket_size elements (a gradient
                      closes the bucket when it would overflow it; one larger than the bucket goes alone),
                      each bucket ALL-REDUCED whole in the gradients' dtype: despite ``reduce_scatter``, the
                      multi-rank bucket all-reduce sends every element, not 1/d; 2 + 1 fp32 scalars per step:
                      the squared gradient norm of each optimizer group, and the engine's mean loss; with
                      bf16's check_grad_overflow (default on) a uint8 overflow flag too
  dp all_gather       after the step, per optimizer group, this rank's 1/d of the updated weights (the group
                      flattened and padded to a multiple of 2 d)
  tp all_reduce       TP > 1: the squared norm per optimizer group (and the overflow flag) again, over tp
ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``)
  dp reduce_scatter   per micro-batch, the gradients in buckets as above; each parameter padded to a multiple of d
  dp all_gather       fetches: each module's own non-persistent parameters (numel > stage3_param_persistence_
                      threshold), this rank's ceil(n / d) of each, one coalesced call per module
                      (stage3_prefetch_bucket_size 0; with prefetching the coordinator coalesces several
                      modules into one call: the bytes stay, the calls drop, and are not predicted)
                      - stage3_max_reuse_distance >= everything the step touches: each module once per
                        micro-batch, in forward; the parameters stay gathered through backward
                      - stage3_max_reuse_distance 0: released after every use, so gathered in forward, again
                        in backward, and again for a recomputed layer's replay (all its modules but the MLP's
                        output projection: the replay stops before it); the tied word embedding is fetched
                        twice in forward (its module, then the output head) and not in backward
                      after the step: each persistent parameter alone, ceil(n / d) of it
  hpz all_gather      --zero-hpz-partition-size K (with reuse distance 0): only the step's first forward gathers
                      the primary shards over dp (the update invalidated the secondary copy); every later pass
                      (each backward, the next micro-batches' forwards: 2 m - 1 passes) gathers the secondary
                      shard, (ceil(n / d) d) / K of each parameter, in the hpZ group, each module once a pass
                      (the tied embedding too: its head use is served in backward)
  dp all_reduce       an fp64 squared gradient norm per optimizer group (TP > 1: also over tp), and the fp32 mean loss
"""

from __future__ import annotations

import dataclasses
from typing import Optional

MEMORY_OPT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)


@dataclasses.dataclass(frozen=True)
class ZeroSettings:
    """The zero_optimization values the count depends on, with the pinned DeepSpeed's defaults."""

    stage: int
    reduce_bucket_size: int = MEMORY_OPT_BUCKET
    param_persistence_threshold: int = 100_000
    prefetch_bucket_size: int = 50_000_000
    max_reuse_distance: int = 1_000_000_000
    max_live_parameters: int = 1_000_000_000
    hpz_partition_size: int = 1
    check_grad_overflow: bool = False  # ZeRO-2 only: bf16.check_grad_overflow (on by default with bf16), fp16

    @classmethod
    def from_deepspeed_config(cls, config: dict) -> "ZeroSettings":
        """Read them from a DeepSpeed config dict (``megatron.config.deepspeed.build_deepspeed_config``'s)."""
        z = config.get("zero_optimization", {})
        keys = {"reduce_bucket_size": "reduce_bucket_size",
                "param_persistence_threshold": "stage3_param_persistence_threshold",
                "prefetch_bucket_size": "stage3_prefetch_bucket_size",
                "max_reuse_distance": "stage3_max_reuse_distance",
                "max_live_parameters": "stage3_max_live_parameters",
                "hpz_partition_size": "zero_hpz_partition_size"}
        bf16 = config.get("bf16", {})
        overflow = int(z.get("stage", 0)) == 2 and ((bf16.get("enabled", False) and bf16.get("check_grad_overflow", True))
                                                    or config.get("fp16", {}).get("enabled", False))
        return cls(int(z.get("stage", 0)), **{field: int(z[key]) for field, key in keys.items() if key in z},
                   check_grad_overflow=bool(overflow))


@dataclasses.dataclass(frozen=True)
class ModuleParams:
    """The model as ZeRO-3 fetches it: each module's own parameters (full numel on this TP rank), in forward
    order, split into the modules before the transformer layers, per layer, and after."""

    pre: list          # [(name, (numel, ...)), ...]
    layers: list       # per layer: [(name, (numel, ...)), ...]
    post: list
    tied_embedding: Optional[str] = None  # the word embedding's module name when the output head reuses it

    def all(self) -> list:
        return self.pre + [m for layer in self.layers for m in layer] + self.post

    def numels(self) -> list[int]:
        return [n for _, numels in self.all() for n in numels]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _bucket_calls(numels: list[int], per_bucket: int) -> int:
    """ZeRO-2/3's gradient buckets: a gradient that would overflow the bucket first reduces what is in it."""
    calls, current = 0, 0
    for n in numels:
        if current and current + n > per_bucket:
            calls, current = calls + 1, 0
        current += n
    return calls + (1 if current else 0)


def _add(out: dict, axis: str, op: str, calls: Optional[int], nbytes: int) -> None:
    if not nbytes:
        return
    entry = out.setdefault((axis, op), {"calls": 0, "bytes": 0})
    entry["calls"] = None if calls is None or entry["calls"] is None else entry["calls"] + calls
    entry["bytes"] += nbytes


def analytic_zero_counts(settings: ZeroSettings, modules: ModuleParams, group_numels: list[int], dp: int, tp: int,
                         num_micro_batches: int, param_bytes: int, recompute: bool = False) -> dict:
    """Expected {(axis, op): {"calls", "bytes"}} of one rank's data-parallel (and ZeRO's own TP) collectives
    in one step; ``calls`` is None where DeepSpeed's prefetch coalescing makes it unpredictable (module docstring).

    group_numels: this rank's parameters per optimizer group (full, unpartitioned); param_bytes: 2 in bf16,
    4 in fp32 (gradients and the gathered weights have the parameters' dtype). Combine with the model's own
    TP collectives (``comm_count.analytic_step_counts`` with one stage)."""
    if settings.stage not in (2, 3):
        raise ValueError(f"analytic_zero_counts counts ZeRO stages 2 and 3, got stage {settings.stage}; "
                         "use comm_count.analytic_step_counts for the pipeline engine's stages 0-1")
    m, out = num_micro_batches, {}
    grads = list(reversed(modules.numels()))  # backward finishes the gradients roughly last module first
    if settings.stage == 2:
        if dp > 1:
            _add(out, "dp", "all_reduce", m * _bucket_calls(grads, settings.reduce_bucket_size),
                 m * sum(grads) * param_bytes)
            align = 2 * dp
            _add(out, "dp", "all_gather_into_tensor", len(group_numels),
                 sum(_ceil_div(n, align) * align // dp for n in group_numels) * param_bytes)
            _add(out, "dp", "all_reduce", len(group_numels) + 1, 4 * (len(group_numels) + 1))  # norms, loss
        overflow = 1 if settings.check_grad_overflow else 0  # a uint8 flag, over dp and tp
        _add(out, "dp", "all_reduce", overflow, overflow)
        if tp > 1:
            _add(out, "tp", "all_reduce", len(group_numels) + overflow, 4 * len(group_numels) + overflow)
        return out
    if dp == 1:
        return out
    _add(out, "dp", "reduce_scatter_tensor", m * _bucket_calls(grads, settings.reduce_bucket_size),
         m * sum(_ceil_div(n, dp) * dp for n in grads) * param_bytes)
    # an fp64 squared norm per sub-group (one per optimizer group: each is below DeepSpeed's sub_group_size of 1e9
    # elements here), over dp and again over tp; the fp32 loss
    groups = len(group_numels)
    _add(out, "dp", "all_reduce", groups + 1, 8 * groups + 4)
    if tp > 1:
        _add(out, "tp", "all_reduce", groups, 8 * groups)
    persistent = [n for n in modules.numels() if n <= settings.param_persistence_threshold]
    if persistent:
        _add(out, "dp", "all_gather_into_tensor", len(persistent), sum(_ceil_div(n, dp) for n in persistent) * param_bytes)
    for (axis, op), (calls, elements) in _zero3_fetches(settings, modules, dp, recompute, m).items():
        _add(out, axis, op, calls, elements * param_bytes)
    return out


def _zero3_fetches(settings: ZeroSettings, modules: ModuleParams, dp: int, recompute: bool, m: int) -> dict:
    """The parameter fetches of m micro-batches: {(axis, "all_gather_into_tensor"): (calls or None, elements)}."""
    total = sum(modules.numels())
    threshold = settings.param_persistence_threshold
    keep = settings.max_reuse_distance >= 3 * total  # no parameter leaves before its last use in the step
    if not keep and settings.max_reuse_distance != 0:
        raise ValueError(f"stage3_max_reuse_distance {settings.max_reuse_distance} is neither 0 nor at least 3 x "
                         f"this rank's {total} parameter elements; the count models those two cases only")
    if settings.max_live_parameters < total:
        raise ValueError(f"stage3_max_live_parameters {settings.max_live_parameters} is below this rank's {total} "
                         "parameter elements; the count assumes the limit is never reached")
    hpz = settings.hpz_partition_size
    if hpz > 1 and (keep or recompute):
        raise ValueError("hpZ is counted with stage3_max_reuse_distance 0 and without recomputation only "
                         "(the cases measured)")

    def shard(numels, parts):  # what this rank hands to one fetch of a module: (fetched?, elements)
        fetched = [n for n in numels if n > threshold]
        return (1 if fetched else 0), sum(_ceil_div(n, dp) * dp // parts for n in fetched)

    def passes(mods, parts):
        units = [shard(numels, parts) for _, numels in mods]
        return sum(u[0] for u in units), sum(u[1] for u in units)

    everything = modules.all()
    forward = passes(everything, dp)
    predicted = settings.prefetch_bucket_size == 0

    def result(calls, elements, times=m):
        return (times * calls if predicted else None), times * elements

    if keep:
        return {("dp", "all_gather_into_tensor"): result(*forward)}
    tied = [mod for mod in everything if mod[0] == modules.tied_embedding]
    if hpz > 1:
        # Only the first forward after the step gathers the primary shard: the update invalidated the secondary
        # copy. Every later fetch (backward, and the next micro-batches' forward) gathers the secondary one in the
        # hpZ group, each module once a pass (the tied weight's second use, the head, is served in backward).
        secondary = passes(everything, hpz)
        return {("dp", "all_gather_into_tensor"): result(*forward, times=1),
                ("hpz", "all_gather_into_tensor"): result(*secondary, times=2 * m - 1)}
    head = passes(tied, dp)
    replay = (0, 0)
    if recompute:  # each recomputed layer replays all its modules but the last (the MLP's output projection)
        replay = passes([mod for layer in modules.layers for mod in layer[:-1]], dp)
    backward = passes([mod for mod in everything if mod[0] != modules.tied_embedding], dp)
    calls = forward[0] + head[0] + backward[0] + replay[0]
    elements = forward[1] + head[1] + backward[1] + replay[1]
    return {("dp", "all_gather_into_tensor"): result(calls, elements)}
