"""The MoE layer's forward + backward tokens/s: our grouped experts against a per-expert Python loop and against
transformers' MixtralSparseMoeBlock, on the same shapes and the same weights, side by side in one run.

    python -m benchmarks.bench_moe --output benchmarks/results/moe_<date>.json
    python -m benchmarks.bench_moe --tokens 4096 --hidden-size 1024 --ffn-hidden-size 3584 --num-experts 8 --topk 2

Paths (one process, no expert parallelism; softmax top-k routing renormalised, SwiGLU experts, no biases):
    grouped      megatron.model.moe.MoELayer: router, dispatch sorted by expert, the local experts as one padded
                 torch.bmm per matrix (megatron/model/moe/experts.py), combine
    loop         the same layer with its experts run one by one (a Python loop of two matmuls per expert)
    transformers transformers' MixtralSparseMoeBlock holding the same router and expert weights, with each experts
                 implementation in --hf-implementations that runs here ("eager" is its per-expert loop, "grouped_mm"
                 torch's grouped GEMM; one that does not run is reported with its error). Not by default:
                 "batched_mm", which gathers a copy of the expert's weights for every routed token (T k x 3 f h
                 values: 15 GB at 1024 tokens, h 512, f 1792, top-2), more than a small machine holds
Per path: median forward + backward seconds over --reps after --warmup, tokens/s, and the largest difference of
its output from the grouped path's (the paths compute the same function). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._common import emit, machine
from benchmarks.bench_attention import cpu_flags
from megatron.config import ModelConfig
from megatron.config.moe import MoEConfig
from megatron.model.moe import MoELayer


class LoopExperts(nn.Module):
    """The weights of a ``GroupedExperts``, run one expert at a time (rows grouped by expert, ``counts`` each)."""

    def __init__(self, grouped):
        super().__init__()
        self.w1, self.w2 = grouped.w1, grouped.w2  # [E, 2f, h] interleaved gate / up rows, [E, h, f]

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outputs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            gate, up = (rows[start:start + n] @ self.w1[e].t()).unflatten(-1, (-1, 2)).unbind(-1)  # 2 x [n, f]
            outputs.append((F.silu(gate) * up) @ self.w2[e].t())  # [n, h]
            start += n
        return torch.cat(outputs)


def build_layers(args) -> dict:
    """name -> module mapping [s, b, h] to [s, b, h] (transformers' block: [b, s, h], transposed around it)."""
    moe = MoEConfig(num_experts=args.num_experts, layer_pattern=(True,), ffn_hidden_size=args.ffn_hidden_size,
                    router_topk=args.topk).validate(1)
    config = ModelConfig(num_layers=1, hidden_size=args.hidden_size, num_attention_heads=8, padded_vocab_size=128,
                         seq_length=args.tokens, ffn_hidden_size=args.ffn_hidden_size, swiglu=True,
                         add_bias_linear=False, hidden_dropout=0.0,
                         attention_dropout=0.0, seed=1, moe=moe).validate()
    grouped = MoELayer(config)
    loop = copy.deepcopy(grouped)
    loop.experts = LoopExperts(loop.experts)
    layers = {"grouped": grouped, "loop": loop}
    for implementation in args.hf_implementations:
        layers[f"transformers_{implementation}"] = _mixtral_block(grouped, args, implementation)
    return layers


class _SequenceFirst(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, hidden):  # [s, b, h]
        return self.block(hidden.transpose(0, 1)).transpose(0, 1)


def _mixtral_block(ours: MoELayer, args, implementation: str) -> nn.Module:
    """transformers' MixtralSparseMoeBlock with ``ours``' weights: gate_up_proj is [gate; up] stacked, ours
    interleaves them per row."""
    from transformers import MixtralConfig  # noqa: PLC0415 (optional: only this path needs transformers)
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: PLC0415 (as above)

    config = MixtralConfig(hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
                           num_local_experts=args.num_experts, num_experts_per_tok=args.topk, router_jitter_noise=0.0)
    config._experts_implementation = implementation
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        w1 = ours.experts.w1  # [E, 2f, h], rows gate_0, up_0, gate_1, ...
        block.experts.gate_up_proj.copy_(torch.cat([w1[:, 0::2], w1[:, 1::2]], dim=1))
        block.experts.down_proj.copy_(ours.experts.w2)
    return _SequenceFirst(block)


def time_layer(layer: nn.Module, hidden: torch.Tensor, warmup: int, reps: int) -> tuple[float, torch.Tensor]:
    """Median forward + backward seconds, and the output of the first call."""
    times, first = [], None
    for i in range(warmup + reps):
        x = hidden.detach().requires_grad_()
        start = time.perf_counter()
        out = layer(x)
        out.backward(torch.ones_like(out))
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if first is None:
            first = out.detach()
    return statistics.median(times), first


def run(args) -> dict:
    torch.manual_seed(0)
    layers = build_layers(args)
    hidden = torch.randn(args.tokens, 1, args.hidden_size)  # [s, b, h]
    rows, reference = {}, None
    for name, layer in layers.items():
        try:
            seconds, out = time_layer(layer, hidden, args.warmup, args.reps)
        except Exception as error:  # noqa: BLE001 - an implementation that does not run here is reported
            rows[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
            continue
        reference = out if reference is None else reference
        rows[name] = {"fwd_bwd_s": round(seconds, 5), "tokens_per_s": round(args.tokens / seconds, 1),
                      "max_abs_diff_vs_grouped": float((out - reference).abs().max())}
    grouped = rows["grouped"]["tokens_per_s"]
    for row in rows.values():
        if "tokens_per_s" in row:
            row["speed_vs_grouped"] = round(row["tokens_per_s"] / grouped, 3)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--ffn-hidden-size", type=int, default=3584)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hf-implementations", nargs="*", default=["eager", "grouped_mm"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = machine()
    results = run(args)
    config = {k: v for k, v in vars(args).items() if k != "output"}
    emit({"benchmark": "moe_layer", "config": config, "dtype": "fp32", "device": "cpu", "cpu_flags": cpu_flags(),
          "threads": torch.get_num_threads(), "machine_at_start": start, "results": results}, args.output)


if __name__ == "__main__":
    main()
