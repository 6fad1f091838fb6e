"""Serving throughput and latency: continuous batching against one sequence at a time and transformers' generate.

    python -m benchmarks.bench_serving [--output benchmarks/results/serving_DATE.json]

One random BLOOM-style checkpoint (ALiBi, fp32, the tiny corpus's 400-token tokenizer) is served by
``tools/serve.py`` in two processes of their own (``--torch-threads``, default 1): ``--max-batch-size
64`` (continuous batching) and ``--max-batch-size 1`` (the one-at-a-time baseline). For each of 1, 4,
16 and 64 concurrent clients (a bounded loopback load: each client sends its next request when the
last is answered, ``--requests-per-client`` each), it reports the generated tokens per second over
the whole run and the p50 / p99 latency of a request (greedy, ``--max-new-tokens`` each, prompts of
1 to 24 tokens). The same weights exported to transformers (BloomForCausalLM) run ``generate``
(greedy, as many threads) on batches of the same sizes, left-padded: the static batching a script
would do, every row waiting for the batch's last one.

On a shared machine the load changes from minute to minute, so the three are measured interleaved
(for each client count: batched, one at a time, transformers), ``--rounds`` times; each figure is the
median over the rounds (every round's throughput is kept beside it), with the load average at each.
Beside the wall-clock figures, each server's CPU time over the measured requests (its threads' user +
system time from /proc, the HTTP loop's included) per generated token: other jobs on the cores stretch
the wall clock far more than they stretch a process's own CPU time, so ``cpu_ratio_one_at_a_time_over_batched``
is the steadier comparison on a loaded machine (it is not throughput: a server waiting for its clients uses none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks import _common

PROMPTS = ["The river", "Model data train the", "North city music", "A", "Pipeline stage tensor parallel gradient",
           "Once upon a time the city had a river and a music hall", "train", "data data data",
           "The north of the city is where the model", "Parallel", "music of the river stage north train model city",
           "gradient tensor"]
CLIENTS = (1, 4, 16, 64)


def cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split())
    return sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"})


def write_checkpoint(out_dir: str, corpus: dict, args) -> tuple:
    from megatron.checkpoint.run_state import converted_run_state
    from megatron.checkpoint.single_process import save_as_training_checkpoint
    from megatron.config import ModelConfig
    from megatron.model import GPTModel

    config = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=8,
                         padded_vocab_size=512, original_vocab_size=400, seq_length=256,
                         position_embedding_type="alibi", embed_layernorm=True, hidden_dropout=0.0,
                         attention_dropout=0.0, init_method_std=0.1, seed=1234).validate()
    state = GPTModel(config).state_dict()
    tokenizer = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": corpus["vocab_file"],
                 "merge_file": corpus["merge_file"], "tokenizer_model": None, "tokenizer_name_or_path": None}
    save_as_training_checkpoint(config, state, out_dir, 1, 1, run_state=converted_run_state(config, 1, 1,
                                                                                         tokenizer=tokenizer))
    return config, state


def start_server(ckpt: str, max_batch_size: int, torch_threads: int):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=_common.REPO)
    proc = subprocess.Popen([sys.executable, os.path.join(_common.REPO, "tools", "serve.py"), "--load", ckpt,
                             "--port", "0", "--max-batch-size", str(max_batch_size), "--max-pending-requests", "256",
                             "--max-new-tokens-limit", "256", "--torch-threads", str(torch_threads)],
                            env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("serving on http://"):
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return proc, int(line.split(":")[2].split(" ")[0])


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads, from /proc/PID/stat (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


async def load(port: int, pid: int, clients: int, requests_per_client: int, max_new_tokens: int) -> dict:
    import aiohttp

    latencies, tokens = [], 0

    async def client(session, c: int) -> None:
        nonlocal tokens
        for r in range(requests_per_client):
            body = {"prompt": PROMPTS[(c * requests_per_client + r) % len(PROMPTS)],
                    "max_new_tokens": max_new_tokens, "greedy": True}
            start = time.perf_counter()
            async with session.post(f"http://127.0.0.1:{port}/generate", data=json.dumps(body)) as reply:
                payload = await reply.json()
            latencies.append(time.perf_counter() - start)
            assert reply.status == 200, payload
            tokens += len(payload["completions"][0]["token_ids"])

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        # warm-up, not counted: the first products of each batch size are slow (kernel selection)
        await asyncio.gather(*(client(session, c) for c in range(clients)))
        latencies.clear()
        tokens = 0
        start, cpu_start = time.perf_counter(), process_cpu_seconds(pid)
        await asyncio.gather(*(client(session, c) for c in range(clients)))
        seconds, cpu_seconds = time.perf_counter() - start, process_cpu_seconds(pid) - cpu_start
    latencies.sort()

    def quantile(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 4)

    return {"clients": clients, "requests": len(latencies), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "p50_latency_s": quantile(0.5),
            "p99_latency_s": quantile(0.99), "server_cpu_s": round(cpu_seconds, 3),
            "server_cpu_ms_per_token": round(1e3 * cpu_seconds / tokens, 4)}


def server_threads(port: int) -> int:
    """torch.get_num_threads() in the server process, from its /health."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as reply:
        return json.load(reply)["torch_threads"]


