"""Using trained checkpoints: text generation and an HTTP server, in one process or tensor-parallel.

    generation   Generator: a TP=1 GPTModel with a KV cache, greedy / top-k / top-p sampling, stop strings,
                 text handed out while it is generated
    validation   the server's limits and the strict checks of every request body
    batching     continuous batching: BatchDecoder (sequences join and leave a running batch), BatchRunner
                 (the model and the batch's per-row KV caches), GeneratingSequence (sampling and stops)
    scheduler    GenerationWorker: the queue of requests and the one thread that decodes them in one batch
    server       the aiohttp server behind tools/serve.py: /generate, /health, the connection limits
    openai_api   OpenAI's POST /v1/completions (streaming with server-sent events)
    openai_chat  OpenAI's chat completions API, ``POST /v1/chat/completions``, on the completions machinery
    chat_template  chat messages -> the one prompt a base model continues: the tokenizer's chat template, else plain
    tp           tensor-parallel serving: one model split over the N processes of ``torchrun --nproc_per_node N``

Checkpoints of any TP / PP are read through megatron.checkpoint (plain file access, never
deepspeed). Imports torch, aiohttp, megatron.config, megatron.model, megatron.data and megatron.checkpoint.
"""
