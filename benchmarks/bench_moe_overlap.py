"""The expert-parallel all-to-all exposed with and without the overlap (--overlap-moe-expert-parallel-comm,
--moe-shared-expert-overlap), side by side in one run: 2 processes (EP = 2, gloo, --threads each), one MoE layer's
forward + backward on each rank's tokens, per mode:

    blocking          every exchange waited for where it is started (the default)
    overlap           the tokens in two parts: one part's exchange in flight while the other's experts compute
    overlap+shared    and the shared expert computing while the dispatch travels

Per mode and rank: the median forward + backward seconds over --reps after --warmup, the row exchanges per
forward + backward (dispatch and combine, forward and backward), the bytes this rank sent, and the host time
blocked in them (``megatron.parallel.all_to_all.take_exchange_stats``): in the blocking mode that is every exchange
whole (the transfer and the wait for the slower rank), in the overlapped ones what computation did not hide. A
training step has one such forward + backward per MoE layer and micro-batch.

CPU figures say little about GPUs: here the exchanges are gloo's over shared memory, on the same two cores that
compute (gloo's worker threads take cycles from the experts' GEMMs); on GPUs NCCL moves the rows over NVLink or
the network beside the SMs, and ``wait`` does not block the host at all (the blocked time is then no measure; use
the profiler). Prints ONE JSON line.

    python -m benchmarks.bench_moe_overlap --output benchmarks/results/moe_overlap_<date>.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks import _common  # noqa: F401  (sets DS_ACCELERATOR before deepspeed is imported)
from benchmarks._common import emit, machine
from benchmarks.bench_attention import cpu_flags

MODES = {"blocking": (False, False), "overlap": (True, False), "overlap+shared": (True, True)}


def _rank(rank, world_size, args):
    import torch
    import torch.distributed as dist

    from megatron.config import ModelConfig
    from megatron.config.moe import MoEConfig
    from megatron.model.moe import set_aux_loss_scale
    from megatron.model.transformer import _mlp
    from megatron.parallel.all_to_all import take_exchange_stats
    from megatron.parallel.state import LayerGroups

    torch.set_num_threads(args.threads)
    group = dist.new_group(list(range(world_size)))
    seq = args.tokens // args.micro_batch
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(seq, args.micro_batch, args.hidden_size, generator=gen)
    g = torch.randn(seq, args.micro_batch, args.hidden_size, generator=gen)
    layers = {}
    for mode, (overlap, shared) in MODES.items():
        moe = MoEConfig(num_experts=args.num_experts, layer_pattern=(True,), router_topk=args.topk,
                        aux_loss_coeff=0.01, shared_expert_intermediate_size=args.shared_size,
                        overlap_expert_parallel_comm=overlap, shared_expert_overlap=shared).validate(1)
        config = ModelConfig(num_layers=1, hidden_size=args.hidden_size, num_attention_heads=8, padded_vocab_size=256,
                             seq_length=seq, ffn_hidden_size=args.ffn_hidden_size, swiglu=True, moe=moe,
                             hidden_dropout=0.0, attention_dropout=0.0).validate()
        layers[mode] = _mlp(config, LayerGroups(ep=group), 0)  # the same weights in every mode
        set_aux_loss_scale(layers[mode], 1.0)
    seconds, stats = {mode: [] for mode in MODES}, {mode: [] for mode in MODES}
    for rep in range(args.warmup + args.reps):
        for mode, layer in layers.items():  # the modes in turn, so that a drift of the machine hits each alike
            inputs = x.clone().requires_grad_()
            dist.barrier(group)
            take_exchange_stats()
            start = time.perf_counter()
            (layer(inputs) * g).sum().backward()
            elapsed = time.perf_counter() - start
            taken = take_exchange_stats()
            layer.zero_grad(set_to_none=True)
            if rep >= args.warmup:
                seconds[mode].append(elapsed)
                stats[mode].append(taken)
    out = {mode: {"median_fwd_bwd_s": statistics.median(seconds[mode]),
                  "median_blocked_s": statistics.median(s.blocked_seconds for s in stats[mode]),
                  "exchanges": stats[mode][0].calls, "bytes_sent": stats[mode][0].bytes_sent} for mode in MODES}
    return out


def main(argv=None) -> dict:
    from megatron.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank and micro-batch")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--ffn-hidden-size", type=int, default=1024, help="each expert's width")
    parser.add_argument("--shared-size", type=int, default=1024, help="the shared expert's width")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (2 processes)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    per_rank = run_distributed(_rank, world_size=2, args=(args,), timeout=1800)
    modes = {}
    for mode in MODES:
        rows = [r[mode] for r in per_rank]
        blocked = max(r["median_blocked_s"] for r in rows)
        modes[mode] = {"per_rank": rows, "fwd_bwd_s": max(r["median_fwd_bwd_s"] for r in rows),
                       "exposed_all_to_all_s": blocked}
    base = modes["blocking"]
    for entry in modes.values():
        entry["speedup_vs_blocking"] = base["fwd_bwd_s"] / entry["fwd_bwd_s"]
        entry["exposed_vs_blocking"] = (entry["exposed_all_to_all_s"] / base["exposed_all_to_all_s"]
                                        if base["exposed_all_to_all_s"] else None)
    result = {"benchmark": "moe_overlap", "config": vars(args), "machine": machine(), "cpu_flags": cpu_flags(),
              "unit": "per MoE layer forward + backward of one micro-batch (slowest rank's median)", "modes": modes}
    emit(result, args.output)
    return result


if __name__ == "__main__":
    main()
