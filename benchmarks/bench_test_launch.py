"""What a multi-process test pays to start its ranks, by the ways the suite starts them: seconds per launch.

    python -m benchmarks.bench_test_launch --output benchmarks/results/test_launch_<date>.json

Each launch trains the tests' tiny BLOOM-style model (megatron.testing.tiny_argv) for 3 iterations on 2 ranks
(DP = 2, gloo), and the parent times it from the call to the ranks' results:
    torchrun          python -m torch.distributed.run pretrain_gpt.py (tests/launch: each rank a new interpreter
                      importing torch, DeepSpeed and the project)
    forkserver_cold   run_distributed's first launch in this process: the fork server starts and imports them once
    forkserver_warm   each later launch: the ranks are forked from the running server (median of --repeats)
    one_launch_3_runs one forked launch whose ranks train 3 runs in turn (tests/helpers/training.train's way),
                      against 3 warm launches of one run each
Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import _common  # noqa: F401  (sets DS_ACCELERATOR before deepspeed is imported)
from benchmarks._common import REPO, emit, machine, tiny_argv, tiny_corpus


def _train(rank, world_size, runs):
    """On each rank: pretrain every argv of ``runs`` in turn (what each returns is not needed here)."""
    from megatron.arguments import run_config_from_argv
    from megatron.training.pretrain import pretrain

    return [pretrain(run_config_from_argv(argv, world_size=world_size)) is not None for argv in runs]


def _torchrun(argv) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(REPO, "pretrain_gpt.py"), *argv], env=env, capture_output=True, text=True,
                          timeout=900, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"torchrun failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def _forked(runs) -> float:
    from megatron.testing.processes import run_distributed

    t0 = time.perf_counter()
    run_distributed(_train, world_size=2, args=(runs,), timeout=900)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output")
    args = parser.parse_args()
    started = machine()
    with tempfile.TemporaryDirectory() as tmp:
        argv = tiny_argv(tiny_corpus(os.path.join(tmp, "corpus")), train_iters=3, lr_warmup_iters=1)
        cold = _forked([argv])
        warm = [_forked([argv]) for _ in range(args.repeats)]
        three = _forked([argv] * 3)
        torchrun = [_torchrun(argv) for _ in range(args.repeats)]
    warm_median = statistics.median(warm)
    emit({"benchmark": "test_launch", "machine": started,
          "config": {"world_size": 2, "train_iters": 3, "repeats": args.repeats, "model": "tiny_argv (2 layers, h 64)"},
          "torchrun_s": torchrun, "torchrun_median_s": statistics.median(torchrun),
          "forkserver_cold_s": cold, "forkserver_warm_s": warm, "forkserver_warm_median_s": warm_median,
          "one_launch_3_runs_s": three, "three_launches_1_run_s": 3 * warm_median}, args.output)


if __name__ == "__main__":
    main()
