"""The MoE layer's forward + backward tokens/s: our experts (unpadded segments, the padded bmm, a per-expert loop)
against transformers' MixtralSparseMoeBlock, on the same shapes and the same weights, side by side in one run, in
fp32 and bf16, with the achieved GFLOP/s against one large GEMM of the same FLOPs on this CPU (the roofline).

    python -m benchmarks.bench_moe --threads 2 --output benchmarks/results/moe_layer_<date>.json
    python -m benchmarks.bench_moe --tokens 4096 --hidden-size 1024 --ffn-hidden-size 3584 --load-skew 2

Paths (one process, no expert parallelism; softmax top-k routing renormalised, SwiGLU experts, no biases):
    ours         megatron.model.moe.MoELayer: router, dispatch sorted by expert, the local experts unpadded as one
                 torch._grouped_mm per matrix on the sorted segments (megatron/model/moe/experts.py), combine
    ours_padded  the same layer with its experts padded to the busiest one and run as one torch.bmm per matrix
                 (the layer's fallback where _grouped_mm cannot run; before issue 36 its only path)
    ours_loop    the same layer with its experts run one by one (a Python loop of two matmuls per expert)
    transformers transformers' MixtralSparseMoeBlock holding the same router and expert weights, with each experts
                 implementation in --hf-implementations that runs here ("eager" is its per-expert loop, "grouped_mm"
                 torch's grouped GEMM; one that does not run is reported with its error). Not by default:
                 "batched_mm", which gathers a copy of the expert's weights for every routed token (T k x 3 f h
                 values: 15 GB at 1024 tokens, h 512, f 1792, top-2), more than a small machine holds
    gemm_roofline one [T k, h] x [h, 3 f] product with its two backward products (dX, dW): the FLOPs of the routed
                 experts' forward + backward in one large GEMM, what the kernels reach here without any grouping

--load-skew s adds s to expert 0's router logit on average (a shared direction added to the hidden states and to
expert 0's router row): 0 is near-balanced routing; the expert loads our router picks are reported.
Per dtype and path: median forward + backward seconds over --reps after --warmup, tokens/s, the experts' achieved
GFLOP/s (18 T k h f FLOPs: three h x f matrices, forward and two backward products; the router's are left out),
its fraction of the roofline's, the speed against ours and against transformers' best path, and the largest
difference of its output from ours (the paths compute the same function). Prints ONE JSON line.
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

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class LoopExperts(nn.Module):
    """The weights of a ``GroupedExperts``, run one expert at a time (rows grouped by expert, ``counts`` each)."""

    def __init__(self, grouped):
        super().__init__()
        self.w1, self.w2 = grouped.w1, grouped.w2  # [E, 2f, h] interleaved gate / up rows, [E, h, f]

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rows [M, h], counts [E], the rows' routing weights [M] (applied in the activation, as GroupedExperts
        does) -> [M, h]."""
        outputs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            gate, up = (rows[start:start + n] @ self.w1[e].t()).unflatten(-1, (-1, 2)).unbind(-1)  # 2 x [n, f]
            act = (F.silu(gate) * up).to(weight.dtype) * weight[start:start + n, None]  # [n, f]
            outputs.append(act.to(rows.dtype) @ self.w2[e].t())  # [n, h]
            start += n
        return torch.cat(outputs)


def build_layers(args, skew_direction: torch.Tensor) -> dict:
    """name -> module mapping [s, b, h] to [s, b, h] (transformers' block: [b, s, h], transposed around it)."""
    moe = MoEConfig(num_experts=args.num_experts, layer_pattern=(True,), ffn_hidden_size=args.ffn_hidden_size,
                    router_topk=args.topk).validate(1)
    config = ModelConfig(num_layers=1, hidden_size=args.hidden_size, num_attention_heads=8, padded_vocab_size=128,
                         seq_length=args.tokens, ffn_hidden_size=args.ffn_hidden_size, swiglu=True,
                         add_bias_linear=False, hidden_dropout=0.0,
                         attention_dropout=0.0, seed=1, moe=moe).validate()
    ours = MoELayer(config)
    with torch.no_grad():
        ours.router.weight[0] += args.load_skew * skew_direction
    padded = copy.deepcopy(ours)
    padded.experts.path = "padded"
    loop = copy.deepcopy(ours)
    loop.experts = LoopExperts(loop.experts)
    layers = {"ours": ours, "ours_padded": padded, "ours_loop": loop}
    for implementation in args.hf_implementations:
        layers[f"transformers_{implementation}"] = _mixtral_block(ours, args, implementation)
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


