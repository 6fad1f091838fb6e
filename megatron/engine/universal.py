"""DeepSpeed universal checkpoints: what ``ds_to_universal`` needs to know about our parameters.

Saved in every checkpoint's client state under ``UNIVERSAL_CHECKPOINT_INFO``. The converter uses
the pattern lists to merge tensor-parallel shards (replicated: keep one copy and check the others
agree; row-parallel: concatenate along dim 1; everything else, including our per-head interleaved
QKV, along dim 0), so a run can resume on any TP, PP and DP.
"""

from __future__ import annotations

import re

from deepspeed.checkpoint import constants as C

from megatron.config import ModelConfig

from megatron.model.tp_parameters import (ROW_PARALLEL_PARAMETER_PATTERNS, TP_REPLICATED_PARAMETER_PATTERNS,
                                          VOCABULARY_PARAMETER_PATTERNS)


def _parameter_names(config: ModelConfig) -> list[str]:
    """One name per kind of parameter of the pipeline module, as the converter sees them
    (``<layer index>.<name inside the layer>``): enough to tell which patterns this model uses."""
    last = config.num_layers + 1  # FinalLayerNorm's index; 0 is the embedding, 1..L the blocks
    names = ["0.word_embeddings.weight", f"{last}.weight", f"{last}.bias"]
    if config.position_embedding_type == "absolute":
        names.append("0.position_embeddings.weight")
    if config.embed_layernorm:
        names += ["0.embed_layernorm.weight", "0.embed_layernorm.bias"]
    names += [f"1.{name}" for name in ("input_layernorm.weight", "input_layernorm.bias",
                                        "self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
                                        "self_attention.dense.weight", "self_attention.dense.bias",
                                        "post_attention_layernorm.weight", "post_attention_layernorm.bias",
                                        "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
                                        "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias")]
    return names


def _used(patterns: list[str], names: list[str]) -> list[str]:
    # DeepSpeed's converter (strict mode) refuses patterns that match no parameter.
    return [p for p in patterns if any(re.match(p, name) for name in names)]


def universal_checkpoint_info(config: ModelConfig) -> dict:
    names = _parameter_names(config)
    return {
        C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        C.TP_REPLICATED_PARAMETER_PATTERNS: _used(TP_REPLICATED_PARAMETER_PATTERNS, names),
        C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: _used(ROW_PARALLEL_PARAMETER_PATTERNS, names),
        C.VOCABULARY_PARAMETER_PATTERNS: _used(VOCABULARY_PARAMETER_PATTERNS, names),
        # The tied word embedding is on the first and the last stage: convert the first stage's copy.
        C.PIPELINE_REPLICATED_PARAMETER_PATTERNS: list(VOCABULARY_PARAMETER_PATTERNS),
        # The padding rows are kept (they take part in every softmax), so a resumed run continues
        # exactly; a layout whose padded vocabulary is larger gets zero rows appended on loading.
        C.ORIGINAL_VOCAB_SIZE: config.padded_vocab_size,
        C.PADDED_VOCAB_SIZE: config.padded_vocab_size,
    }


UNIVERSAL_CHECKPOINT_INFO = C.UNIVERSAL_CHECKPOINT_INFO
