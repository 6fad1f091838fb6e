"""The planner's inter-node term, checked on two simulated nodes with the link shaped to a known rate.

A tiny BLOOM-style model (2 layers, hidden 64, 4 heads, seq 32, micro-batch 2, global batch 16: 4 micro-batches
per DP replica), fp32, trains as TP=2 x PP=2 x DP=2 over two simulated nodes (tests/helpers/netns_cluster.py:
a network namespace each, one bridge between them), 4 ranks a node, launched as examples/slurm does (one
``torchrun --nnodes 2 --rdzv_backend c10d`` per node). DeepSpeed's rank order is TP innermost, then DP, then PP,
so node0 holds pipeline stage 0 (its two DP replicas of a TP pair) and node1 stage 1: TP and DP stay inside a node
and the pipeline crosses the link, as a real placement puts them. What crosses: each micro-batch's activation
(node0 -> node1) and its gradient (node1 -> node0), and the tied word embedding's gradient all-reduce between the
first and the last stage.

The job runs twice: unshaped (veth at memory speed), then with BOTH nodes' outgoing traffic shaped by tc's tbf to
each of ``--rates-mbit`` in turn (a link of that rate in each direction; this kernel has no netem). Measured per step:

- ``step_delta_s``: the median "elapsed time per iteration" shaped minus unshaped (iterations after the first
  two): the time the slowed link added to a step, i.e. the exposed inter-node communication time. This is the
  figure compared with the planner: it is what the link costs a step, whatever the bytes were.
- ``wire_s``: the bytes each node's shaper sent per step (tc's counter, read as node1's log reports iterations)
  divided by the rate; the busier direction's, a lower bound on the delta when the two directions overlap.

The planner's prediction (``megatron.planner.estimate_step``): the run's layout with ``gpus_per_node`` 4 and the
per-GPU inter-node bandwidth = rate / 4 (the node's one link shared by its 4 ranks, all sending at once, as
ClusterSpec defines it), its step time minus the same estimate at an unlimited inter-node bandwidth: the
inter-node term (pipeline sends and the tied embedding all-reduce; DP does not cross here). Its bytes per step and
direction are counted from the same formulas. Reported: measured / predicted, either way, and the bytes the
planner counts vs the bytes the shapers counted.

Root is needed (namespaces); run it alone (8 processes): ``flock /work/cpu.lock``.

    flock /work/cpu.lock .venv/bin/python -m benchmarks.bench_multinode \
        --output benchmarks/results/multinode_2026-12-07.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import _common  # noqa: F401  (sets DS_ACCELERATOR before deepspeed is imported)
from benchmarks._common import REPO, emit, machine, tiny_argv
from benchmarks.bench_serving import cpu_flags
from tests.helpers.netns_cluster import NetnsCluster, netns_unavailable

RDZV_PORT = 29400  # inside the cluster's namespaces: no other process can hold it
RANKS_PER_NODE = 4
LAYOUT = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([0-9.]+)")


def _job(cluster, argv, on_line):
    """One torchrun per node; ``on_line(node, line)`` for every output line (as it comes)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    procs, readers, outputs = [], [], []
    for i in range(cluster.nodes):
        cmd = [sys.executable, "-u", "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS_PER_NODE),
               "--nnodes", str(cluster.nodes), "--rdzv_backend", "c10d", "--rdzv_endpoint",
               f"{cluster.hostnames[0]}:{RDZV_PORT}", "--max_restarts", "0", "--node_rank", str(i),
               os.path.join(REPO, "pretrain_gpt.py"), *argv]
        proc = cluster.popen(i, cmd, env=env, cwd=cluster.shared, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        lines: list[str] = []

        def read(p=proc, out=lines, node=i):
            for line in p.stdout:
                out.append(line)
                on_line(node, line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        procs.append(proc)
        readers.append(reader)
        outputs.append(lines)
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for reader in readers:
        reader.join(timeout=10)
    if codes != [0, 0]:
        raise RuntimeError(f"the job exited {codes}:\n" + "".join(outputs[0])[-3000:] + "".join(outputs[1])[-3000:])


def run_once(cluster, corpus, name: str, iters: int, rate_mbit: float) -> dict:
    """The job, its link shaped to ``rate_mbit`` in both directions (0: unshaped): the per-iteration times the last
    rank logs, and with shaping the shapers' byte counters at each logged iteration."""
    argv = tiny_argv(corpus, global_batch_size=16, train_iters=iters, **LAYOUT)
    times: dict[int, float] = {}
    counters: dict[int, tuple[int, int]] = {}

    def on_line(node, line):
        found = ITERATION.search(line)
        if found:
            it = int(found[1])
            times[it] = float(found[2]) / 1000
            if rate_mbit:
                counters[it] = (cluster.shaped_bytes(0), cluster.shaped_bytes(1))

    if rate_mbit:
        for i in range(cluster.nodes):
            cluster.shape(i, rate_mbit=rate_mbit)
    try:
        _job(cluster, argv, on_line)
    finally:
        for i in range(cluster.nodes):
            cluster.unshape(i)
    if sorted(times) != list(range(1, iters + 1)):
        raise RuntimeError(f"{name}: iterations logged {sorted(times)}")
    steady = [times[it] for it in range(3, iters + 1)]
    out = {"rate_mbit": rate_mbit, "iteration_s": [round(times[it], 4) for it in range(1, iters + 1)],
           "median_step_s": round(statistics.median(steady), 4)}
    if rate_mbit:
        first, last = 2, iters  # bytes between the logs of iteration 2 and the last: whole steps in between
        steps = last - first
        per_step = [(counters[last][d] - counters[first][d]) / steps for d in range(2)]
        out["shaped_bytes_per_step"] = {"node0_to_node1": round(per_step[0]), "node1_to_node0": round(per_step[1])}
        out["wire_s_per_step"] = {k: round(v * 8 / (rate_mbit * 1e6), 4)
                                  for k, v in out["shaped_bytes_per_step"].items()}
    return out


def planner_prediction(rate_mbit: float, global_batch: int) -> dict:
    """The planner's inter-node time per step for this job at ``rate_mbit`` per link direction, and the bytes per
    step and direction its formulas move over the link."""
    from megatron.planner import GPUS, Layout, ModelShape, estimate_step
    from megatron.planner.specs import ClusterSpec

    model = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512)
    tp, pp, dp, mbs, seq = 2, 2, 2, 2, 32
    layout = Layout(tp, pp, dp, mbs, recompute=False, zero_stage=0, precision="fp32")
    gpu = GPUS["A100-80GB"]  # compute and NVLink terms cancel in the difference below
    per_gpu_gbps = rate_mbit * 1e6 / 8 / 1e9 / RANKS_PER_NODE  # the node's link shared by its 4 ranks
    shaped = ClusterSpec("netns-tbf", RANKS_PER_NODE, per_gpu_gbps)
    unlimited = dataclasses.replace(shaped, inter_node_gbps=1e9)
    at_rate = estimate_step(model, layout, gpu, shaped, seq, global_batch)
    free = estimate_step(model, layout, gpu, unlimited, seq, global_batch)
    m = layout.num_micro_batches(global_batch)
    activation = 4 * seq * mbs * model.hidden_size  # fp32 [s, b, h]
    # per direction: each of the stage's dp x tp ranks sends 1/tp of each micro-batch's activation (gradient), and
    # each (dp, tp) pair of the first and last stage all-reduces its tied embedding's fp32 gradient (1/tp of V x h)
    pipeline_bytes = m * dp * tp * activation / tp
    tied_bytes = dp * tp * 4 * model.vocab_size * model.hidden_size / tp
    components = {k: round(at_rate.components_s[k] - free.components_s[k], 5)
                  for k in at_rate.components_s if abs(at_rate.components_s[k] - free.components_s[k]) > 1e-9}
    return {"inter_node_gbps_per_gpu": per_gpu_gbps, "inter_node_s": round(at_rate.step_s - free.step_s, 5),
            "inter_node_components_s": components, "num_micro_batches": m,
            "bytes_per_step_per_direction": {"pipeline": pipeline_bytes, "tied_embedding": tied_bytes,
                                             "total": pipeline_bytes + tied_bytes}}


def compare(unshaped: dict, shaped: dict, global_batch: int) -> dict:
    """One rate's row: the shaped run, the planner's prediction, and measured / predicted."""
    predicted = planner_prediction(shaped["rate_mbit"], global_batch)
    delta = shaped["median_step_s"] - unshaped["median_step_s"]
    return {"shaped": shaped, "planner": predicted, "measured_inter_node_s_per_step": round(delta, 4),
            "ratio_measured_over_predicted": round(delta / predicted["inter_node_s"], 3),
            "ratio_wire_over_predicted": round(max(shaped["wire_s_per_step"].values()) / predicted["inter_node_s"],
                                               3),
            "bytes_shaper_over_planner": {k: round(v / predicted["bytes_per_step_per_direction"]["total"], 3)
                                          for k, v in shaped["shaped_bytes_per_step"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates-mbit", default="2,10,40",
                        help="comma-separated tbf rates of each node's outgoing link, one shaped run each")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates_mbit.split(",")]
    reason = netns_unavailable()
    if reason:
        raise SystemExit(f"bench_multinode: {reason}")
    from megatron.testing.tiny_corpus import make_tiny_corpus

    start = machine()
    root = tempfile.mkdtemp(prefix="bench-multinode-", dir="/tmp")
    try:
        with NetnsCluster(root, nodes=2) as cluster:
            corpus = make_tiny_corpus(os.path.join(cluster.shared, "corpus"))
            t0 = time.time()
            unshaped = run_once(cluster, corpus, "unshaped", args.iters, 0)
            shaped = [run_once(cluster, corpus, f"shaped-{rate:g}", args.iters, rate) for rate in rates]
            wall = time.time() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "benchmark": "multinode",
        "config": {"layout": "TP=2 x PP=2 x DP=2 over 2 simulated nodes, 4 ranks each (node0: stage 0)",
                   "model": "2 layers, hidden 64, 4 heads, seq 32, vocab 512, fp32", "micro_batch": 2,
                   "global_batch": 16, "iters": args.iters, "rates_mbit": rates,
                   "shaping": "tc tbf on both nodes' eth0 egress (burst 32kbit, latency 400ms)"},
        "cpu_flags": cpu_flags(), "machine_at_start": start, "wall_s": round(wall, 1),
        "unshaped": unshaped, "by_rate": {f"{rate:g}mbit": compare(unshaped, row, 16) for rate, row in zip(rates, shaped)},
    }
    emit(result, args.output)


if __name__ == "__main__":
    main()
