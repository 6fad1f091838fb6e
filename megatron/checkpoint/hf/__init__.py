"""Hugging Face transformers families: our full (TP=1) weights and configs <-> transformers model directories.

    families       the registry: one ``Family`` per module below (model types, which models of ours it exports,
                   its mappings); ``hf_architecture``, ``family_for`` / ``family_of`` look families up there
    io             what every family shares: ``write_hf_model`` / ``read_hf_model`` (config.json + safetensors
                   shards, dtype names; transformers imported there only), ``export_tokenizer``
    bloom          Bloom (ALiBi, embedding LayerNorm): the same tensors, renamed
    gpt2           GPT-2 (learned positions; Conv1D, grouped QKV); the GPT block check Bloom and GPT-NeoX share
    neox           GPT-NeoX (rotary, sequential residual): the same tensors, renamed
    llama          the Llama family: Llama, Mistral, Qwen2 (RMSNorm, SwiGLU, GQA; q / k / v and fc1 split)
    mixtral_qwen3  the MoE Llama relatives: Mixtral, Qwen3-MoE (one matrix per expert on their side)
    deepseek       DeepSeek-V3 (latent attention, sigmoid group-limited routing, a shared expert)

A family module maps names, tensors and config fields only and imports no transformers; a new family is one
module here plus one line in ``families.FAMILIES``. Tensor names come from ``megatron.model.layout``.
"""
