"""The registry of pipeline schedules: one ``Schedule`` entry per schedule, the one place their formulas live.

p stages (pipeline ranks), m micro-batches per step, v virtual stages (chunks of layers) per rank, r a rank; one
"slot" is a stage's forward + backward of one micro-batch, F + B + W (B the input-gradient pass, W the
weight-gradient pass; 1F1B runs B + W as one backward). Each entry gives:

  name, label     "1f1b" / "1F1B", "zbh1" / "ZB-H1", "interleaved" / "interleaved 1F1B"
  flags           the command-line flags that choose it (``schedule_name`` reads them from a RunConfig)
  rules           what a layout needs (m >= p, L divisible by p v, m divisible by p, ...): the entry's booleans
                  (``micro_batches_at_least_stages``, ...), checked by ``check_layout`` with messages naming the
                  fix (the run's own checks, worded for the flags, are megatron/config/zero_bubble.py and
                  megatron/config/pipeline_schedule.py)
  warmup_forwards forwards (interleaved: chunk forwards) rank r runs before its first backward
  in_flight       micro-batches whose activations rank r holds at its peak (interleaved: chunk micro-batches / v)
  bubble_slots    idle slots per stage and step
  p2p_factor      the p2p bytes each rank sends, in multiples of 1F1B's
  deferred_weight_passes  W passes rank r keeps waiting at most (ZB-H1: r + 1; else 0)
  unit_costs      slots each compute instruction of its streams takes (F = B = W = 1; 1F1B's BackwardPass is
                  B + W = 2; interleaved: per chunk, 1/v of a stage's), what ``idle_slots`` replays them at

  1f1b         DeepSpeed's TrainSchedule: p - r - 1 warm-up forwards, min(p - r, m) in flight, p - 1 idle slots.
  zbh1         ZB-H1 (Qi et al. 2023; megatron/engine/schedules/zero_bubble.py): 1F1B's order with W deferred
               into the cool-down: (p - 1)(F + B - W) idle, (p - 1) / 3 slots at F = B = W. Needs m >= p.
  interleaved  Megatron-LM's interleaved 1F1B (megatron/engine/schedules/interleaved.py):
               2 (p - r - 1) + (v - 1) p warm-up chunk forwards, (p - 1) / v idle slots, v times 1F1B's p2p bytes.
               Needs L divisible by p v and m by p.

The timeline simulator, the one the tests and benchmarks/bench_pipeline_bubble.py count bubbles with:

    streams = schedule_streams(TrainSchedule, stages=4, micro_batches=8)   (megatron.engine.schedules.streams)
    idle_slots(streams, REGISTRY["1f1b"].unit_costs)                       -> [9, 9, 9, 9]
    analytic_idle_slots("1f1b", stages=4, micro_batches=8)                 -> 9, the registry's ``bubble``

``timeline`` replays every stage's instruction names as the engine runs them, each stage in its own order: a
compute instruction takes its cost in slots, a receive waits for the matching send of the neighbouring virtual
stage (the k-th ``RecvActivation`` of virtual stage s for the k-th ``SendActivation`` of s - 1; gradients from
s + 1; an instruction of chunk c on rank r, written ``(name, c)``, is virtual stage c p + r), a send never waits.
A stage's idle slots are the step's length (when the last stage finishes) minus its busy slots. On CPU, where time
is noisy, this is how the bubble is measured.

Who reads it: the planner (megatron/planner/schedule_costs.py: bubble, memory, p2p costs), the engine
(megatron/engine/initialize.py picks the engine class by ``schedule_name`` from megatron/engine/schedules'
``ENGINE_CLASSES``; megatron/engine/schedules/interleaved.py's warm-up), the dry run
(megatron/dry_run/estimate.py), and the tests of the engine's schedules (``idle_slots``).

Adding a fourth schedule: one ``Schedule`` entry here (its flag, rules and formulas; ``chosen_by`` reads its flag
from ``rc.parallel``), one engine module in megatron/engine/schedules/ (its DeepSpeed ``PipeSchedule`` and engine
class, registered in that package's ``ENGINE_CLASSES`` with the set-up it needs after ``deepspeed.initialize``, if
any) and one flag (megatron/arguments, a ``ParallelConfig`` field).

Pure Python: no torch, no deepspeed; imports nothing of megatron.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence, Union

__all__ = ["Schedule", "REGISTRY", "SCHEDULES", "LABELS", "DEFAULT", "get", "schedule_name", "virtual_stages_of",
           "check_layout", "ONE_F_ONE_B_COSTS", "ZERO_BUBBLE_COSTS", "Timeline", "timeline", "idle_slots",
           "analytic_idle_slots"]

ONE_F_ONE_B_COSTS = MappingProxyType({"ForwardPass": 1, "BackwardPass": 2})                  # backward = B + W
ZERO_BUBBLE_COSTS = MappingProxyType({"ForwardPass": 1, "BackwardPass": 1, "WeightPass": 1})  # backward = B; W apart


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One pipeline schedule: its names, flags, layout rules and formulas (see the module docstring)."""

    name: str
    label: str
    flags: tuple[str, ...]
    chosen_by: Callable[[object], bool]          # (rc.parallel) -> whether the run's flags choose it
    warmup: Callable[[int, int, int], int]       # (p, r, v) -> forwards before the first backward, uncapped
    bubble: Callable[[int, int, float], float]   # (p, v, W share of a slot) -> idle slots per stage and step
    uses_virtual_stages: bool = False            # v > 1 chunks per rank (else v = 1)
    micro_batches_at_least_stages: bool = False  # m >= p
    micro_batches_multiple_of_stages: bool = False  # m % p == 0
    fp32_needs_zero_0: bool = False
    defers_weight_passes: bool = False           # W passes wait beside the activations (ZB-H1)
    pipeline_engine_only: bool = False           # ZeRO stage <= 1
    # instruction name -> slots at unit costs, what ``idle_slots`` replays its streams at (not hashed: a dict)
    unit_costs: Mapping[str, int] = dataclasses.field(default_factory=lambda: ONE_F_ONE_B_COSTS, compare=False)

    def chunks(self, virtual_stages: int) -> int:
        return virtual_stages if self.uses_virtual_stages else 1

    def warmup_forwards(self, pp: int, num_micro_batches: int, rank: int, virtual_stages: int = 1) -> int:
        """(Chunk) forwards rank ``rank`` runs before its first backward, capped at all of them."""
        v = self.chunks(virtual_stages)
        return min(self.warmup(pp, rank, v), num_micro_batches * v)

    def in_flight(self, pp: int, num_micro_batches: int, rank: int, virtual_stages: int = 1) -> float:
        """Micro-batches of the rank's whole set of layers held at its peak (the first steady forward)."""
        v = self.chunks(virtual_stages)
        held = min(self.warmup_forwards(pp, num_micro_batches, rank, v) + 1, num_micro_batches * v)
        return held / v if v > 1 else held

    def bubble_slots(self, pp: int, virtual_stages: int = 1, weight_share: float = 1 / 3) -> float:
        """Idle slots per stage and step; ``weight_share``: W / (F + B + W) of a slot."""
        return self.bubble(pp, self.chunks(virtual_stages), weight_share)

    def deferred_weight_passes(self, num_micro_batches: int, rank: int) -> int:
        """The most W passes rank ``rank`` keeps waiting (after a backward, until the next W): r + 1, or 0."""
        return min(rank + 1, num_micro_batches) if self.defers_weight_passes else 0

    def p2p_factor(self, virtual_stages: int = 1) -> int:
        """Bytes each rank sends per step in multiples of 1F1B's (a micro-batch crosses p v - 1 boundaries)."""
        return self.chunks(virtual_stages)


