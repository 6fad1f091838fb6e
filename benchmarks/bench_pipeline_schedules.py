"""Pipeline schedules side by side: 1F1B (DeepSpeed's TrainSchedule) and interleaved virtual stages.

Part 1, the bubble, counted (CPU time is too noisy to time it): each rank's instruction stream is placed on a
timeline of unit slots (a chunk's forward 1, its backward 2; a pass starts when its rank is free and its input
exists), and each rank's idle share is compared with the closed form (p - 1) / (v m + p - 1), for small
layouts and for BLOOM-176B's PP 12 (12 micro-batches at the start of its rampup; 132, its final 128 rounded
up to a multiple of 12).

Part 2, the step time on this machine: one 2-process launch (PP = 2, gloo) trains the same model with 1F1B and
with v = 2 for --short and --long iterations each; (long - short) / (long - short iterations) is the step time
without the start-up. The load average is recorded: on a shared CPU machine the ratio is only indicative.

    python -m benchmarks.bench_pipeline_schedules --output benchmarks/results/pipeline_schedules_<date>.json
"""

from __future__ import annotations

import argparse
import time

from benchmarks import _common  # first: sets DS_ACCELERATOR before deepspeed is imported
from benchmarks._common import emit, machine
from megatron.engine.interleaved_schedule import InterleavedSchedule, bubble_fraction, passes_of, simulate
from megatron.testing import run_distributed

LAYOUTS = [(2, 4), (2, 8), (4, 8), (4, 16), (12, 12), (12, 132)]  # (p, m): m a multiple of p
VIRTUAL = (1, 2, 4)


def counted_bubbles() -> list[dict]:
    # imported here, after benchmarks._common has chosen DeepSpeed's CPU accelerator
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    rows = []
    for pp, m in LAYOUTS:
        for v in VIRTUAL:
            if v == 1:
                streams = [passes_of(TrainSchedule(m, pp, r).steps()) for r in range(pp)]
            else:
                streams = [passes_of(InterleavedSchedule(m, pp, r, v).steps()) for r in range(pp)]
            timeline = simulate(streams, v)
            rows.append({"pp": pp, "micro_batches": m, "virtual_stages": v, "slots": timeline.makespan,
                         "idle_slots_per_stage": timeline.idle,
                         "idle_fraction_per_stage": [round(timeline.idle_fraction(r), 6) for r in range(pp)],
                         "analytic": round(bubble_fraction(pp, v, m), 6)})
    return rows


def _timed_runs(rank, world_size, runs):
    from megatron.arguments import run_config_from_argv
    from megatron.training.pretrain import pretrain

    seconds = []
    for argv in runs:
        start = time.perf_counter()
        pretrain(run_config_from_argv(argv, world_size=world_size))
        seconds.append(time.perf_counter() - start)
    return seconds


def step_times(args) -> dict:
    corpus = _common.tiny_corpus()
    flags = dict(num_layers=4, hidden_size=args.hidden, num_attention_heads=4, seq_length=args.seq,
                 micro_batch_size=2, global_batch_size=16, zero_stage=1)
    schedules = {"1f1b": [], "interleaved_v2": ["--num-virtual-stages-per-pipeline-rank", "2"]}
    runs = [_common.tiny_argv(corpus, train_iters=iters, **flags) + ["--pipeline-model-parallel-size", "2"] + extra
            for extra in schedules.values() for iters in (args.short, args.long)]
    warm_up = _common.tiny_argv(corpus, train_iters=3, **flags) + ["--pipeline-model-parallel-size", "2"]
    # the first pretrain of a process pays the lazy imports: a throw-away run first
    seconds = run_distributed(_timed_runs, world_size=2, args=([warm_up] + runs,), timeout=1800)[0][1:]
    out = {}
    for i, name in enumerate(schedules):
        short, long = seconds[2 * i], seconds[2 * i + 1]
        out[name] = {"seconds_short": round(short, 3), "seconds_long": round(long, 3),
                     "step_seconds": round((long - short) / (args.long - args.short), 4)}
    out["interleaved_over_1f1b"] = round(out["interleaved_v2"]["step_seconds"] / out["1f1b"]["step_seconds"], 3)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--short", type=int, default=3)
    parser.add_argument("--long", type=int, default=13)
    parser.add_argument("--skip-timing", action="store_true", help="only count the bubbles (no processes)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    result = {"benchmark": "pipeline_schedules", "machine_at_start": machine(),
              "config": {k: v for k, v in vars(args).items() if k != "output"}, "counted_bubbles": counted_bubbles()}
    if not args.skip_timing:
        result["step_time"] = step_times(args)
    emit(result, args.output)


if __name__ == "__main__":
    main()
