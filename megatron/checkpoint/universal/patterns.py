"""DeepSpeed universal checkpoints: what ``ds_to_universal`` needs to know about our parameters.

Saved in every checkpoint's client state under ``UNIVERSAL_CHECKPOINT_INFO``. The converter uses
the pattern lists to merge tensor-parallel shards (replicated: keep one copy and check the others
agree; row-parallel: concatenate along dim 1; everything else, including our per-head interleaved
QKV, along dim 0), so a run can resume on any TP, PP and DP. The lists are made from
``megatron.model.layout.parameter_layout``, in the pipeline module's names (``3.mlp...``,
``tied_modules.embed.word_embeddings.weight``, the final LayerNorm as ``L+1.weight``), written for
``re.match`` as DeepSpeed applies them.

Imports ``deepspeed.checkpoint.constants`` (key names only, no engine): the one module of this
package that touches deepspeed, kept out of ``megatron.checkpoint``'s own imports.
"""

from __future__ import annotations

import re

from deepspeed.checkpoint import constants as C

from megatron.config import ModelConfig
from megatron.model.layout import ParameterLayout, parameter_layout

UNIVERSAL_CHECKPOINT_INFO = C.UNIVERSAL_CHECKPOINT_INFO
_ANY_PREFIX = r"^(?:.*\.)?"
_MTP_LAYER = ".transformer_layer."  # inside an MTP depth (megatron.model.mtp): its decoder-kind layer


def _pattern(param: ParameterLayout, naming: str) -> str:
    """A pattern for ``param`` in every layer of its kind: its name inside the layer, or, for a module
    staged directly as a pipeline layer (a bare ``weight``), that name under the layer's index (pipeline
    naming) or its GPTModel name (``final_layernorm.weight``; model naming)."""
    if "." in param.local_name:
        # an MTP depth's transformer layer (mtp.layers.{k}.transformer_layer.X) is a layer of the decoder's kind: the
        # decoder's pattern for X matches it too (two matching patterns are an error to DeepSpeed's converter)
        return _ANY_PREFIX + re.escape(param.local_name.partition(_MTP_LAYER)[2] or param.local_name) + "$"
    if naming == "model":
        return _ANY_PREFIX + re.escape(param.name) + "$"
    return _ANY_PREFIX + rf"{param.pipeline_index}\." + re.escape(param.local_name) + "$"


def universal_checkpoint_info(config: ModelConfig, naming: str = "pipeline") -> dict:
    """``naming``: "pipeline" for the pipeline engine's parameter names, "model" for GPTModel's (ZeRO-2/3 on
    DeepSpeed's model engine, megatron.engine.model_engine). DeepSpeed's converter refuses a pattern
    that matches nothing, so the lists follow the names the checkpoint holds."""
    if naming not in ("pipeline", "model"):
        raise ValueError(f"naming must be 'pipeline' or 'model', got {naming!r}")

    def _patterns(params) -> list[str]:
        return list(dict.fromkeys(_pattern(p, naming) for p in params))  # ordered, without repeats

    layout = parameter_layout(config).values()
    return {
        C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        C.TP_REPLICATED_PARAMETER_PATTERNS: _patterns(p for p in layout if p.replicated),
        C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: _patterns(p for p in layout if p.partition_dim == 1),
        C.VOCABULARY_PARAMETER_PATTERNS: _patterns(p for p in layout if p.vocab_parallel),
        # The tied word embedding is on the first and the last stage: convert the first stage's copy.
        C.PIPELINE_REPLICATED_PARAMETER_PATTERNS: _patterns(p for p in layout if p.tied_to_head),
        # The padding rows are kept (they take part in every softmax), so a resumed run continues
        # exactly; a layout whose padded vocabulary is larger gets zero rows appended on loading.
        C.ORIGINAL_VOCAB_SIZE: config.padded_vocab_size,
        C.PADDED_VOCAB_SIZE: config.padded_vocab_size,
    }