REGISTRY: dict[str, Schedule] = {s.name: s for s in (
    Schedule("1f1b", "1F1B", (), lambda parallel: True,
             warmup=lambda p, r, v: p - r - 1, bubble=lambda p, v, w: float(p - 1), unit_costs=ONE_F_ONE_B_COSTS),
    Schedule("zbh1", "ZB-H1", ("--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"),
             lambda parallel: parallel.enable_zbh1_pipeline,
             warmup=lambda p, r, v: p - r - 1,
             bubble=lambda p, v, w: (p - 1) * (1 - 2 * w),  # (p - 1)(F + B - W) with F + B + W = 1
             micro_batches_at_least_stages=True, fp32_needs_zero_0=True, pipeline_engine_only=True,
             defers_weight_passes=True, unit_costs=ZERO_BUBBLE_COSTS),
    Schedule("interleaved", "interleaved 1F1B", ("--num-virtual-stages-per-pipeline-rank",),
             lambda parallel: parallel.num_virtual_stages_per_pipeline_rank > 1,
             warmup=lambda p, r, v: 2 * (p - r - 1) + (v - 1) * p, bubble=lambda p, v, w: (p - 1) / v,
             uses_virtual_stages=True, micro_batches_multiple_of_stages=True,
             unit_costs=ONE_F_ONE_B_COSTS),  # per chunk: F 1, B 2, each 1/v of a whole stage's
)}
DEFAULT = "1f1b"
SCHEDULES = tuple(REGISTRY)
LABELS = {name: s.label for name, s in REGISTRY.items()}


