"""The pipeline bubble of 1F1B, ZB-H1 and interleaved 1F1B, side by side: idle slots counted from the schedules'
instruction streams against the analytic fractions, and (``--measure``) the step time of all three on this machine.

Counted: for each (stages p, micro-batches m), every stage's instruction stream of one step replayed at unit costs,
in units of one whole stage's pass (F = B = W = 1):
  1f1b, zbh1        DeepSpeed's TrainSchedule and our ZeroBubbleH1Schedule, replayed by the registry's
                    ``megatron.config.schedules.idle_slots`` (a receive waits for its send; 1F1B's backward B + W = 2)
  interleaved_v2/4  our InterleavedSchedule, replayed by the same ``idle_slots`` at the entry's unit costs (a
                    chunk's forward 1, its backward 2, each 1/v of a stage's), the idle chunk slots divided by v
against the planner's analytic idle slots (``megatron.planner.schedule_costs.bubble_slots``: (p - 1) slots of F + B + W
for 1F1B, (p - 1)(F + B - W) for ZB-H1, (p - 1) / v slots for interleaved) and the bubble's share of the step.
A layout a schedule cannot run (interleaved: m not a multiple of p) records the refusal instead.

Measured (``--measure``): a tiny BLOOM-style model (8 layers, hidden 64, seq 32, 8 micro-batches of 2, fp32) at
PP = 4 on 4 gloo processes: the three engines built in one launch (``pretrain`` for one iteration each), then
``train_batch`` on the same synthetic micro-batches timed ``--steps`` times per engine, the engines alternating for
``--rounds`` rounds; the median step per schedule and its ratio to 1F1B's, beside the ratio the counted slots
predict. On a shared CPU the ranks compete for the cores (idle pipeline slots are not idle CPU): the load average,
recorded before and after, says how much to trust it. Prints ONE JSON line.

    python -m benchmarks.bench_pipeline_bubble --measure --output benchmarks/results/pipeline_bubble_<date>.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from benchmarks import _common  # noqa: F401  (sets DS_ACCELERATOR before deepspeed is imported)
from benchmarks._common import emit, machine
from megatron.config.schedules import REGISTRY, idle_slots
from megatron.engine.schedules import ENGINE_CLASSES
from megatron.engine.schedules.streams import schedule_streams
from megatron.planner.schedule_costs import bubble_slots, check_schedule
from megatron.testing import make_tiny_corpus, run_distributed, tiny_argv

# (stages, micro-batches); 12: BLOOM-176B (12 at its rampup start, its final 128, and 132 for interleaving)
LAYOUTS = [(2, 4), (2, 8), (4, 8), (4, 16), (8, 32), (12, 12), (12, 128), (12, 132)]
VIRTUAL = (2, 4)
UNITS_PER_SLOT = 3  # a slot is F + B + W of one micro-batch through a whole stage
FLAGS = {"1f1b": [], "zbh1": ["--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"],
         "interleaved_v2": ["--num-virtual-stages-per-pipeline-rank", "2"]}
MEASURED_LAYOUT = {"stages": 4, "micro_batches": 8, "num_layers": 8}


def _row(idle: list[float], analytic_slots: float, micro_batches: int) -> dict:
    analytic = round(UNITS_PER_SLOT * analytic_slots, 6)
    busy = UNITS_PER_SLOT * micro_batches
    return {"idle_slots_per_stage": idle, "analytic_idle_slots": analytic,
            "bubble_fraction": max(idle) / (busy + max(idle)), "analytic_fraction": analytic / (busy + analytic)}


def _interleaved_idle(stages: int, micro_batches: int, v: int) -> list[float]:
    """Each rank's idle time in whole-stage units: the replayed timeline's idle chunk slots over v."""
    streams = schedule_streams(ENGINE_CLASSES["interleaved"].schedule_class, stages, micro_batches,
                               num_virtual_stages=v)
    return [round(idle / v, 6) for idle in idle_slots(streams, REGISTRY["interleaved"].unit_costs)]


def counted(stages: int, micro_batches: int) -> dict:
    """Per schedule: idle units per stage from the replayed streams, the planner's, and the bubble fractions."""
    row = {}
    for name in ("1f1b", "zbh1"):
        streams = schedule_streams(ENGINE_CLASSES[name].schedule_class, stages, micro_batches)
        idle = idle_slots(streams, REGISTRY[name].unit_costs)
        row[name] = _row(idle, bubble_slots(name, stages), micro_batches)
    for v in VIRTUAL:
        try:
            check_schedule("interleaved", stages, micro_batches, num_layers=stages * v, virtual_stages=v)
        except ValueError as refused:
            row[f"interleaved_v{v}"] = {"refused": str(refused)}
            continue
        row[f"interleaved_v{v}"] = _row(_interleaved_idle(stages, micro_batches, v),
                                        bubble_slots("interleaved", stages, v), micro_batches)
    return row


