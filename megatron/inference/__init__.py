"""Using trained checkpoints in one process: text generation and an HTTP server.

    generation   Generator: a TP=1 GPTModel with a KV cache, greedy / top-k / top-p sampling
    server       the JSON request validation and HTTP handler behind tools/serve.py

Checkpoints of any TP / PP are read through megatron.checkpoint (plain file access, never
deepspeed). Imports torch, megatron.config, megatron.model, megatron.data and megatron.checkpoint.
"""
