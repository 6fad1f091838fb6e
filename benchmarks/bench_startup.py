"""Time from launch to the first finished training step, and the share of step time spent waiting on data.

For 1, 4 and 8 ranks ((TP, PP, DP) = (1, 1, 1), (2, 2, 1), (2, 2, 2)) torchrun --standalone runs
benchmarks/_startup_child.py (pretrain_gpt.py with timers; tiny BLOOM-style model, 6 iterations,
gloo). The parent notes the time just before it starts torchrun; each rank writes when its
interpreter began, when imports finished, when its first train_batch began and ended, and per step
the time spent in next() on the (wrapped) training data iterator. Reported: launch -> first step
finished (slowest rank), split into interpreter start, imports, setup (process group, datasets,
deepspeed.initialize) and the first step; steady-state step time (median of steps 2..6) and
data-wait share = sum(next() time) / sum(step time) over steps 2..6, worst rank (goal < 1%).
num_workers 0: all loading is on the critical path (a worst case); one more 1-rank launch with
num_workers 2 (the flag's default) shows the prefetching case. Prints ONE JSON line.

    python -m benchmarks.bench_startup --output benchmarks/results/startup_2026-11-29.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import _common  # noqa: F401  (sets DS_ACCELERATOR before deepspeed is imported)
from benchmarks._common import REPO, emit, machine, tiny_argv, tiny_corpus

LAYOUTS = {1: (1, 1), 4: (2, 2), 8: (2, 2)}
ITERS = 6


def launch(world_size: int, argv: list[str]) -> dict:
    tp, pp = LAYOUTS[world_size]
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, BENCH_STARTUP_OUT=out, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
               f"--nproc-per-node={world_size}", "-m", "benchmarks._startup_child", *argv,
               "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
        if proc.returncode:
            raise RuntimeError(f"{world_size} ranks failed:\n{proc.stderr[-3000:]}")
        ranks = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    first_end = max(r["steps"][0]["end"] for r in ranks)
    steady = [s for r in ranks for s in r["steps"][1:]]
    shares = [sum(s["data_wait_s"] for s in r["steps"][1:]) / sum(s["end"] - s["start"] for s in r["steps"][1:])
              for r in ranks]
    return {"tp": tp, "pp": pp, "dp": world_size // (tp * pp), "launch_to_first_step_s": first_end - t0,
            "interpreter_start_s": statistics.median(r["t_start"] - t0 for r in ranks),
            "imports_s": statistics.median(r["t_imported"] - r["t_start"] for r in ranks),
            "setup_s": statistics.median(r["steps"][0]["start"] - r["t_imported"] for r in ranks),
            "first_step_s": max(r["steps"][0]["end"] - r["steps"][0]["start"] for r in ranks),
            "steady_step_s_median": statistics.median(s["end"] - s["start"] for s in steady),
            "data_wait_share_worst_rank": max(shares), "data_wait_share_per_rank": shares,
            "first_step_data_wait_s": max(r["steps"][0]["data_wait_s"] for r in ranks)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 4, 8])
    args = p.parse_args()
    before = machine()
    corpus = tiny_corpus()
    argv = tiny_argv(corpus, train_iters=ITERS, lr_warmup_iters=1, log_interval=1)
    results = {f"ranks_{n}": launch(n, argv) for n in args.world_sizes}
    # The same 1-rank run with 2 DataLoader workers (the flag's default): loading moves off the critical path
    workers = [a for a in argv]
    workers[workers.index("--num-workers") + 1] = "2"
    results["ranks_1_num_workers_2"] = launch(1, workers)
    emit({"benchmark": "startup", "config": {"model": "2 layers, hidden 64, 4 heads, seq 32, micro-batch 2, "
                                             "global batch 8, fp32, gloo", "train_iters": ITERS,
                                             "num_workers": "0 (ranks_1_num_workers_2: 2)",
                                             "layouts": {str(k): v for k, v in LAYOUTS.items()},
                                             "launcher": "torchrun --standalone", "OMP_NUM_THREADS": 1},
          "compared_with": "goal: data wait < 1% of step time; earlier startup figures: 8 ranks 22-35 s, "
                           "4 ranks 11-14 s; this benchmark's last results in docs/performance.md",
          "results": results, "machine": before}, args.output)


if __name__ == "__main__":
    main()
