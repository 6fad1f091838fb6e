"""Data: tokenizers, Megatron's mmap indexed dataset, GPT samples and their C++ index builders,
blending and samplers. Used by ``megatron.training``; imports neither ``model`` nor ``engine``."""
