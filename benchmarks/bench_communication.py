"""Collectives and point-to-point messages of one training step, measured vs the analytic count.

8 CPU processes (gloo) train a tiny BLOOM-style model (2 layers, hidden 64, 4 heads, seq 32,
micro-batch 2, global batch 8) as (TP, PP, DP) = (2, 2, 2) in bf16, once without and once with
activation checkpointing. In each process megatron.planner.comm_count.CollectiveRecorder wraps the
torch.distributed functions (DeepSpeed's deepspeed.comm calls them underneath) during the SECOND
train_batch (the first also sends one-off tensor metadata), attributes every call to TP / PP / DP /
embedding / model / self by its group's ranks, and the totals are compared with
analytic_step_counts (formulas in docs/performance.md). Goal: measured / analytic = 1.00 for calls
and bytes on every axis. Prints ONE JSON line.

    python benchmarks/bench_communication.py --output benchmarks/results/communication_2026-11-29.json
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: F401  (sets sys.path and DS_ACCELERATOR)
from _common import emit, machine, tiny_argv, tiny_corpus


def _rank(rank, world_size, runs):
    from megatron.planner.measure import run_recorded

    return [run_recorded(argv, world_size) for argv in runs]


def _compare(result: dict) -> tuple[dict, dict]:
    from megatron.parallel.state import group_layout
    from megatron.planner.comm_count import StepShape, analytic_step_counts

    c = result["config"]
    lay = group_layout(c["tp"], c["pp"], c["dp"])
    shape = StepShape(c["seq_length"], c["micro_batch_size"], c["hidden_size"], c["padded_vocab_size"],
                      c["global_batch_size"] // (c["micro_batch_size"] * c["dp"]), 2 if c["bf16"] else 4,
                      c["checkpoint_activations"])
    analytic = analytic_step_counts(shape, lay, result["rank"], result["stage_layers"], result["group_numels"],
                                    c["bf16"])
    measured = {tuple(k.split("/")): v for k, v in result["summary"].items()}
    return measured, analytic


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output")
    args = p.parse_args()
    from megatron.testing import run_distributed

    before = machine()
    corpus = tiny_corpus()
    base = tiny_argv(corpus, train_iters=2, lr_warmup_iters=1) + [
        "--bf16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    variants = {"bf16": base, "bf16_checkpoint_activations": base + ["--checkpoint-activations"]}
    start = time.time()
    per_rank = run_distributed(_rank, world_size=8, args=(list(variants.values()),), timeout=900)
    elapsed = time.time() - start
    out = {}
    for i, name in enumerate(variants):
        totals: dict = {}
        for results in per_rank:
            measured, analytic = _compare(results[i])
            for source, counts in (("measured", measured), ("analytic", analytic)):
                for (axis, op), v in counts.items():
                    entry = totals.setdefault(f"{axis}/{op}", {"measured_calls": 0, "measured_bytes": 0,
                                                               "analytic_calls": 0, "analytic_bytes": 0})
                    entry[f"{source}_calls"] += v["calls"]
                    entry[f"{source}_bytes"] += v["bytes"]
        axes: dict = {}
        for key, v in totals.items():
            axis = key.split("/")[0]
            a = axes.setdefault(axis, {"measured_calls": 0, "measured_bytes": 0, "analytic_calls": 0,
                                       "analytic_bytes": 0})
            for k in a:
                a[k] += v[k]
        for a in axes.values():
            a["calls_ratio"] = a["measured_calls"] / a["analytic_calls"] if a["analytic_calls"] else None
            a["bytes_ratio"] = a["measured_bytes"] / a["analytic_bytes"] if a["analytic_bytes"] else None
        out[name] = {"per_axis_all_ranks": axes, "per_op_all_ranks": totals,
                     "rank0_dp_detail": [r for r in per_rank[0][i]["records"] if r[1] == "dp"],
                     "rank0_group_numels": per_rank[0][i]["group_numels"],
                     "rank7_group_numels": per_rank[7][i]["group_numels"]}
    emit({"benchmark": "communication", "config": {
        "world_size": 8, "tp": 2, "pp": 2, "dp": 2, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "seq_length": 32, "micro_batch_size": 2, "global_batch_size": 8, "precision": "bf16 (BF16_Optimizer)",
        "recorded": "second train_batch", "backend": "gloo"},
        "compared_with": "megatron.planner.comm_count.analytic_step_counts (docs/performance.md formulas)",
        "goal": "measured/analytic = 1.00 for calls and bytes on every axis", "results": out,
        "all_exact": all(a["calls_ratio"] == 1.0 and a["bytes_ratio"] == 1.0
                         for v in out.values() for a in v["per_axis_all_ranks"].values()),
        "launch_and_run_s": elapsed, "machine": before}, args.output)


if __name__ == "__main__":
    main()
