"""How every parameter of the model is laid out: the one description everybody else reads.

Two facts, both derived from the model's own modules:

- the pipeline: the ordered layers a pipeline engine stages and a checkpoint numbers its files by
  (``layer_XX-model_YY-model_states.pt``): 0 the embedding, 1..L the transformer layers, L+1 the
  final LayerNorm, L+2 the tied output head (no parameters of its own: the word embedding);
- each parameter (by its ``GPTModel`` name): its pipeline layer and name inside it, the dimension
  it is split along across tensor-parallel ranks (None: replicated on every rank), whether its rows
  are the padded vocabulary, whether the output head shares it. These come from the tags the
  parallel layers set (``tensor_model_parallel``, ``partition_dim``, ``vocab_parallel``).

Read by the pipeline module (``megatron.engine.pipeline``), the universal-checkpoint info, the
merger of TP / PP shards and the transformers mappings (``megatron.checkpoint``). A new model
variant adds its layers to ``pipeline_items`` and nothing else: the tags travel with the modules.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from megatron.config import ModelConfig

__all__ = ["EMBEDDING", "TRANSFORMER", "FINAL_NORM", "HEAD", "PipelineItem", "ParameterLayout", "pipeline_items",
           "pipeline_item", "parameter_layout", "model_name", "pipeline_name"]

EMBEDDING, TRANSFORMER, FINAL_NORM, HEAD = "embedding", "transformer", "final_layernorm", "head"
TIED_MODULE_PREFIX = "tied_modules.embed."  # where DeepSpeed keeps the embedding tied between first and last stage


@dataclasses.dataclass(frozen=True)
class PipelineItem:
    """One pipeline layer: its global index (the same for any pipeline size) and what it holds."""

    index: int
    kind: str                 # EMBEDDING | TRANSFORMER | FINAL_NORM | HEAD
    prefix: Optional[str]     # GPTModel name prefix of its parameters; None: the tied head (owns none)


@dataclasses.dataclass(frozen=True)
class ParameterLayout:
    """Where one parameter lives and how it is split across tensor-parallel ranks."""

    name: str                      # GPTModel name, e.g. "layers.3.mlp.dense_4h_to_h.weight"
    pipeline_index: int            # the PipelineItem holding it
    local_name: str                # its name inside that pipeline layer, e.g. "mlp.dense_4h_to_h.weight"
    partition_dim: Optional[int]   # dim split across TP ranks (0 column-parallel, 1 row-parallel); None: replicated
    vocab_parallel: bool = False   # rows are the (padded) vocabulary
    tied_to_head: bool = False     # the output head on the last stage uses it too (a second copy there)

    @property
    def replicated(self) -> bool:
        return self.partition_dim is None


def pipeline_items(config: ModelConfig) -> list[PipelineItem]:
    """The model's pipeline layers in order (see the module docstring)."""
    n = config.num_layers
    return ([PipelineItem(0, EMBEDDING, "embedding.")]
            + [PipelineItem(i + 1, TRANSFORMER, f"layers.{i}.") for i in range(n)]
            + [PipelineItem(n + 1, FINAL_NORM, "final_layernorm."), PipelineItem(n + 2, HEAD, None)])


def pipeline_item(index: int, config: ModelConfig) -> PipelineItem:
    """The pipeline layer ``index``; ValueError naming the valid range for any other index."""
    items = pipeline_items(config)
    if not 0 <= index < len(items):
        n = config.num_layers
        raise ValueError(f"pipeline layer index {index} does not exist in a model of {n} layers (0 embedding, "
                         f"1..{n} transformer, {n + 1} final LayerNorm, {n + 2} tied head)")
    return items[index]


def _structure(config: ModelConfig) -> ModelConfig:
    """A one-layer stand-in with the same structure and tiny sizes: its modules carry the same tags
    and names as the real ones, and it builds in milliseconds whatever the real model's size."""
    heads = config.num_attention_heads
    return dataclasses.replace(config, num_layers=1, hidden_size=2 * heads, ffn_hidden_size=4, padded_vocab_size=8,
                               original_vocab_size=None, seq_length=4, max_position_embeddings=4,
                               params_dtype="fp32").validate()


@functools.lru_cache(maxsize=32)
def _tags(structure: ModelConfig) -> tuple[tuple[str, Optional[int], bool], ...]:
    """(GPTModel name, partition dim or None, vocab-parallel) of every parameter of the stand-in."""
    from megatron.model.gpt import GPTModel  # the modules themselves are the source of the tags

    out = []
    for name, param in GPTModel(structure).named_parameters():
        split = getattr(param, "tensor_model_parallel", False)
        out.append((name, param.partition_dim if split else None, bool(getattr(param, "vocab_parallel", False))))
    return tuple(out)


def parameter_layout(config: ModelConfig) -> dict[str, ParameterLayout]:
    """Every parameter of ``GPTModel(config)``, by name, in ``named_parameters`` order."""
    items = pipeline_items(config)
    by_prefix = {item.prefix: item for item in items if item.prefix is not None}
    template = _tags(_structure(config))
    layout: dict[str, ParameterLayout] = {}

    def add(item: PipelineItem, local: str, dim: Optional[int], vocab: bool) -> None:
        name = item.prefix + local
        layout[name] = ParameterLayout(name, item.index, local, dim, vocab, tied_to_head=vocab and item.kind == EMBEDDING)

    layer_params = [(name[len("layers.0."):], dim, vocab) for name, dim, vocab in template if name.startswith("layers.0.")]
    for name, dim, vocab in template:
        if name.startswith("embedding."):
            add(by_prefix["embedding."], name[len("embedding."):], dim, vocab)
    for item in items:
        if item.kind == TRANSFORMER:
            for local, dim, vocab in layer_params:
                add(item, local, dim, vocab)
    for name, dim, vocab in template:
        if name.startswith("final_layernorm."):
            add(by_prefix["final_layernorm."], name[len("final_layernorm."):], dim, vocab)
    return layout


def model_name(name: str, config: ModelConfig) -> str:
    """GPTModel name of a pipeline module's parameter (``3.mlp...``, ``tied_modules.embed.word_...``)."""
    if name.startswith(TIED_MODULE_PREFIX):
        return "embedding." + name[len(TIED_MODULE_PREFIX):]
    head, _, local = name.partition(".")
    if not head.isdigit():
        raise ValueError(f"{name!r} is not a pipeline module parameter name (INDEX.NAME or {TIED_MODULE_PREFIX}NAME)")
    item = pipeline_item(int(head), config)
    if item.prefix is None:
        raise ValueError(f"{name!r}: pipeline layer {item.index} is the tied head, which owns no parameters")
    return item.prefix + local


def pipeline_name(param: ParameterLayout) -> str:
    """The parameter's name in a pipeline module: the tied embedding's under DeepSpeed's tied-module
    prefix, every other one under its layer index."""
    if param.pipeline_index == 0:
        return TIED_MODULE_PREFIX + param.local_name
    return f"{param.pipeline_index}.{param.local_name}"
