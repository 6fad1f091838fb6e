"""Using trained checkpoints in one process: text generation and an HTTP server.

    generation   Generator: a TP=1 GPTModel with a KV cache, greedy / top-k / top-p sampling, stop strings,
                 text handed out while it is generated
    validation   the server's limits and the strict checks of every request body
    batching     continuous batching: BatchDecoder (sequences join and leave a running batch), BatchRunner
                 (the model and the batch's per-row KV caches), GeneratingSequence (sampling and stops)
    scheduler    GenerationWorker: the queue of requests and the one thread that decodes them in one batch
    server       the aiohttp server behind tools/serve.py: /generate, /health, the connection limits
    openai_api   OpenAI's POST /v1/completions (streaming with server-sent events)

Checkpoints of any TP / PP are read through megatron.checkpoint (plain file access, never
deepspeed). Imports torch, aiohttp, megatron.config, megatron.model, megatron.data and megatron.checkpoint.
"""
