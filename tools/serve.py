#!/usr/bin/env python
"""Serve text generation from a training checkpoint over HTTP (aiohttp, one event loop, one batched generation thread).

    python tools/serve.py --load CKPT [--host 127.0.0.1] [--port 8000] [--max-batch-size 32]
    torchrun --nproc_per_node 2 tools/serve.py --load CKPT     # the model split over 2 processes (TP)
    curl -s localhost:8000/generate -d '{"prompt": "The river", "max_new_tokens": 16, "greedy": true}'
    curl -s localhost:8000/v1/completions -d '{"model": "m", "prompt": "The river", "max_tokens": 16, "temperature": 0}'
    curl -s localhost:8000/v1/chat/completions -d '{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}'
    curl -s localhost:8000/health

POST /generate takes {"prompt": str or [str], "max_new_tokens", "greedy", "temperature", "top_k",
"top_p", "seed"} and answers {"completions": [...]} with the objects tools/generate.py writes;
POST /v1/completions and POST /v1/chat/completions are OpenAI's completions and chat APIs (streaming
included; chat messages rendered with the checkpoint tokenizer's chat template, or a plain one), GET /v1/models
lists the served model. Bad requests get a JSON
error (400, 408 too slow, 411, 413 too large, 404, 405, 503 too busy); generation runs off the event
loop, the prompts of all requests decoded together in one running batch (--max-batch-size). Binds 127.0.0.1 unless
--host says otherwise. The work is in
``megatron.inference.server`` (docs/serving.md).
"""

import argparse
import os
import resource

import torch

from megatron.cli import add_model_args, load_generator


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port, printed)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens-limit", type=int, default=256)
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-prompts", type=int, default=16, help="prompts per request (x n for /v1/completions)")
    parser.add_argument("--read-timeout", type=float, default=30.0,
                        help="seconds a client has to send a request's headers, then as many for its body, "
                             "and to read each piece of a stream; a slower client is dropped (default 30)")
    parser.add_argument("--max-connections", type=int, default=1024,
                        help="open connections at most; one more is answered 503 and closed (default 1024)")
    parser.add_argument("--max-pending-requests", type=int, default=64,
                        help="generation requests waiting or running at most; one more is answered 503 "
                             "(default 64)")
    parser.add_argument("--max-batch-size", type=int, default=32,
                        help="sequences (prompts) decoded together in one running batch; a sequence joins when "
                             "another finishes (default 32; 1: one sequence at a time)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="threads of torch's matrix kernels (default: torch's, one per core); /health reports "
                             "them. On cores other work also uses, 1 is much faster: a kernel's threads wait for "
                             "each other at every barrier (docs/serving.md)")
    parser.add_argument("--model-name", default=None,
                        help="the model's name in /v1/models and the /v1 replies (default: the --load folder's name)")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    return parser.parse_args(argv)


def _allow_open_files(max_connections: int) -> None:
    """Raise the soft limit on open files to hold every connection (plus the model's files and some margin)."""
    needed = max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise ValueError(f"--max-connections {max_connections} needs {needed} open files; this process may "
                             f"open {hard} (ulimit -Hn): lower --max-connections or raise the limit")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _serve_tensor_parallel(args, limits, model_name: str) -> int:
    """Under torchrun: every rank holds its part of the model; rank 0 serves and the others follow it."""
    import signal

    import torch
    import torch.distributed as dist

    from megatron.inference.batching import BatchRunner
    from megatron.inference.server import make_server
    from megatron.inference.tp import BroadcastRunner, follow, serving_device
    from megatron.parallel.state import ParallelState
    from megatron.training.distributed import init_process_group  # the training jobs' own join

    info = init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    state = ParallelState.create(tp=info.world_size, pp=1, dp=1)  # one tensor-parallel group of all ranks
    generator = load_generator(args, parallel_state=state)
    generator.model.to(serving_device())
    try:
        if state.rank != 0:
            for signum in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when to stop, and says so
                signal.signal(signum, signal.SIG_IGN)
            follow(BatchRunner(generator.model, generator.vocab_size), state.tp_group)
            return 0
        runner = BroadcastRunner(generator.model, generator.vocab_size, state.tp_group)
        server = make_server(generator, limits, args.host, args.port, verbose=args.verbose, model_name=model_name,
                             runner=runner)
        try:
            server.serve_forever(on_started=_announce(f", tensor-parallel over {state.tp_size} processes"))
        finally:
            runner.stop()
        return 0
    finally:
        dist.destroy_process_group()


def _announce(extra: str = ""):
    return lambda s: print(f"serving on http://{s.host}:{s.port} (POST /generate, POST /v1/completions, "
                           f"POST /v1/chat/completions, GET /v1/models, GET /health){extra}", flush=True)


def main(argv=None) -> int:
    import logging

    from megatron.inference.server import ServerLimits, make_server

    args = parse_args(argv)
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise ValueError(f"--torch-threads must be >= 1, got {args.torch_threads}")
        torch.set_num_threads(args.torch_threads)
    limits = ServerLimits(max_prompt_tokens=args.max_prompt_tokens, max_new_tokens_limit=args.max_new_tokens_limit,
                          max_request_bytes=args.max_request_bytes, max_prompts=args.max_prompts,
                          default_max_new_tokens=min(32, args.max_new_tokens_limit), read_timeout=args.read_timeout,
                          max_connections=args.max_connections,
                          max_pending_requests=args.max_pending_requests,
                          max_batch_size=args.max_batch_size).validate()
    _allow_open_files(limits.max_connections)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_name = args.model_name or os.path.basename(os.path.normpath(args.load))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _serve_tensor_parallel(args, limits, model_name)
    server = make_server(load_generator(args), limits, args.host, args.port, verbose=args.verbose,
                         model_name=model_name)
    server.serve_forever(on_started=_announce())
    return 0


if __name__ == "__main__":
    from megatron.cli import run_tool

    run_tool(main)
