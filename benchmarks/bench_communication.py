"""Collectives and point-to-point messages of one training step, measured vs the analytic count.

8 CPU processes (gloo) train a tiny BLOOM-style model (2 layers, hidden 64, 4 heads, seq 32,
micro-batch 2, global batch 8) as (TP, PP, DP) = (2, 2, 2) in bf16, once without and once with
activation checkpointing. In each process megatron.planner.comm_count.CollectiveRecorder wraps the
torch.distributed functions (DeepSpeed's deepspeed.comm calls them underneath) during the SECOND
train_batch (the first also sends one-off tensor metadata), attributes every call to TP / PP / DP /
embedding / model / self by its group's ranks, and the totals are compared with
analytic_step_counts (formulas in docs/performance.md). Goal: measured / analytic = 1.00 for calls
and bytes on every axis.

A second launch of 4 processes runs the sharded layouts on DeepSpeed's model engine (PP = 1) and
compares them with megatron.planner.comm_zero (DP, TP and hpZ axes; the THIRD train_batch is recorded, after
ZeRO-3's trace checks): ZeRO-2 DP=4 bf16; ZeRO-3 DP=4 bf16 with DeepSpeed's defaults (all these tiny
parameters persist), with nothing persistent and prefetching on (bytes predicted, calls not), and with
every parameter released after each use (stage3_max_reuse_distance 0, no prefetch), with and without
recomputation; ZeRO-3 TP=2 x DP=2 bf16; hpZ groups of 2 over DP=4. Prints ONE JSON line.

    python -m benchmarks.bench_communication --output benchmarks/results/communication_2026-12-01.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from benchmarks import _common  # noqa: F401  (sets DS_ACCELERATOR before deepspeed is imported)
from benchmarks._common import emit, machine, tiny_argv, tiny_corpus


def _rank(rank, world_size, runs, record_call=2):
    from megatron.benchmarking.measure import run_recorded

    return [run_recorded(argv, world_size, record_call) for argv in runs]


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


def _totals(per_rank: list, i: int, compare) -> dict:
    """Run ``i`` summed over the ranks: per (axis/op) and per axis, measured and analytic calls and bytes."""
    totals: dict = {}
    for results in per_rank:
        measured, analytic = compare(results[i])
        for source, counts in (("measured", measured), ("analytic", analytic)):
            for (axis, op), v in counts.items():
                entry = totals.setdefault(f"{axis}/{op}", {"measured_calls": 0, "measured_bytes": 0,
                                                           "analytic_calls": 0, "analytic_bytes": 0})
                if v["calls"] is None or entry[f"{source}_calls"] is None:
                    entry[f"{source}_calls"] = None  # not predicted (ZeRO-3 prefetching): bytes only
                else:
                    entry[f"{source}_calls"] += v["calls"]
                entry[f"{source}_bytes"] += v["bytes"]
    axes: dict = {}
    for key, v in totals.items():
        a = axes.setdefault(key.split("/")[0], {"measured_calls": 0, "measured_bytes": 0, "analytic_calls": 0,
                                                "analytic_bytes": 0})
        for k in a:
            a[k] = None if a[k] is None or v[k] is None else a[k] + v[k]
    for a in axes.values():
        a["calls_ratio"] = a["measured_calls"] / a["analytic_calls"] if a["analytic_calls"] else None
        a["bytes_ratio"] = a["measured_bytes"] / a["analytic_bytes"] if a["analytic_bytes"] else None
    return {"per_axis_all_ranks": axes, "per_op_all_ranks": totals}


def _compare_sharded(result: dict) -> tuple[dict, dict]:
    from megatron.benchmarking.measure import analytic_sharded_counts

    return {tuple(k.split("/")): v for k, v in result["summary"].items()}, analytic_sharded_counts(result)


def _sharded_variants(corpus: dict, folder: str) -> dict:
    def config(name, zero):
        path = os.path.join(folder, name + ".json")
        with open(path, "w") as f:
            json.dump({"zero_optimization": zero}, f)
        return ["--deepspeed_config", path]

    release = config("release", {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                                 "stage3_prefetch_bucket_size": 0})
    return {"zero2_dp4": ["--zero-stage", "2"],
            "zero3_dp4_defaults": ["--zero-stage", "3"],
            "zero3_dp4_prefetch": ["--zero-stage", "3"] + config("prefetch", {"stage3_param_persistence_threshold": 0}),
            "zero3_dp4_release": ["--zero-stage", "3"] + release,
            "zero3_dp4_release_checkpoint_activations": ["--zero-stage", "3", "--checkpoint-activations"] + release,
            "zero3_tp2_dp2_release": ["--zero-stage", "3", "--tensor-model-parallel-size", "2"] + release,
            "hpz2_dp4_release": ["--zero-stage", "3", "--zero-hpz-partition-size", "2"] + release}


def _exact(out: dict) -> bool:
    return all(a["bytes_ratio"] == 1.0 and a["calls_ratio"] in (1.0, None)
               for v in out.values() for a in v["per_axis_all_ranks"].values())


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
        out[name] = dict(_totals(per_rank, i, _compare),
                         rank0_dp_detail=[r for r in per_rank[0][i]["records"] if r[1] == "dp"],
                         rank0_group_numels=per_rank[0][i]["group_numels"],
                         rank7_group_numels=per_rank[7][i]["group_numels"])
    with tempfile.TemporaryDirectory() as folder:
        sharded = _sharded_variants(corpus, folder)
        sharded_base = tiny_argv(corpus, train_iters=3, lr_warmup_iters=1, global_batch_size=16) + ["--bf16"]
        start = time.time()
        sharded_ranks = run_distributed(_rank, world_size=4, args=([sharded_base + v for v in sharded.values()], 3),
                                        timeout=900)
        sharded_elapsed = time.time() - start
    sharded_out = {}
    for i, name in enumerate(sharded):
        r0 = sharded_ranks[0][i]
        sharded_out[name] = dict(_totals(sharded_ranks, i, _compare_sharded), optimizer=r0["optimizer"],
                                 zero_settings=r0["zero"]["settings"], rank0_group_numels=r0["zero"]["group_numels"],
                                 flags=[os.path.basename(a) for a in sharded[name]])
    emit({"benchmark": "communication", "config": {
        "world_size": 8, "tp": 2, "pp": 2, "dp": 2, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "seq_length": 32, "micro_batch_size": 2, "global_batch_size": 8, "precision": "bf16 (BF16_Optimizer)",
        "recorded": "second train_batch", "backend": "gloo"},
        "sharded_config": {"world_size": 4, "pp": 1, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                           "seq_length": 32, "micro_batch_size": 2, "global_batch_size": 16, "precision": "bf16",
                           "recorded": "third train_batch", "backend": "gloo"},
        "compared_with": "megatron.planner.comm_count.analytic_step_counts (docs/performance.md formulas); "
                         "sharded: megatron.benchmarking.measure.analytic_sharded_counts (comm_count + comm_zero)",
        "goal": "measured/analytic = 1.00 for calls and bytes on every axis (sharded with prefetching: bytes)",
        "results": out, "sharded_results": sharded_out,
        "all_exact": _exact(out), "sharded_all_exact": _exact(sharded_out),
        "launch_and_run_s": elapsed, "sharded_launch_and_run_s": sharded_elapsed, "machine": before}, args.output)


if __name__ == "__main__":
    main()
