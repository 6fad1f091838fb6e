"""Using trained checkpoints in one process: reading / merging / writing them, text generation, a server.

    checkpoint   load_full_state_dict (any TP / PP -> TP=1 GPTModel weights), save_as_training_checkpoint
    hf_export    our weights <-> transformers' Bloom / GPT-2 / GPT-NeoX directories (config, safetensors, tokenizer)
    generation   Generator: a TP=1 GPTModel with a KV cache, greedy / top-k / top-p sampling
    server       the JSON request validation and HTTP handler behind tools/serve.py

Imports torch, transformers (hf_export only), megatron.config, megatron.model, megatron.data and the
checkpoint file names of megatron.training.checkpointing; never deepspeed: a checkpoint of any
parallel layout is read by plain file access.
"""
