#!/usr/bin/env python
"""Serve text generation from a training checkpoint over HTTP (standard library only).

    python tools/serve.py --load CKPT [--host 127.0.0.1] [--port 8000]
    curl -s localhost:8000/generate -d '{"prompt": "The river", "max_new_tokens": 16, "greedy": true}'
    curl -s localhost:8000/health

POST /generate takes {"prompt": str or [str], "max_new_tokens", "greedy", "temperature", "top_k",
"top_p", "seed"} and answers {"completions": [...]} with the objects tools/generate.py writes.
Bad requests get a JSON error with 400 / 413 (too large) / 404 / 405; requests are served by
threads, generation one at a time. Binds 127.0.0.1 unless --host says otherwise. The work is in
``megatron.inference.server``.
"""

import argparse

from megatron.cli import add_model_args, load_generator


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port, printed)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens-limit", type=int, default=256)
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-prompts", type=int, default=16, help="prompts per request")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from megatron.inference.server import ServerLimits, make_server

    args = parse_args(argv)
    limits = ServerLimits(max_prompt_tokens=args.max_prompt_tokens, max_new_tokens_limit=args.max_new_tokens_limit,
                          max_request_bytes=args.max_request_bytes, max_prompts=args.max_prompts,
                          default_max_new_tokens=min(32, args.max_new_tokens_limit)).validate()
    server = make_server(load_generator(args), limits, args.host, args.port, verbose=args.verbose)
    host, port = server.server_address[:2]
    print(f"serving on http://{host}:{port} (POST /generate, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    from megatron.cli import run_tool

    run_tool(main)