def _synthetic_micro_batches(micro_batch_size: int, seq_length: int, vocab: int):
    """An endless stream of micro-batches of seeded random tokens (the same on every rank and for every engine)."""
    import torch  # noqa: PLC0415 (in the spawned rank)

    from megatron.training.batches import gpt_micro_batch  # noqa: PLC0415 (in the spawned rank)

    generator = torch.Generator().manual_seed(0)
    while True:
        yield gpt_micro_batch(torch.randint(0, vocab, (micro_batch_size, seq_length + 1), generator=generator))


def _step_times(rank, world_size, argvs, steps, rounds):
    """On each rank: build each argv's engine (``pretrain`` for one iteration), then time ``steps`` more
    ``train_batch`` calls per engine, the engines alternating for ``rounds`` rounds; the seconds per step."""
    import torch.distributed as dist  # noqa: PLC0415 (in the spawned rank)

    from megatron.arguments import run_config_from_argv  # noqa: PLC0415 (in the spawned rank)
    from megatron.training.pretrain import pretrain  # noqa: PLC0415 (in the spawned rank)

    engines = []
    for argv in argvs:
        rc = run_config_from_argv(argv, world_size=world_size)
        engines.append(pretrain(rc).engine)
    data = _synthetic_micro_batches(rc.batch.micro_batch_size, rc.model.seq_length, rc.model.original_vocab_size)
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(rounds):
        for engine, out in zip(engines, times):
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                engine.train_batch(data)
                out.append(time.perf_counter() - start)
    return times


def measured(steps: int, rounds: int) -> dict:
    p, m = MEASURED_LAYOUT["stages"], MEASURED_LAYOUT["micro_batches"]
    corpus = make_tiny_corpus(tempfile.mkdtemp(prefix="bubble_bench_"))
    base = tiny_argv(corpus, num_layers=MEASURED_LAYOUT["num_layers"], global_batch_size=2 * m,
                     pipeline_model_parallel_size=p, train_iters=1, lr_warmup_iters=0, log_interval=1000)
    load_before = os.getloadavg()
    times = run_distributed(_step_times, world_size=p, args=([base + f for f in FLAGS.values()], steps, rounds),
                            timeout=1200)[0]
    step = {name: statistics.median(t) for name, t in zip(FLAGS, times)}
    slots = counted(p, m)
    predicted = {name: (UNITS_PER_SLOT * m + max(slots[name]["idle_slots_per_stage"])) for name in FLAGS}
    return {"median_step_s": step,
            "over_1f1b": {name: step[name] / step["1f1b"] for name in FLAGS},
            "counted_over_1f1b": {name: predicted[name] / predicted["1f1b"] for name in FLAGS},
            "steps": steps, "rounds": rounds, **MEASURED_LAYOUT,
            "model": "8 layers, hidden 64, seq 32, micro-batch 2, fp32",
            "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="also time the three schedules on 4 local processes")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per engine and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the engines alternating")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    result = {"benchmark": "pipeline_bubble",
              "config": {"layouts": LAYOUTS, "virtual_stages": VIRTUAL, "unit_costs": "F = B = W = 1 per stage"},
              "machine": machine(),
              "counted": {f"p{p}_m{m}": counted(p, m) for p, m in LAYOUTS}}
    if args.measure:
        result["measured"] = measured(args.steps, args.rounds)
    emit(result, args.output)


if __name__ == "__main__":
    main()