class GemmRoofline(nn.Module):
    """One [M, h] x [h, 3 f] product (M = T k) whose backward is dX and dW: the experts' FLOPs as one GEMM."""

    def __init__(self, args):
        super().__init__()
        self.topk = args.topk
        self.weight = nn.Parameter(torch.randn(3 * args.ffn_hidden_size, args.hidden_size) * 0.02)

    def forward(self, hidden):  # [s, b, h]: every token k times stands in for the routed rows
        return F.linear(hidden.reshape(-1, hidden.shape[-1]).repeat(self.topk, 1), self.weight)  # [T k, 3 f]


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


def expert_loads(layer: MoELayer, hidden: torch.Tensor) -> list[int]:
    with torch.no_grad():
        routing = layer.router(hidden.reshape(-1, hidden.shape[-1]))
    return torch.bincount(routing.expert_index.flatten(), minlength=layer.config.num_experts).tolist()



def _figures(value: float) -> float:
    """``value`` to 4 significant figures (a fixed number of decimals rounds a tiny shape's GFLOP/s to 0)."""
    return float(f"{value:.4g}")

def run_dtype(args, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    direction = F.normalize(torch.randn(args.hidden_size), dim=0)
    layers = build_layers(args, direction)
    hidden = torch.randn(args.tokens, 1, args.hidden_size) + direction  # [s, b, h]
    loads = expert_loads(layers["ours"], hidden)
    hidden = hidden.to(dtype)
    flops = 18 * args.tokens * args.topk * args.hidden_size * args.ffn_hidden_size
    rows, reference = {}, None
    roofline = GemmRoofline(args).to(dtype)
    seconds, _ = time_layer(roofline, hidden, args.warmup, args.reps)
    roof_gflops = flops / seconds / 1e9
    rows["gemm_roofline"] = {"fwd_bwd_s": _figures(seconds), "gflops": _figures(roof_gflops)}
    for name, layer in layers.items():
        layer.to(dtype)
        try:
            seconds, out = time_layer(layer, hidden, args.warmup, args.reps)
        except Exception as error:  # noqa: BLE001 - an implementation that does not run here is reported
            rows[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
            continue
        reference = out if reference is None else reference
        rows[name] = {"fwd_bwd_s": _figures(seconds), "tokens_per_s": _figures(args.tokens / seconds),
                      "expert_gflops": _figures(flops / seconds / 1e9),
                      "fraction_of_roofline": _figures(flops / seconds / 1e9 / roof_gflops),
                      "max_abs_diff_vs_ours": float((out.float() - reference.float()).abs().max())}
        if name == "ours":
            rows[name]["experts_path"] = "segments" if layer.experts.uses_segments(
                hidden.reshape(-1, args.hidden_size)) else "padded"
    timed = {name: row for name, row in rows.items() if "tokens_per_s" in row}
    hf = [row["tokens_per_s"] for name, row in timed.items() if name.startswith("transformers_")]
    best_hf = max(hf) if hf else None
    for name, row in timed.items():
        row["speed_vs_ours"] = round(row["tokens_per_s"] / timed["ours"]["tokens_per_s"], 3)
        if best_hf:
            row["speed_vs_best_transformers"] = round(row["tokens_per_s"] / best_hf, 3)
    mean = sum(loads) / len(loads)
    return {"expert_loads": loads, "busiest_over_mean": round(max(loads) / mean, 3), "routed_flops": flops,
            "paths": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--ffn-hidden-size", type=int, default=3584)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--load-skew", type=float, default=0.0,
                   help="added to expert 0's router logit on average (0: near-balanced routing)")
    p.add_argument("--hf-implementations", nargs="*", default=["eager", "grouped_mm"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = machine()
    results = {name: run_dtype(args, DTYPES[name]) for name in args.dtype}
    config = {k: v for k, v in vars(args).items() if k not in ("output", "dtype")}
    emit({"benchmark": "moe_layer", "config": config, "dtypes": args.dtype, "device": "cpu",
          "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "machine_at_start": start,
          "results": results}, args.output)


if __name__ == "__main__":
    main()
