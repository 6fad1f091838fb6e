"""GPT / BLOOM / Llama-style model math, tensor-parallel, sequence-first [s, b, h].

    EmbeddingLayer     token ids -> [s, b, h]; learned positions, BLOOM's embedding LayerNorm;
                       ``lm_logits`` is the tied output head -> vocab-parallel [s, b, vp]
    OutputLayer        the untied output head (its own vocab-parallel weight)
    TransformerLayer   pre-norm attention (fused QKV per query group: MHA / GQA / MQA; ALiBi / rotary /
                       none) + GeLU or SwiGLU MLP; biases optional
    Norm               LayerNorm or RMSNorm, as the config says
    FinalLayerNorm     the norm before the head
    GPTModel           the three composed on one pipeline stage; ``gpt_loss`` the masked mean loss
    SequenceExchange   what attention needs for DeepSpeed-Ulysses (its SP rank and the all-to-all around the
                       core attention), given at construction; megatron.engine.ulysses builds it
    KVCache            per-layer keys / values for incremental decoding
    BatchKVCache       the same for a batch of sequences of different lengths (continuous batching)
    layout             the pipeline layers and how every parameter is split across TP ranks (from the
                       modules' own tags): what the pipeline and every checkpoint converter read

The modules they live in, and the rest:

    embedding          EmbeddingLayer, OutputLayer: vocab-parallel words, optional learned positions and norm
    transformer        TransformerLayer (attention + MLP), its MLP, its norms, and FinalLayerNorm
    attention          causal self-attention with a fused QKV projection per query group; KVCache, SequenceExchange
    attention_core     the attention core softmax(Q K^T / sqrt(hn) + position bias, causal) V, by one of several kernels
    latent_attention   multi-head latent attention (MLA; DeepSeek-V2 / V3), heads split across the TP group
    ring_attention     causal attention over a sequence whose tokens are spread over a context-parallel group
    positional         position information inside attention: ALiBi biases and rotary embeddings
    norm               Norm: the LayerNorm or RMSNorm every block, the final norm and BLOOM's embedding norm use
    moe                the mixture-of-experts MLP (a subpackage: router, dispatch, experts, layer, stats)
    gpt                GPTModel: embedding -> transformer layers -> final norm -> output head, and the loss
    mtp                multi-token prediction (DeepSeek-V3): depths after the final norm, their shifted losses
    kv_cache           BatchKVCache: one layer's keys and values for a batch of sequences of different lengths
    initialization     weight initialization that depends only on (seed, which parameter), never on build order
    compile            --torch-compile: each transformer layer compiled on its own

Each module is built from a ``ModelConfig`` and an explicit tensor-parallel group and takes simple
tensors, so a pipeline engine can stage them one by one. Initial weights depend only on
(config.seed, parameter name): a pipeline stage, or a different TP size, starts identical.

Imports torch, megatron.config and megatron.parallel only: never deepspeed, global arguments or
environment variables.

Shape letters: s sequence, b micro-batch, h hidden, np heads per partition, hn head dim,
hp = np * hn, v / vp vocabulary (per partition).
"""

from megatron.model.attention import KVCache, SelfAttention, SequenceExchange
from megatron.model.embedding import EmbeddingLayer, OutputLayer
from megatron.model.gpt import GPTModel, gpt_loss, per_token_loss
from megatron.model.kv_cache import BatchKVCache
from megatron.model.layout import ParameterLayout, PipelineItem, parameter_layout, pipeline_items
from megatron.model.norm import Norm
from megatron.model.transformer import FinalLayerNorm, ParallelMLP, TransformerLayer

__all__ = ["EmbeddingLayer", "OutputLayer", "Norm", "TransformerLayer", "FinalLayerNorm", "GPTModel", "gpt_loss",
           "per_token_loss", "KVCache", "BatchKVCache", "SelfAttention", "SequenceExchange", "ParallelMLP",
           "ParameterLayout", "PipelineItem", "parameter_layout", "pipeline_items"]