def median_of_rounds(rounds: list[dict], key: str) -> dict:
    """The round with the median ``key`` (tokens_per_s), with every round's value and load beside it."""
    middle = sorted(rounds, key=lambda r: r[key])[len(rounds) // 2]
    extra = {}
    if "server_cpu_ms_per_token" in middle:  # the servers' rounds (not transformers')
        cpu = sorted(r["server_cpu_ms_per_token"] for r in rounds)
        extra = {"rounds_server_cpu_ms_per_token": [r["server_cpu_ms_per_token"] for r in rounds],
                 "median_server_cpu_ms_per_token": cpu[len(cpu) // 2]}
    return dict(middle, rounds_tokens_per_s=[r[key] for r in rounds],
                rounds_loadavg_1min=[r["loadavg_1min"] for r in rounds], **extra)


def transformers_generate(model, tokenizer, batch: int, args) -> dict:
    """BloomForCausalLM.generate on one left-padded batch of the same prompts (static batching)."""
    encoded = [tokenizer.tokenize(PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
    width = max(map(len, encoded))
    ids = torch.tensor([[0] * (width - len(e)) + e for e in encoded])  # [b, s], left-padded
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    kwargs = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                  do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        seconds = time.perf_counter() - start
    return {"batch": batch, "tokens": batch * args.max_new_tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(batch * args.max_new_tokens / seconds, 1), "latency_s": round(seconds, 4),
            "loadavg_1min": round(os.getloadavg()[0], 2)}


def measure_interleaved(ckpt: str, config, state, args) -> tuple[list, list, list, list]:
    """For each client count and round: batched, one at a time, transformers; the medians per count, and the
    servers' torch threads."""
    from transformers import BloomForCausalLM

    from megatron.checkpoint.hf.io import write_hf_model
    from megatron.inference.generation import Generator

    hf_dir = os.path.join(os.path.dirname(ckpt), "hf")
    write_hf_model(config, state, hf_dir)
    model = BloomForCausalLM.from_pretrained(hf_dir).eval()
    tokenizer = Generator.from_checkpoint(ckpt).tokenizer
    torch.set_num_threads(args.torch_threads)
    servers = [start_server(ckpt, size, args.torch_threads) for size in (64, 1)]
    try:
        threads = [server_threads(port) for _, port in servers]
        batched, baseline, hf = [], [], []
        for clients in args.clients:
            rounds = [[], [], []]
            for _ in range(args.rounds):
                for (proc, port), out in zip(servers, rounds):
                    result = asyncio.run(load(port, proc.pid, clients, args.requests_per_client, args.max_new_tokens))
                    out.append(dict(result, loadavg_1min=round(os.getloadavg()[0], 2)))
                rounds[2].append(transformers_generate(model, tokenizer, clients, args))
            for out, measured in zip((batched, baseline, hf), rounds):
                out.append(median_of_rounds(measured, "tokens_per_s"))
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(60)
    return batched, baseline, hf, threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", default=",".join(map(str, CLIENTS)),
                   help="comma-separated concurrent client counts (a larger model may take fewer: one at a time is slow)")
    args = p.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    if not args.clients or min(args.clients) < 1:
        raise ValueError(f"--clients must list positive client counts, got {args.clients}")
    corpus = _common.tiny_corpus()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        config, state = write_checkpoint(ckpt, corpus, args)
        machine = _common.machine()
        batched, baseline, hf, threads = measure_interleaved(ckpt, config, state, args)
    speedup = {str(b["clients"]): round(b["tokens_per_s"] / o["tokens_per_s"], 2) for b, o in zip(batched, baseline)}
    cpu_ratio = {str(b["clients"]): round(o["median_server_cpu_ms_per_token"] / b["median_server_cpu_ms_per_token"], 2)
                 for b, o in zip(batched, baseline)}
    _common.emit({"benchmark": "serving", "machine": machine, "cpu_flags": cpu_flags(),
                  "config": {"num_layers": args.num_layers, "hidden_size": args.hidden_size, "heads": 8,
                             "vocab": 400, "position": "alibi", "dtype": "fp32", "torch_threads": args.torch_threads,
                             "server_torch_threads": threads, "rounds": args.rounds, "interleaved": True,
                             "max_new_tokens": args.max_new_tokens, "requests_per_client": args.requests_per_client,
                             "clients": args.clients, "endpoint": "/generate greedy"},
                  "batched_max_batch_size_64": batched, "one_at_a_time_max_batch_size_1": baseline,
                  "transformers_generate_static_batches": hf, "throughput_batched_over_one_at_a_time": speedup,
                  "cpu_ratio_one_at_a_time_over_batched": cpu_ratio},
                 args.output)


if __name__ == "__main__":
    main()
