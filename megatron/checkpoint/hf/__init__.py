"""Hugging Face transformers families: our full (TP=1) weights and configs <-> transformers model directories.

    io             full weights <-> transformers model directories: which family, Bloom, GPT-2, GPT-NeoX; tokenizers
    bloom          full weights and configs <-> transformers' Bloom (names only, no transformers import)
    llama          full (TP=1) weights and configs <-> transformers' Llama family (Llama, Mistral, Qwen2)
    mixtral_qwen3  full weights (every expert) <-> transformers' MoE Llama relatives: Mixtral, Qwen3-MoE
    deepseek       full weights (every expert) <-> transformers' ``DeepseekV3ForCausalLM`` (latent attention)
"""
