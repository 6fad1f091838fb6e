#!/usr/bin/env python
"""List the parallel layouts that fit a model on a cluster, fastest first (see docs/performance.md).

    python tools/plan_parallelism.py --model 176B --num-gpus 384 --gpu A100-80GB \
        --cluster jean-zay-a100 --seq-length 2048 --global-batch-size 2048 --top 5
    python tools/plan_parallelism.py --model llama-3-70b --num-gpus 64 --gpu H100-80GB --seq-length 8192 \
        --global-batch-size 512
    python tools/plan_parallelism.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
        --num-gpus 8 --gpu H100-80GB --global-batch-size 512 --json
    python tools/plan_parallelism.py --model deepseek-v3 --num-gpus 256 --gpu H100-80GB --seq-length 4096 \
        --global-batch-size 1024 --ep-sizes 1 2 4 8
    python tools/plan_parallelism.py --model 7B1 --num-gpus 8 --gpu A100-80GB --global-batch-size 8 \
        --longest-sequence --ulysses-sizes 1 2 4 8 --attention fused
    python tools/plan_parallelism.py --model llama-3-8b --num-gpus 8 --gpu H100-80GB --seq-length 8192 \
        --global-batch-size 128 --fp8-format hybrid --fp8-recipe tensorwise

Memory per GPU (weights, gradients, optimizer state, activations, overhead) and step time
(compute, TP / PP / DP communication, bubble) come from megatron.planner; every constant is
named there and explained in docs/performance.md. Estimates, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from megatron.config.fp8 import FP8_FORMATS, FP8_RECIPES, FP8Config
from megatron.config.hardware import fp8_capability_problem
from megatron.planner import CLUSTERS, GPUS, MODEL_SIZES, ModelShape, plan_layouts
from megatron.planner.fp8 import fp8_shape_of
from megatron.planner.search import longest_sequences
from megatron.planner.specs import DEFAULT_CLUSTER, GiB


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODEL_SIZES),
                   help="a named BLOOM or Llama size (its real hyper-parameters, vocabulary included)")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--num-key-value-heads", type=int, help="grouped-query attention (default: one per head)")
    p.add_argument("--swiglu", action="store_true", help="Llama's gated MLP (three ffn x hidden matrices)")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true", help="an output head of its own")
    p.add_argument("--padded-vocab-size", type=int, default=250880)
    p.add_argument("--num-gpus", type=int, required=True)
    p.add_argument("--gpu", choices=sorted(GPUS), default="A100-80GB")
    p.add_argument("--gpu-memory-gib", type=float, help="override the GPU's memory")
    p.add_argument("--cluster", choices=sorted(CLUSTERS), help="fabric preset (default: DGX of the GPU type)")
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--inter-node-gbps", type=float, help="achievable per-GPU inter-node bus bandwidth, GB/s")
    p.add_argument("--intra-node-gbps", type=float, help="achievable NVLink all-reduce bus bandwidth, GB/s")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--pp-partition-method", default="type:transformer",
                   choices=["type:transformer", "type:transformer|embedding"])
    p.add_argument("--zero-stages", type=int, nargs="+", default=[1, 2, 3], choices=[0, 1, 2, 3],
                   help="planner ZeRO stages to consider. 1: masters and Adam sharded over DP (BF16_Optimizer, "
                        "with the pipeline; our --bf16 requires at least it). 2: gradients sharded too, 3: "
                        "parameters too (both without the pipeline, DeepSpeed's model engine). 0: a "
                        "replicated optimizer, which our bf16 path does not offer")
    p.add_argument("--recompute", choices=["auto", "yes", "no"], default="auto",
                   help="activation checkpointing: try both (auto) or fix it")
    p.add_argument("--sequence-parallel", choices=["on", "off", "both"], default="both",
                   help="Megatron sequence parallelism (layouts with TP > 1): try both, or fix it")
    p.add_argument("--ulysses-sizes", type=int, nargs="+", default=[1],
                   help="DeepSpeed-Ulysses degrees to consider (heads divisible by TP x u, TP x u within a node, PP 1)")
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[1],
                   help="context-parallel (ring attention, --context-parallel-size) degrees to consider: any PP, "
                        "across nodes too, not with Ulysses; the sequence divisible by 2 x the degree")
    p.add_argument("--ep-sizes", type=int, nargs="+",
                   help="expert-parallel sizes to consider on an MoE model (--model mixtral-8x7b, deepseek-v3); "
                        "default: every power of two dividing its experts, up to --num-gpus")
    p.add_argument("--schedules", nargs="+", choices=["1f1b", "zbh1", "interleaved"], default=["1f1b"],
                   help="pipeline schedules to try on every layout with PP > 1 where they run (docs/parallelism.md, "
                        "'Choosing a pipeline schedule'); default: DeepSpeed's 1F1B only")
    p.add_argument("--virtual-stages", type=int, nargs="+", default=[2],
                   help="with --schedules interleaved: the virtual stages per pipeline rank to try")
    p.add_argument("--attention", choices=["fused", "materialized"], default="materialized",
                   help="materialized (the default, the published runs' numbers): Korthikanti's 5as/h bytes per "
                        "layer (Megatron's fused softmax); fused: the core attention keeps no [heads, s, s] scores "
                        "for backward (flash / flex / SDPA's fused kernels, which --attention-backend auto runs on "
                        "CUDA; or selective recomputation): use it for long sequences")
    p.add_argument("--longest-sequence", action="store_true",
                   help="instead of ranking layouts at --seq-length: the longest sequence (a multiple of 256) each "
                        "family fits (plain 3D/ZeRO, +SP, +Ulysses over --ulysses-sizes, both), with activation "
                        "checkpointing and without, at micro-batch 1")
    p.add_argument("--fp8-format", choices=FP8_FORMATS, help="FP8 GEMMs in the transformer layers' linear layers "
                   "(pretrain_gpt.py's flag; megatron.planner.fp8); needs a GPU with FP8 tensor cores")
    p.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="delayed", help="with --fp8-format (default delayed)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--show-infeasible", action="store_true", help="also list layouts that do not fit")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON document")
    return p.parse_args(argv)


def model_from_args(args) -> ModelShape:
    model = _shape_from_args(args)
    if args.fp8_format:
        config = FP8Config(fp8_format=args.fp8_format, fp8_recipe=args.fp8_recipe)
        model = dataclasses.replace(model, fp8=fp8_shape_of(config, model.num_layers))
    return model


def _shape_from_args(args) -> ModelShape:
    if args.model:
        return MODEL_SIZES[args.model]
    missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads") if getattr(args, f) is None]
    if missing:
        raise SystemExit(f"give --model or all of --num-layers --hidden-size --num-attention-heads (missing {missing})")
    return ModelShape(args.num_layers, args.hidden_size, args.num_attention_heads, args.padded_vocab_size,
                      args.ffn_hidden_size, num_key_value_heads=args.num_key_value_heads, swiglu=args.swiglu,
                      tied_embeddings=not args.untie_embeddings_and_output_weights)


def ep_sizes_from_args(args, model: ModelShape) -> tuple[int, ...]:
    """The EP sizes to search: the given ones, else (MoE) the powers of two dividing the experts."""
    if args.ep_sizes is not None:
        if model.moe is None and args.ep_sizes != [1]:
            raise SystemExit(f"--ep-sizes {args.ep_sizes}: the model has no experts (choose an MoE --model)")
        return tuple(args.ep_sizes)
    if model.moe is None:
        return (1,)
    sizes, ep = [], 1
    while ep <= min(model.moe.num_experts, args.num_gpus):
        if model.moe.num_experts % ep == 0:
            sizes.append(ep)
        ep *= 2
    return tuple(sizes)


def hardware_from_args(args):
    gpu = GPUS[args.gpu]
    if args.fp8_format and not gpu.has_fp8:
        raise SystemExit(fp8_capability_problem(gpu.compute_capability, f"the {gpu.name} (--gpu)"))
    if args.gpu_memory_gib:
        gpu = dataclasses.replace(gpu, memory_bytes=int(args.gpu_memory_gib * GiB))
    if args.intra_node_gbps:
        gpu = dataclasses.replace(gpu, nvlink_busbw_gbps=args.intra_node_gbps)
    cluster = CLUSTERS[args.cluster or DEFAULT_CLUSTER[args.gpu]]
    if args.gpus_per_node:
        cluster = dataclasses.replace(cluster, gpus_per_node=args.gpus_per_node)
    if args.inter_node_gbps:
        cluster = dataclasses.replace(cluster, inter_node_gbps=args.inter_node_gbps)
    return gpu, cluster


def format_table(rows: list[dict]) -> str:
    head = (f"{'#':>3} {'TP':>3} {'PP':>3} {'DP':>4} {'EP':>3} {'seq':>6} {'MBS':>3} {'m':>5} {'recomp':>6} "
            f"{'ZeRO':>8} {'mem GiB':>8} {'step s':>8} {'TFLOPs hw':>9} {'TFLOPs mdl':>10} {'MFU':>6} {'bubble':>6} "
            f"{'tokens/s':>10} {'schedule':>8}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>3} {r['tp']:>3} {r['pp']:>3} {r['dp']:>4} {r['ep']:>3} {r['sequence'] or '-':>6} "
                     f"{r['micro_batch_size']:>3} "
                     f"{r['num_micro_batches']:>5} {'yes' if r['recompute'] else 'no':>6} {r['zero']:>8} "
                     f"{r['memory_gib']:>8.1f} {r['step_s']:>8.2f} {r['hardware_tflops_per_gpu']:>9.1f} "
                     f"{r['model_tflops_per_gpu']:>10.1f} {r['mfu']:>6.3f} {r['bubble_fraction']:>6.3f} "
                     f"{r['tokens_per_s']:>10.0f} {_schedule_label(r):>8}" + ("" if r["fits"] else "  (does not fit)"))
    return "\n".join(lines)


def _schedule_label(row: dict) -> str:
    return {"1f1b": "1F1B", "zbh1": "ZB-H1"}.get(row["schedule"], f"int v={row['virtual_stages']}")


SEQUENCE_PARALLEL = {"both": (False, True), "on": (True,), "off": (False,)}


def format_longest(results) -> str:
    head = (f"{'family':<12} {'recompute':>9} {'longest seq':>11} {'layout':<44} {'mem GiB':>7} {'step s':>7} "
            f"{'tokens/s':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.plan is None:
            lines.append(f"{r.family:<12} {'yes' if r.recompute else 'no':>9} {'none fits':>11}")
            continue
        lay = r.plan.layout
        label = f"TP={lay.tp} PP={lay.pp} DP={lay.dp} {lay.sequence_label or '-'} ZeRO-{lay.zero_label}"
        lines.append(f"{r.family:<12} {'yes' if r.recompute else 'no':>9} {r.seq_length:>11} {label:<44} "
                     f"{r.plan.memory.peak / GiB:>7.1f} {r.plan.step.step_s:>7.2f} {r.plan.step.tokens_per_s:>9.0f}")
    return "\n".join(lines)


def main_longest(args, model, gpu, cluster) -> int:
    results = longest_sequences(model, gpu, cluster, args.num_gpus, args.global_batch_size,
                                ulysses_sizes=tuple(args.ulysses_sizes), zero_stages=tuple(args.zero_stages),
                                partition_method=args.pp_partition_method,
                                store_attention_scores=args.attention == "materialized")
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(model), "gpu": dataclasses.asdict(gpu),
                          "cluster": dataclasses.asdict(cluster), "num_gpus": args.num_gpus,
                          "global_batch_size": args.global_batch_size, "attention": args.attention,
                          "longest": [{"family": r.family, "recompute": r.recompute, "seq_length": r.seq_length,
                                       "layout": r.plan.row() if r.plan else None} for r in results]}))
    else:
        print(f"{model.total_params() / 1e9:.1f}B parameters on {args.num_gpus} x {gpu.name} ({cluster.name}), "
              f"global batch {args.global_batch_size}, micro-batch 1, {args.attention} attention: the longest "
              f"sequence that fits")
        print(format_longest(results))
    return 0 if any(r.plan for r in results) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    model = model_from_args(args)
    gpu, cluster = hardware_from_args(args)
    if any(u < 1 for u in args.ulysses_sizes):
        raise SystemExit(f"--ulysses-sizes must be positive (got {args.ulysses_sizes})")
    if any(c < 1 for c in args.cp_sizes):
        raise SystemExit(f"--cp-sizes must be positive (got {args.cp_sizes})")
    if args.longest_sequence:
        return main_longest(args, model, gpu, cluster)
    plans = plan_layouts(model, gpu, cluster, args.num_gpus, args.seq_length, args.global_batch_size,
                         micro_batch_sizes=args.micro_batch_sizes, partition_method=args.pp_partition_method,
                         recompute={"auto": (True, False), "yes": (True,), "no": (False,)}[args.recompute],
                         zero_stages=tuple(args.zero_stages),
                         include_infeasible=args.show_infeasible,
                         sequence_parallel=SEQUENCE_PARALLEL[args.sequence_parallel],
                         ulysses_sizes=tuple(args.ulysses_sizes),
                         store_attention_scores=args.attention == "materialized",
                         ep_sizes=ep_sizes_from_args(args, model), schedules=tuple(args.schedules),
                         virtual_stages=tuple(args.virtual_stages), cp_sizes=tuple(args.cp_sizes))
    rows = [p.row() for p in plans[:args.top]]
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(model), "gpu": dataclasses.asdict(gpu),
                          "cluster": dataclasses.asdict(cluster), "num_gpus": args.num_gpus,
                          "seq_length": args.seq_length, "global_batch_size": args.global_batch_size,
                          "num_feasible": sum(p.fits for p in plans), "layouts": rows}))
    else:
        fp8 = f", FP8 {args.fp8_format} {args.fp8_recipe} (MFU against the bf16 peak)" if args.fp8_format else ""
        print(f"{model.total_params() / 1e9:.1f}B parameters on {args.num_gpus} x {gpu.name} ({cluster.name}), "
              f"seq {args.seq_length}, global batch {args.global_batch_size}{fp8}: "
              f"{sum(p.fits for p in plans)} layouts fit")
        print(format_table(rows))
    if not any(p.fits for p in plans):
        print("no layout fits: more GPUs, a smaller micro-batch or a smaller global batch", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
