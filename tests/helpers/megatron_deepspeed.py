"""A checkpoint as bigscience's Megatron-DeepSpeed writes one for BLOOM, made from transformers' Bloom
weights without our writer: the reverse of transformers' own BLOOM converter's mapping.

    layer_01-model_TT-model_states.pt      word_embeddings.weight (vocab rows split over TP), word_embeddings.norm.*
    layer_{i+3}-model_TT-model_states.pt   block i under transformers' names (input_layernorm.weight, ...)
    layer_{L+4}-model_TT-model_states.pt   weight, bias (the final LayerNorm)
    mp_rank_RR_model_states.pt             DeepSpeed's record, Megatron's args Namespace (with its
                                           PositionEmbeddingType enum and a torch dtype), checkpoint_version
    latest                                 the tag; no run_state.json, no completion marker (Megatron has none)

TP splits follow the converter's own lists: row-parallel weights (dense, dense_4h_to_h) along dim 1,
the replicated ones (LayerNorms, row-parallel biases) copied, everything else along dim 0.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
import types

import torch

ROW_PARALLEL = ("mlp.dense_4h_to_h.weight", "self_attention.dense.weight")
REPLICATED = ("layernorm.weight", "layernorm.bias", "norm.weight", "norm.bias", "self_attention.dense.bias",
              "mlp.dense_4h_to_h.bias")


def _split(key: str, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    if key in ("weight", "bias") or key.endswith(REPLICATED):
        return [tensor.clone() for _ in range(tp)]
    dim = 1 if key.endswith(ROW_PARALLEL) else 0
    return [chunk.clone() for chunk in torch.chunk(tensor, tp, dim=dim)]


class PositionEmbeddingType(enum.Enum):
    """bigscience's ``megatron.enums.PositionEmbeddingType`` (its values), pickled under that name below."""

    rotary = 1
    absolute = 2
    alibi = 3


def _megatron_enums():
    return PositionEmbeddingType


def _save_with_megatron_enums(obj, path: str) -> None:
    """torch.save with the enum pickled as ``megatron.enums.PositionEmbeddingType``, as Megatron's args hold it."""
    module = types.ModuleType("megatron.enums")
    module.PositionEmbeddingType = PositionEmbeddingType
    PositionEmbeddingType.__module__ = "megatron.enums"
    sys.modules["megatron.enums"] = module
    try:
        torch.save(obj, path)
    finally:
        del sys.modules["megatron.enums"]
        PositionEmbeddingType.__module__ = __name__


def write_bloom_checkpoint(hf_state: dict, out_dir: str, *, num_layers: int, hidden_size: int, num_heads: int,
                           padded_vocab: int, seq_length: int, tp: int, pp: int, tag: str = "global_step100") -> str:
    """``hf_state``: a ``BloomModel`` state dict (no ``transformer.`` prefix). Returns the tag directory."""
    files: dict[int, dict] = {1: {}, num_layers + 4: {}}
    words = hf_state["word_embeddings.weight"]  # [v, h]
    files[1]["word_embeddings.weight"] = torch.cat([words, words.new_zeros(padded_vocab - words.shape[0], hidden_size)])
    for name in ("weight", "bias"):
        files[1][f"word_embeddings.norm.{name}"] = hf_state[f"word_embeddings_layernorm.{name}"]
        files[num_layers + 4][name] = hf_state[f"ln_f.{name}"]
    for key, tensor in hf_state.items():
        if key.startswith("h."):
            index, _, rest = key[2:].partition(".")
            files.setdefault(int(index) + 3, {})[rest] = tensor
    tag_dir = os.path.join(out_dir, tag)
    os.makedirs(tag_dir)
    for index, tensors in files.items():
        shards = {key: _split(key, tensor, tp) for key, tensor in tensors.items()}
        for rank in range(tp):
            torch.save({key: parts[rank].contiguous() for key, parts in shards.items()},
                       os.path.join(tag_dir, f"layer_{index:02d}-model_{rank:02d}-model_states.pt"))
    args = argparse.Namespace(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_heads,
                              ffn_hidden_size=4 * hidden_size, padded_vocab_size=padded_vocab, seq_length=seq_length,
                              max_position_embeddings=seq_length, position_embedding_type=_megatron_enums().alibi,
                              params_dtype=torch.float32, embed_layernorm=True,
                              layernorm_epsilon=1e-5, init_method_std=0.02, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp, bf16=False, fp16=False, consumed_train_samples=800,
                              tokenizer_type="PretrainedFromHF")
    for rank in range(tp * pp):
        _save_with_megatron_enums({"module": None, "buffer_names": [], "optimizer": None, "lr_scheduler": None,
                    "global_steps": 100,
                    "global_samples": 800, "skipped_steps": 0, "dp_world_size": 1, "mp_world_size": tp * pp,
                                   "args": args, "checkpoint_version": 3.0, "iteration": 100},
                                  os.path.join(tag_dir, f"mp_rank_{rank:02d}_model_states.pt"))
    with open(os.path.join(out_dir, "latest"), "w") as f:
        f.write(tag)
    return tag_dir
