"""Bytes per rank of parameters, gradients and optimizer state: measured on the engine vs the planner.

A tiny BLOOM-style model (4 layers, hidden 128, 4 heads, seq 64, vocab 512) trains 2 iterations
in bf16 (BF16_Optimizer: bf16 weights, fp32 gradient buffer, fp32 masters and Adam states sharded
over DP) and in fp32, on (TP, PP, DP) = (1, 1, 1), (2, 2, 2), (1, 1, 4) and (2, 1, 2), and where
PP = 1 with ZeRO-2 and ZeRO-3 too (DeepSpeed's model engine; ZeRO-3 with
stage3_param_persistence_threshold 0, so that every parameter lives in partitions), one launch per
layout, gloo on CPU. After the step each rank reads its resident bytes from the engine
(megatron.benchmarking.measure.engine_static_bytes: the flat bf16 buffers, the fp32 gradient buffer,
the fp32 master partitions, Adam's exp_avg / exp_avg_sq) and compares them with the planner's
formula (megatron.planner.memory.static_bytes on stage_param_counts). The modules' .grad are
freed by the optimizer step, so they are reported (0 after the step), not compared.
Goal: within 5% per rank. Prints ONE JSON line.

    python -m benchmarks.bench_memory --output benchmarks/results/memory_2026-11-29.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from benchmarks import _common  # noqa: F401  (sets DS_ACCELERATOR before deepspeed is imported)
from benchmarks._common import emit, machine, tiny_argv, tiny_corpus

LAYOUTS = [(1, 1, 1), (2, 2, 2), (1, 1, 4), (2, 1, 2)]
NO_PERSISTENCE = None
MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64, micro_batch_size=2,
             global_batch_size=16)


def _rank(rank, world_size, runs):
    from megatron.benchmarking.measure import run_recorded

    out = []
    for argv in runs:
        r = run_recorded(argv, world_size)
        r.pop("records")
        out.append(r)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output")
    args = p.parse_args()
    from megatron.benchmarking.measure import measured_resident_bytes, predicted_static_bytes
    from megatron.testing import run_distributed

    before = machine()
    corpus = tiny_corpus()
    global NO_PERSISTENCE
    NO_PERSISTENCE = os.path.join(tempfile.mkdtemp(), "zero3.json")
    with open(NO_PERSISTENCE, "w") as f:  # ZeRO-3 keeps parameters under 1e5 elements gathered by default
        f.write('{"zero_optimization": {"stage3_param_persistence_threshold": 0}}')
    rows, worst = [], 0.0
    start = time.time()
    for tp, pp, dp in LAYOUTS:
        base = tiny_argv(corpus, train_iters=2, lr_warmup_iters=1, **MODEL) + [
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
        runs = {"bf16": base + ["--bf16"], "fp32": base}
        if pp == 1 and dp > 1:  # ZeRO-2 / ZeRO-3 on DeepSpeed's model engine (megatron.engine.model_engine)
            for stage in (2, 3):
                extra = ["--zero-stage", str(stage)] + (["--deepspeed_config", NO_PERSISTENCE] if stage == 3 else [])
                runs[f"bf16 zero{stage}"] = base + ["--bf16"] + extra
                runs[f"fp32 zero{stage}"] = base + extra
        per_rank = run_distributed(_rank, world_size=tp * pp * dp, args=(list(runs.values()),), timeout=900)
        for i, precision in enumerate(runs):
            for r in per_rank:
                predicted, measured = predicted_static_bytes(r[i]), measured_resident_bytes(r[i])
                total_p, total_m = sum(predicted.values()), sum(measured.values())
                worst = max(worst, abs(total_m / total_p - 1))
                rows.append({"layout": [tp, pp, dp], "precision": precision, "rank": r[i]["rank"],
                             "optimizer": r[i]["optimizer"], "measured_bytes": measured,
                             "predicted_bytes": {k: round(v) for k, v in predicted.items()},
                             "measured_total": total_m, "predicted_total": round(total_p),
                             "ratio": total_m / total_p, "grads_after_step_bytes": r[i]["static_bytes"]["grads"]})
    emit({"benchmark": "memory", "config": dict(MODEL, layouts=LAYOUTS, precisions=["bf16", "fp32"],
                                                zero_stages="1 (bf16) / 0 (fp32) on every layout; 2 and 3 where PP=1, DP>1",
                                                vocab="tiny corpus BPE, padded to 512", train_iters=2),
          "compared_with": "megatron.planner.memory.static_bytes (planner formula, resident components)",
          "goal": "within 5% per rank", "max_abs_relative_error": worst, "within_goal": worst <= 0.05,
          "rows": rows, "elapsed_s": time.time() - start, "machine": before}, args.output)


if __name__ == "__main__":
    main()
