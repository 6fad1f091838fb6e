"""Per-document attention (--reset-attention-mask) against whole-sample causal attention on one long packed sample,
by each --attention-backend path the model has: time and memory, side by side in one run.

    python -m benchmarks.bench_document_attention --output benchmarks/results/document_attention_<date>.json
    python -m benchmarks.bench_document_attention --seq 16384 --documents 8 --alibi

A sample of ``--seq`` tokens packs ``--documents`` documents of random lengths (seeded; each at least a quarter of
the mean); with document masks a query sees the keys before it in its own document only. Paths, through the
model's own code (megatron/model/attention_core.py, as megatron/model/attention.py calls it):
    sdpa     causal: F.scaled_dot_product_attention with is_causal (with --alibi: the shared [1, np, s, s] bias,
             cached across calls, so not in the peak); documents: ``sdpa_per_document``, one call per document on
             its own queries and keys (the model's path without dropout); "documents dense": the
             ``document_causal_mask`` a dropout run still uses, a boolean [b, 1, s, s] (with --alibi an additive
             [b, np, s, s] bias) built per call and kept for backward
    flex     flex_core_attention with a causal block mask, or a document mask_mod (no [s, s] tensor; on CPU the
             backward recomputes blocks of queries with SDPA and builds [b, 1, c, s] masks)
    unfused  unfused_core_attention (plain matmuls, fp32 softmax, the [b, np, s, s] probabilities kept), causal or
             the document mask; skipped above --unfused-max-gib of predicted scores
Per path and mask: median forward + backward seconds, median forward seconds, the bytes kept for backward (saved
tensor hooks) and the peak RSS growth of one forward + backward (``bench_attention.measure``), the mask's own bytes,
and documents / causal ratios. The work a document mask could skip: the visible (query, key) pairs are sum d_i^2 / 2
against s^2 / 2 for the whole sample (``visible_pairs_fraction``). Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks._common import emit, machine
from benchmarks.bench_attention import cpu_flags, measure
from megatron.model.attention import shared_alibi_bias
from megatron.model.attention_core import (
    document_causal_mask,
    flex_core_attention,
    sdpa_per_document,
    unfused_core_attention,
)
from megatron.model.positional import alibi_slopes


def document_ids(seq: int, documents: int, seed: int = 0) -> torch.Tensor:
    """[1, seq] int64: ``documents`` consecutive runs of random lengths (each at least a quarter of the mean)."""
    gen = torch.Generator().manual_seed(seed)
    floor = seq // (4 * documents)
    weights = torch.rand(documents, generator=gen) + 0.25
    lengths = (floor + weights / weights.sum() * (seq - floor * documents)).long()
    lengths[-1] += seq - int(lengths.sum())
    return torch.repeat_interleave(torch.arange(documents), lengths)[None]


def paths(ids: torch.Tensor, heads: int, alibi: bool) -> dict:
    """(backend, mask) -> fn(q, k, v) -> context, as the model calls each backend (q, k, v [b, np, s, hn])."""
    slopes = tuple(alibi_slopes(heads)) if alibi else None
    slopes_t = torch.tensor(slopes) if alibi else None

    def scale(q):
        return 1 / math.sqrt(q.shape[-1])

    def causal_bias(q):
        return shared_alibi_bias(slopes, 0, q.shape[2], q.shape[2], q.dtype, q.device) if alibi else None

    def sdpa(q, k, v):
        bias = causal_bias(q)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None,
                                                                scale=scale(q))

    def sdpa_dense_documents(q, k, v):
        mask = document_causal_mask(ids, slopes_t, q.dtype)  # [b, 1, s, s] bool or [b, np, s, s] bias
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale(q))

    def unfused(documents: bool):
        def run(q, k, v):
            mask = document_causal_mask(ids, slopes_t, torch.float32) if documents else causal_bias(q)
            return unfused_core_attention(q, k, v, mask, 0.0, scale(q))
        return run

    def flex(documents: bool):
        return lambda q, k, v: flex_core_attention(q, k, v, slopes, scale(q), ids if documents else None)

    out = {("sdpa", "causal"): sdpa,
           ("sdpa", "documents"): lambda q, k, v: sdpa_per_document(q, k, v, ids, slopes_t, scale(q)),
           ("sdpa", "documents dense"): sdpa_dense_documents}
    out.update({(name, mask): build(mask == "documents") for name, build in (("flex", flex), ("unfused", unfused))
                for mask in ("causal", "documents")})
    return out


def run(seq: int, documents: int, heads: int, head_dim: int, dtype_name: str, reps: int, alibi: bool,
        unfused_max_gib: float) -> dict:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    ids = document_ids(seq, documents)
    lengths = torch.bincount(ids[0]).tolist()
    out = {"document_lengths": lengths,
           "visible_pairs_fraction": sum(d * (d + 1) for d in lengths) / (seq * (seq + 1)),
           "mask_mib": {"causal": 0.0 if not alibi else heads * seq * seq * torch.finfo(dtype).bits / 8 / 2 ** 20,
                        "documents": seq * seq * (heads * torch.finfo(dtype).bits / 8 if alibi else 1) / 2 ** 20},
           "paths": {}}
    scores_gib = 3 * heads * seq * seq * 4 / 2 ** 30  # fp32 scores, probabilities and their gradient
    for (name, mask), fn in paths(ids, heads, alibi).items():
        if name == "unfused" and scores_gib > unfused_max_gib:
            out["paths"][f"{name} {mask}"] = {"skipped": f"its fp32 [np, s, s] scores, probabilities and their "
                                                         f"gradient ({scores_gib:.1f} GiB) exceed --unfused-max-gib "
                                                         f"{unfused_max_gib}"}
            continue
        row = measure(name, fn, 1, heads, seq, head_dim, dtype, "cpu", reps)
        row.pop("materialized_bias_mib", None)  # bench_attention's ALiBi figure; this benchmark's is mask_mib
        out["paths"][f"{name} {mask}"] = row
    for name, mask in (("sdpa", "documents"), ("sdpa", "documents dense"), ("flex", "documents"),
                       ("unfused", "documents")):
        causal, docs = out["paths"][f"{name} causal"], out["paths"][f"{name} {mask}"]
        if "skipped" in causal or "skipped" in docs:
            continue
        out[f"{name}_{mask.replace(' ', '_')}_over_causal"] = {key: round(docs[key] / causal[key], 3) for key in
                                                ("fwd_bwd_s", "fwd_s", "saved_for_backward_mib",
                                                 "peak_rss_above_start_mib") if causal.get(key)}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--alibi", action="store_true", help="ALiBi positions (a bias) instead of none in the core "
                                                         "(rotary positions are applied before it)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--unfused-max-gib", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    before = machine()
    results = run(args.seq, args.documents, args.heads, args.head_dim, args.dtype, args.reps, args.alibi,
                  args.unfused_max_gib)
    config = {k: v for k, v in vars(args).items() if k != "output"}
    emit({"benchmark": "document_attention", "device": "cpu", "cpu_flags": cpu_flags(),
          "threads": torch.get_num_threads(), "config": config, "results": results, "machine": before}, args.output)


if __name__ == "__main__":
    main()
