"""The pipeline bubble of 1F1B and ZB-H1, side by side: idle slots counted from the schedules' instruction streams
against the analytic fractions, and (``--measure``) the step time of both on this machine.

Counted: for each (stages, micro-batches), every stage's instruction stream of one step (DeepSpeed's
TrainSchedule; our ZeroBubbleH1Schedule) replayed at unit costs by ``megatron.engine.bubble.idle_slots`` (F = B = W
= 1, 1F1B's backward B + W = 2), and the analytic idle slots 3(p - 1) and p - 1 with their fractions of the step.

Measured (``--measure``): a tiny BLOOM-style model (4 layers, hidden 64, seq 32, 8 micro-batches of 2) at PP = 4 on
4 gloo processes: both engines built in one launch (``pretrain`` for one iteration each), then ``train_batch`` on
the same synthetic micro-batches timed ``--steps`` times per engine, the engines alternating for ``--rounds``
rounds; the median step per schedule and their ratio. On a shared CPU the load average, recorded before and
after, says how much to trust it. Prints ONE JSON line.

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
from megatron.engine.bubble import SCHEDULES, analytic_idle_slots, idle_slots, schedule_streams
from megatron.testing import make_tiny_corpus, run_distributed, tiny_argv

LAYOUTS = [(2, 8), (4, 4), (4, 16), (8, 32), (12, 12), (12, 128)]  # (stages, micro-batches); 12: BLOOM-176B
ZBH1_FLAGS = ["--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"]


def counted(stages: int, micro_batches: int) -> dict:
    """Per schedule: idle slots per stage from the replayed streams, the analytic ones, and the step fraction."""
    row = {}
    for name, (schedule, costs) in SCHEDULES.items():
        idle = idle_slots(schedule_streams(schedule, stages, micro_batches), costs)
        busy = 3 * micro_batches
        row[name] = {"idle_slots_per_stage": idle, "analytic_idle_slots": analytic_idle_slots(name, stages,
                                                                                              micro_batches),
                     "bubble_fraction": max(idle) / (busy + max(idle))}
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
    corpus = make_tiny_corpus(tempfile.mkdtemp(prefix="bubble_bench_"))
    base = tiny_argv(corpus, num_layers=4, global_batch_size=16, pipeline_model_parallel_size=4, train_iters=1,
                     lr_warmup_iters=0, log_interval=1000)
    argvs = [base, base + ZBH1_FLAGS]
    load_before = os.getloadavg()
    times = run_distributed(_step_times, world_size=4, args=(argvs, steps, rounds), timeout=1200)[0]
    step = {name: statistics.median(t) for name, t in zip(SCHEDULES, times)}
    return {"median_step_s": step, "zbh1_over_1f1b": step["zbh1"] / step["1f1b"], "steps": steps, "rounds": rounds,
            "stages": 4, "micro_batches": 8, "model": "4 layers, hidden 64, seq 32, micro-batch 2, fp32",
            "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="also time both schedules on 4 local processes")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per engine and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the engines alternating")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    result = {"benchmark": "pipeline_bubble", "config": {"layouts": LAYOUTS, "unit_costs": "F = B = W = 1"},
              "machine": machine(),
              "counted": {f"p{p}_m{m}": counted(p, m) for p, m in LAYOUTS}}
    if args.measure:
        result["measured"] = measured(args.steps, args.rounds)
    emit(result, args.output)


if __name__ == "__main__":
    main()
