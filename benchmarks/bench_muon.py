"""The optimizer step's cost on CPU: Muon (--optimizer muon) against AdamW (--optimizer adam), one process, over the
parameters of a small GPT (the shapes pretrain_gpt.py builds: word embeddings and output layer [V, h], per layer the
fused QKV [3h, h], the attention's dense [h, h], the MLP's [4h, h] and [h, 4h], their biases and two LayerNorms).

    python -m benchmarks.bench_muon --threads 2 --output benchmarks/results/muon_step_<date>.json

Paths, each the client optimizer megatron.engine.optimizer.build_client_optimizer gives, stepped on fixed random
gradients (no model forward / backward: the step alone):
    adam         torch AdamW (foreach), Megatron's "adam"
    muon_fp32    Muon with the Newton-Schulz iteration in fp32 (--muon-fp32-matmul-prec high), 5 quintic steps
    muon_bf16    the same in bf16 (--muon-fp32-matmul-prec medium, Megatron-LM's default)
Per path: median seconds per step over --reps after --warmup, its ratio to adam's, and for Muon the Newton-Schulz
FLOPs per step (per m x n matrix, m <= n, and step: 2 m^2 n for X X^T, 2 m^3 for A A, 2 m^2 n for B X) and the
GFLOP/s they reach. The matrices Muon takes and the parameters left on AdamW are counted. Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from benchmarks._common import emit, machine
from benchmarks.bench_attention import cpu_flags
from megatron.config import OptimizerConfig
from megatron.engine.optimizer import build_client_optimizer


class GPTShapes(torch.nn.Module):
    """The parameters of a GPT of ``layers`` layers, hidden ``h``, vocabulary ``vocab``, named as the model names them."""

    def __init__(self, layers: int, h: int, vocab: int):
        super().__init__()
        self.shapes = {"word_embeddings.weight": (vocab, h), "output_layer.weight": (vocab, h),
                       "final_layernorm.weight": (h,), "final_layernorm.bias": (h,)}
        for i in range(layers):
            p = f"layers.{i}."
            self.shapes.update({p + "input_layernorm.weight": (h,), p + "input_layernorm.bias": (h,),
                                p + "self_attention.query_key_value.weight": (3 * h, h),
                                p + "self_attention.query_key_value.bias": (3 * h,),
                                p + "self_attention.dense.weight": (h, h), p + "self_attention.dense.bias": (h,),
                                p + "post_attention_layernorm.weight": (h,), p + "post_attention_layernorm.bias": (h,),
                                p + "mlp.dense_h_to_4h.weight": (4 * h, h), p + "mlp.dense_h_to_4h.bias": (4 * h,),
                                p + "mlp.dense_4h_to_h.weight": (h, 4 * h), p + "mlp.dense_4h_to_h.bias": (h,)})
        generator = torch.Generator().manual_seed(0)
        self._params = torch.nn.ParameterList()
        self._names = []
        for name, shape in self.shapes.items():
            self._params.append(torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02))
            self._names.append(name)

    def named_parameters(self, *args, **kwargs):
        yield from zip(self._names, self._params, strict=True)


def ns_flops(shapes, steps: int) -> int:
    total = 0
    for rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        total += steps * (4 * m * m * n + 2 * m ** 3)
    return total


def time_steps(optimizer, params, reps: int, warmup: int) -> list[float]:
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=generator) * 1e-3 for p in params]
    out = []
    for i in range(warmup + reps):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        start = time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            out.append(elapsed)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = machine()
    h = args.hidden_size
    model_config = types.SimpleNamespace(num_attention_heads=args.heads, num_kv_heads=args.heads, head_dim=h // args.heads)
    paths = {"adam": {"optimizer": "adam"},
             "muon_fp32": {"optimizer": "muon", "muon_fp32_matmul_prec": "high"},
             "muon_bf16": {"optimizer": "muon", "muon_fp32_matmul_prec": "medium"}}
    results = {}
    for name, flags in paths.items():
        model = GPTShapes(args.layers, h, args.vocab)
        params = [p for _, p in model.named_parameters()]
        optimizer = build_client_optimizer(model, OptimizerConfig(lr=1e-3, **flags), model_config=model_config)
        seconds = time_steps(optimizer, params, args.reps, args.warmup)
        median = statistics.median(seconds)
        entry = {"median_s": median, "min_s": min(seconds), "max_s": max(seconds)}
        if flags["optimizer"] == "muon":
            groups = optimizer.param_groups
            matrices = [tuple(p.shape) for g in groups if g["muon"] for p in g["params"]]
            # the QKV matrices are orthogonalised as their query, key and value rows (h x h each)
            split = [(h, h)] * 3 * sum(1 for s in matrices if s == (3 * h, h)) + [s for s in matrices if s != (3 * h, h)]
            flops = ns_flops(split, 5)
            entry.update({"muon_matrices": len(matrices),
                          "muon_params": sum(r * c for r, c in matrices),
                          "adam_params": sum(p.numel() for g in groups if not g["muon"] for p in g["params"]),
                          "ns_gflop_per_step": flops / 1e9, "ns_gflops_per_s": flops / median / 1e9})
        results[name] = entry
    for entry in results.values():
        entry["vs_adam"] = entry["median_s"] / results["adam"]["median_s"]
    result = {"benchmark": "muon_step", "unit": "seconds per optimizer step (median)",
              "config": vars(args), "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(),
              "machine_at_start": start, "total_params": sum(p.numel() for p in params), "paths": results}
    emit(result, args.output)
    return result


if __name__ == "__main__":
    main()
