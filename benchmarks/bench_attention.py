"""The attention core alone, ALiBi + causal, by each --attention-backend path the model has: time and memory.

    python -m benchmarks.bench_attention --output benchmarks/results/attention_<date>.json
    python -m benchmarks.bench_attention --seq-lengths 512 2048 8192 --device cuda   (on a GPU)

Paths, all through the model's own code (megatron/model/attention.py, attention_core.py):
    sdpa   F.scaled_dot_product_attention with the materialized bias [1, np, s, s] (shared_alibi_bias)
    flex   flex_core_attention: compiled flex_attention, ALiBi score_mod, causal block mask (on CPU the
           backward is the blockwise SDPA recomputation; torch has no flex backward there)
    unfused  unfused_core_attention (eager here: plain matmuls, fp32 softmax, the [np, s, s] probabilities kept)
    flash  flash_core_attention (only where flash-attn is importable, CUDA)
Per path and length: median forward + backward seconds, median forward-only seconds, the bytes kept for
backward (saved-tensor hooks: what a layer holds between its forward and backward) plus the bias the path
materializes, and on CUDA torch.cuda.max_memory_allocated. Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import time

import torch

from benchmarks._common import emit, machine
from megatron.model.attention import shared_alibi_bias
from megatron.model.attention_core import (
    flash_attn_available,
    flash_core_attention,
    flex_core_attention,
    unfused_core_attention,
)
from megatron.model.positional import alibi_slopes


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cpu_flags() -> list[str]:
    out = subprocess.run(["grep", "-o", r"amx[a-z_]*\|avx512_bf16\|avx2", "/proc/cpuinfo"], capture_output=True,
                         text=True).stdout.split()
    return sorted(set(out))


def attention_paths(heads: int, device: str) -> dict:
    """name -> fn(q, k, v) -> context, each path as the model runs it (q, k, v [b, np, s, hn])."""
    slopes = tuple(alibi_slopes(heads))

    def sdpa(q, k, v):
        bias = shared_alibi_bias(slopes, 0, q.shape[2], k.shape[2], q.dtype, q.device)  # [1, np, s, s]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1 / math.sqrt(q.shape[-1]))

    def unfused(q, k, v):
        bias = shared_alibi_bias(slopes, 0, q.shape[2], k.shape[2], q.dtype, q.device)  # [1, np, s, s]
        return unfused_core_attention(q, k, v, bias, 0.0, 1 / math.sqrt(q.shape[-1]))

    paths = {"sdpa": sdpa, "flex": lambda q, k, v: flex_core_attention(q, k, v, slopes, 1 / math.sqrt(q.shape[-1])),
             "unfused": unfused}
    if device == "cuda" and flash_attn_available():
        slopes_t = torch.tensor(slopes, device=device)
        paths["flash"] = lambda q, k, v: flash_core_attention(q, k, v, slopes_t, 0.0, 1 / math.sqrt(q.shape[-1]))
    return paths


def median_time(fn, reps: int, device: str) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, fn, b: int, heads: int, seq: int, head_dim: int, dtype, device: str, reps: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, heads, seq, head_dim, generator=gen, device=device, dtype=dtype).requires_grad_()
               for _ in range(3))
    grad = torch.randn(b, heads, seq, head_dim, generator=gen, device=device, dtype=dtype)

    def fwd_bwd():
        fn(q, k, v).backward(grad)

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    fwd_bwd()  # warm-up: compilation for flex, first-call costs for the rest
    fwd()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = fn(q, k, v)
    del out
    result = {"fwd_bwd_s": median_time(fwd_bwd, reps, device), "fwd_s": median_time(fwd, reps, device),
              "saved_for_backward_mib": sum(saved) / 2 ** 20,
              "materialized_bias_mib": (heads * seq * seq * torch.finfo(dtype).bits / 8 / 2 ** 20
                                        if name in ("sdpa", "unfused") else 0.0)}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    else:
        result["peak_rss_above_start_mib"] = cpu_peak_rss_growth(fwd_bwd) / 2 ** 20
    return result


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def cpu_peak_rss_growth(fn) -> int:
    """Bytes the process's peak RSS rose above its RSS at the start of one ``fn()``: writing 5 to
    /proc/self/clear_refs resets the peak (VmHWM) to the current RSS (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _rss_kib("VmRSS")
    fn()
    return (_rss_kib("VmHWM") - start) * 1024


def run(seq_lengths, b: int, heads: int, head_dim: int, dtype_name: str, device: str, reps: int,
        unfused_max_seq: int = 2048) -> dict:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    out = {}
    for seq in seq_lengths:
        paths = attention_paths(heads, device)
        row = {}
        for name, fn in paths.items():
            if name == "unfused" and seq > unfused_max_seq:
                row[name] = {"skipped": f"s > --unfused-max-seq {unfused_max_seq}: its fp32 scores, probabilities and "
                                        f"their gradients ({4 * 4 * b * heads * seq * seq / 2 ** 30:.0f} GiB) would not "
                                        f"fit beside the rest on this machine"}
                continue
            row[name] = measure(name, fn, b, heads, seq, head_dim, dtype, device, reps)
        row["flex_over_sdpa_fwd_bwd"] = row["flex"]["fwd_bwd_s"] / row["sdpa"]["fwd_bwd_s"]
        row["flex_over_sdpa_fwd"] = row["flex"]["fwd_s"] / row["sdpa"]["fwd_s"]
        out[f"s{seq}"] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output")
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--unfused-max-seq", type=int, default=2048, help="longest sequence the unfused path is run at")
    args = p.parse_args()
    before = machine()
    results = run(args.seq_lengths, args.batch, args.heads, args.head_dim, args.dtype, args.device, args.reps,
                  args.unfused_max_seq)
    emit({"benchmark": "attention", "device": args.device, "cpu_flags": cpu_flags(),
          "threads": torch.get_num_threads(),
          "config": {"seq_lengths": args.seq_lengths, "batch": args.batch, "heads": args.heads,
                     "head_dim": args.head_dim, "dtype": args.dtype, "reps": args.reps, "position": "alibi+causal",
                     "peak_rss_note": "sdpa's and unfused's bias is cached across calls (shared_alibi_bias): their "
                                      "peak_rss_above_start_mib excludes it; add materialized_bias_mib"},
          "results": results, "machine": before}, args.output)


if __name__ == "__main__":
    main()
