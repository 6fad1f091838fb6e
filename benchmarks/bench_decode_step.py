"""One continuous-batching decode step in process (no HTTP): where its CPU time goes at b rows.

    python -m benchmarks.bench_decode_step [--output benchmarks/results/decode_step_DATE.json]

The model of benchmarks/bench_serving.py (random BLOOM-style: ALiBi, fp32, 8 heads, 400-token vocabulary)
on one torch thread, through ``BatchDecoder`` / ``BatchRunner`` as the server runs it: b sequences with
prompts of 1 to 24 tokens join a decoder whose caches persist between batches (as the server's do), then
32 steps are timed. For b in ``--batches``:

    step_ms            BatchDecoder.step: the forward, sampling and bookkeeping
    forward_ms         BatchRunner.decode alone (the model's forward over the batch's caches)
    linears_ms         the model's 17 weight matrices applied with F.linear to [1, b, in] inputs alone, the
                       matrix products that batching cannot amortize: their cost grows with b
    attention_ms       unfused_core_attention (the decode path) at 40 keys, once per layer, alone
    rest_ms            forward_ms - linears_ms - attention_ms: the small ops and Python of the forward
    tokens_per_s       b / step
    speedup_over_b1    tokens_per_s / that of b = 1 (what a batched server could gain at most, were the
                       one-at-a-time server's requests free of HTTP and prompt passes)

Times are CPU time of the timing thread (time.thread_time), lower quartile of ``--reps`` batches: other jobs
on the machine stretch wall-clock time far more. Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks import _common
from megatron.config import ModelConfig
from megatron.inference.batching import BatchDecoder, BatchRunner, GeneratingSequence
from megatron.inference.generation import SamplingParams
from megatron.model import GPTModel
from megatron.model.attention_core import unfused_core_attention
from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear

STEPS = 32  # the benchmark's max_new_tokens


def build_model(args) -> GPTModel:
    config = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=8,
                         padded_vocab_size=512, original_vocab_size=400, seq_length=256,
                         position_embedding_type="alibi", embed_layernorm=True, hidden_dropout=0.0,
                         attention_dropout=0.0, init_method_std=0.1, seed=1234).validate()
    return GPTModel(config).eval()


def lower_quartile(run, reps: int, prepare=None) -> float:
    """CPU seconds of one call of ``run(state)``, STEPS calls per batch, the lower quartile of ``reps`` batches."""
    times = []
    for _ in range(reps):
        state = prepare() if prepare else None
        start = time.thread_time()
        for _ in range(STEPS):
            run(state)
        times.append((time.thread_time() - start) / STEPS)
    return sorted(times)[len(times) // 4]


def measure(model: GPTModel, b: int, reps: int) -> dict:
    decoder = BatchDecoder(BatchRunner(model, 400), max_batch_size=max(b, 1))
    params = SamplingParams(max_new_tokens=10 * STEPS, greedy=True)

    def fresh_batch() -> BatchDecoder:
        decoder.remove(list(decoder.rows))
        decoder.add([GeneratingSequence([1 + (i * 7 + j) % 300 for j in range(1 + (i * 5) % 24)], params)
                     for i in range(b)])
        return decoder

    fresh_batch().step()  # the caches' room, and the kernels' first calls
    step = lower_quartile(lambda d: d.step(), reps, fresh_batch)
    forward = lower_quartile(lambda d: d.runner.decode([s.token_ids[-1] for s in d.rows]), reps, fresh_batch)
    weights = [(m.weight, m.bias) for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    weights.append((model.embedding.word_embeddings.weight, None))  # the tied output layer's product
    inputs = {w.shape[1]: torch.randn(1, b, w.shape[1]) for w, _ in weights}
    attention_layer = model.layers[0].self_attention
    heads, hn = attention_layer.num_heads_per_partition, attention_layer.head_dim
    store = torch.randn(b, heads, 64, hn)  # [b, ng, cap, hn], 40 of 64 positions filled
    query, mask = torch.randn(b, heads, 1, hn), torch.zeros(b, heads, 1, 40)
    with torch.inference_mode():
        linears = lower_quartile(lambda _: [F.linear(inputs[w.shape[1]], w, bias) for w, bias in weights], reps)
        attention = lower_quartile(lambda _: [unfused_core_attention(query, store[:, :, :40], store[:, :, :40], mask, 0.0, 0.2)
                                              for _ in model.layers], reps)
    ms = lambda seconds: round(seconds * 1e3, 3)  # noqa: E731
    return {"batch": b, "step_ms": ms(step), "forward_ms": ms(forward), "linears_ms": ms(linears),
            "num_linears": len(weights), "attention_ms": ms(attention), "rest_ms": ms(forward - linears - attention),
            "linears_fraction_of_step": round(linears / step, 3), "tokens_per_s": round(b / step, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--batches", default="1,4,16,64", help="comma-separated rows per step")
    p.add_argument("--reps", type=int, default=12)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches must list positive row counts, got {batches}")
    torch.set_num_threads(1)
    model = build_model(args)
    machine = _common.machine()
    rows = [measure(model, b, args.reps) for b in batches]
    for row in rows:
        row["speedup_over_b1"] = round(row["tokens_per_s"] / rows[0]["tokens_per_s"], 2) if batches[0] == 1 else None
    _common.emit({"benchmark": "decode_step", "machine": machine,
                  "config": {"num_layers": args.num_layers, "hidden_size": args.hidden_size, "heads": 8, "vocab": 400,
                             "position": "alibi", "dtype": "fp32", "torch_threads": 1, "steps": STEPS,
                             "reps": args.reps, "timing": "thread CPU time, lower quartile"},
                  "steps": rows}, args.output)


if __name__ == "__main__":
    main()