def get(name: str) -> Schedule:
    if name not in REGISTRY:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return REGISTRY[name]


def schedule_name(rc) -> str:
    """The schedule a RunConfig's flags choose: interleaved with v > 1 virtual stages per rank
    (--num-virtual-stages-per-pipeline-rank), else ZB-H1 with --enable-zbh1-pipeline, else DeepSpeed's 1F1B. The
    last registry entry whose flag is set wins (the combinations table refuses two at once)."""
    for schedule in reversed(REGISTRY.values()):
        if schedule.name != DEFAULT and schedule.chosen_by(rc.parallel):
            return schedule.name
    return DEFAULT


def virtual_stages_of(rc) -> int:
    """Virtual stages per rank the chosen schedule runs (1 unless it uses them)."""
    return get(schedule_name(rc)).chunks(rc.parallel.num_virtual_stages_per_pipeline_rank)


def check_layout(schedule: str, pp: int, num_micro_batches: int, num_layers: Optional[int], virtual_stages: int = 1,
                 precision: str = "bf16", zero_stage: int = 1) -> None:
    """ValueError naming the values and the fix when ``schedule`` cannot run this layout (its rules). num_layers
    None: the layers per chunk are given (the pipeline layout flags), not split evenly."""
    s = get(schedule)
    if s.micro_batches_at_least_stages and num_micro_batches < pp:
        raise ValueError(f"{s.label} at PP {pp} needs at least {pp} micro-batches per step, got "
                         f"{num_micro_batches}: raise the global batch or lower the micro-batch size")
    if s.fp32_needs_zero_0 and precision == "fp32" and zero_stage > 0:
        raise ValueError(f"{s.label} in fp32 needs ZeRO stage 0 (got {zero_stage}): fp32 ZeRO-1 collects gradients "
                         f"from autograd hooks that a deferred weight gradient never reaches; use bf16")
    if s.pipeline_engine_only and zero_stage >= 2:
        raise ValueError(f"{s.label} is a schedule of the pipeline engine, ZeRO stage {zero_stage} runs on the "
                         f"model engine: use ZeRO stage 0 or 1")
    if s.uses_virtual_stages:
        if pp < 2:
            raise ValueError(f"interleaved virtual stages need PP >= 2 (got {pp})")
        if num_layers is not None and num_layers % (pp * virtual_stages):
            raise ValueError(f"{num_layers} layers do not split into PP {pp} x {virtual_stages} virtual stages = "
                             f"{pp * virtual_stages} equal chunks: use a layer count that is a multiple of "
                             f"{pp * virtual_stages}, or fewer virtual stages")
    if s.micro_batches_multiple_of_stages and num_micro_batches % pp:
        raise ValueError(f"{s.label} at PP {pp} needs the micro-batches per step ({num_micro_batches}) to "
                         f"be a multiple of {pp}: change the global batch or the micro-batch size")


# ---- the timeline simulator ------------------------------------------------------------------------------------

Instruction = Union[str, tuple[str, int]]  # an instruction's name, or (name, chunk) for a schedule with chunks
_RECV_FROM = {"RecvActivation": ("SendActivation", -1), "RecvGrad": ("SendGrad", +1)}


@dataclasses.dataclass
class Timeline:
    """``timeline``'s result: the step's length and each stage's busy and idle time, in slots."""

    makespan: int
    busy: list[int]
    idle: list[int]

    def idle_fraction(self, stage: int) -> float:
        return self.idle[stage] / self.makespan


def _name_and_chunk(instruction: Instruction) -> tuple[str, int]:
    return (instruction, 0) if isinstance(instruction, str) else instruction


def timeline(streams: Sequence[Sequence[Instruction]], costs: Mapping[str, int]) -> Timeline:
    """Replay one step of ``streams`` (one per pipeline rank, in execution order; see the module docstring) with
    each compute instruction taking ``costs[name]`` slots. ValueError if the streams deadlock."""
    stages = len(streams)
    clock, position = [0] * stages, [0] * stages
    sent: dict[tuple[str, int], list[int]] = {}   # (send name, virtual stage) -> the slot of each send
    received: dict[tuple[str, int], int] = {}     # (receive name, virtual stage) -> receives done
    while any(position[s] < len(streams[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while position[s] < len(streams[s]):
                name, chunk = _name_and_chunk(streams[s][position[s]])
                virtual_stage = chunk * stages + s
                if name in _RECV_FROM:
                    send, offset = _RECV_FROM[name]
                    times = sent.get((send, virtual_stage + offset), [])
                    done = received.get((name, virtual_stage), 0)
                    if done >= len(times):
                        break  # the neighbour has not sent it yet
                    clock[s] = max(clock[s], times[done])
                    received[(name, virtual_stage)] = done + 1
                elif name in ("SendActivation", "SendGrad"):
                    sent.setdefault((name, virtual_stage), []).append(clock[s])
                clock[s] += costs.get(name, 0)
                position[s] += 1
                moved = True
        if not moved:
            raise ValueError(f"the streams deadlock at positions {position}: a receive without its send")
    busy = [sum(costs.get(_name_and_chunk(i)[0], 0) for i in stream) for stream in streams]
    makespan = max(clock)
    return Timeline(makespan, busy, [makespan - b for b in busy])


def idle_slots(streams: Sequence[Sequence[Instruction]], costs: Mapping[str, int]) -> list[int]:
    """Per stage, the slots it waits during the step the ``streams`` make (``timeline``'s idle)."""
    return timeline(streams, costs).idle


def analytic_idle_slots(schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> int:
    """Idle slots per stage and step at unit costs (a slot F + B + W = 3), from the entry's ``bubble``:
    1F1B (p - 1)(F + B + W) = 3(p - 1); ZB-H1 (Qi et al. 2023) (p - 1)(F + B - W) = p - 1, which needs
    micro_batches >= stages."""
    entry = get(schedule)
    if entry.micro_batches_at_least_stages and micro_batches < stages:
        raise ValueError(f"{entry.label}'s bubble needs micro-batches >= stages, got {micro_batches} < {stages}")
    return round(3 * entry.bubble_slots(stages, virtual_stages, weight_share=1 / 3))
