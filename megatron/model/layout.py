"""How every parameter of the model is laid out: the one description everybody else reads.

Two facts, both derived from the model's own modules:

- the pipeline: the ordered layers a pipeline engine stages and a checkpoint numbers its files by
  (``layer_XX-model_YY-model_states.pt``), BLOOM's numbering (bigscience's Megatron-DeepSpeed
  ``GPTModelPipe``): 0 a parameter-free slot (BLOOM's fp16 cast), 1 the embedding, 2 a slot (BLOOM's
  transpose to [s, b, h]), 3..L+2 the transformer layers, L+3 a slot (the transpose back), L+4 the
  final norm, L+5 the output head (tied: no parameters of its own, it uses the word embedding;
  untied, --untie-embeddings-and-output-weights: ``output_layer.weight``, in its own file). With
  --mtp-num-layers the multi-token-prediction depths come between the final norm and the head (Megatron-LM's
  layout letter ``m`` before ``L``): L+5 a slot holding the word embedding's last-stage copy (tied to the first
  stage's, whatever the head's tie: the depths embed tokens with it), L+6 the depths (``mtp.*``), L+7 the head. Our
  activations are sequence-first throughout, so the slots pass their input on unchanged; they keep
  the file numbers BLOOM's tools expect (transformers' converter among them). Checkpoints written
  before 2026-12-01 used ``LEGACY_LAYOUT`` (0 embedding, 1..L blocks, L+1 final LayerNorm);
  ``tools/convert_checkpoint/upgrade_layout.py`` converts them, the single-process readers read both;
- each parameter (by its ``GPTModel`` name): its pipeline layer and name inside it, the dimension
  it is split along across tensor-parallel ranks (None: replicated on every rank), whether its rows
  are the padded vocabulary, whether the output head shares it, and its key in the layer file
  (BLOOM names the embedding LayerNorm ``word_embeddings.norm.*``; in memory it is
  ``embed_layernorm.*``). The splits come from the tags the parallel layers set
  (``tensor_model_parallel``, ``partition_dim``, ``vocab_parallel``).

Read by the pipeline module (``megatron.engine.pipeline``), the universal-checkpoint info, the
merger of TP / PP shards and the transformers mappings (``megatron.checkpoint``). A new model
variant adds its layers to ``pipeline_items`` and nothing else: the tags travel with the modules.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from megatron.config import ModelConfig

__all__ = ["EMBEDDING", "TRANSFORMER", "FINAL_NORM", "HEAD", "PASS_THROUGH", "MTP", "MTP_EMBEDDING",
           "LAYOUT", "LEGACY_LAYOUT", "PipelineItem",
           "ParameterLayout", "pipeline_items", "pipeline_item", "parameter_layout", "model_name", "pipeline_name",
           "file_key", "local_name_of_file_key"]

EMBEDDING, TRANSFORMER, FINAL_NORM, HEAD = "embedding", "transformer", "final_layernorm", "head"
PASS_THROUGH = "pass_through"  # a parameter-free slot of BLOOM's numbering (see the module docstring)
MTP = "mtp"                    # the multi-token-prediction depths (--mtp-num-layers), after the final norm
MTP_EMBEDDING = "mtp_embedding"  # a slot: the word embedding's last-stage copy the MTP depths embed with
TIED_MODULE_PREFIX = "tied_modules.embed."  # where DeepSpeed keeps the embedding tied between first and last stage
LAYOUT = "bloom"            # what checkpoints record in run_state.json as "checkpoint_layout"
LEGACY_LAYOUT = "ds3d-v0"   # checkpoints without that record
LAYOUTS = (LAYOUT, LEGACY_LAYOUT)
# In-memory name prefix inside a pipeline layer -> its key prefix in the layer file, per layout.
_FILE_KEY_PREFIXES = {LAYOUT: (("embed_layernorm.", "word_embeddings.norm."),), LEGACY_LAYOUT: ()}


@dataclasses.dataclass(frozen=True)
class PipelineItem:
    """One pipeline layer: its global index (the same for any pipeline size) and what it holds."""

    index: int
    kind: str                 # EMBEDDING | TRANSFORMER | FINAL_NORM | MTP_EMBEDDING | MTP | HEAD | PASS_THROUGH
    prefix: Optional[str]     # GPTModel name prefix of its parameters; None: it owns none (head, slots)
    note: str = ""            # what BLOOM computes in a PASS_THROUGH slot

    @property
    def layer_number(self) -> Optional[int]:
        """The 0-based transformer layer a TRANSFORMER item holds (None for the others)."""
        return int(self.prefix[len("layers."):-1]) if self.kind == TRANSFORMER else None


@dataclasses.dataclass(frozen=True)
class ParameterLayout:
    """Where one parameter lives and how it is split across tensor-parallel ranks."""

    name: str                      # GPTModel name, e.g. "layers.3.mlp.dense_4h_to_h.weight"
    pipeline_index: int            # the PipelineItem holding it
    local_name: str                # its name inside that pipeline layer, e.g. "mlp.dense_4h_to_h.weight"
    partition_dim: Optional[int]   # dim split across TP ranks (0 column-parallel, 1 row-parallel); None: replicated
    vocab_parallel: bool = False   # rows are the (padded) vocabulary
    tied_to_head: bool = False     # a second copy on the last stage: the tied head's, or the MTP depths' embedding
    file_key: str = ""             # its key in the layer file (BLOOM's name); "" means local_name
    in_tied_module: bool = False   # a DeepSpeed tied module holds it (the embedding, when tied to the head)
    expert_parallel: bool = False  # an MoE expert's: dim 0 is the experts, each EP rank holds its share of them

    @property
    def replicated(self) -> bool:
        return self.partition_dim is None


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"checkpoint layout {layout!r} is not one of {', '.join(LAYOUTS)}")


def pipeline_items(config: ModelConfig, layout: str = LAYOUT) -> list[PipelineItem]:
    """The model's pipeline layers in order (see the module docstring), in ``layout``'s numbering."""
    _check_layout(layout)
    n = config.num_layers
    head = None if config.tied_embeddings else "output_layer."
    if layout == LEGACY_LAYOUT and config.mtp_num_layers:
        raise ValueError(f"the {LEGACY_LAYOUT} checkpoint layout predates multi-token prediction; a model with "
                         f"--mtp-num-layers is laid out as {LAYOUT!r}")
    if layout == LEGACY_LAYOUT:
        kinds = [(EMBEDDING, "embedding.", "")]
        kinds += [(TRANSFORMER, f"layers.{i}.", "") for i in range(n)]
        kinds += [(FINAL_NORM, "final_layernorm.", ""), (HEAD, head, "")]
    else:
        kinds = [(PASS_THROUGH, None, "BLOOM: cast to fp16 (ours: the dtype is the parameters')"),
                 (EMBEDDING, "embedding.", ""),
                 (PASS_THROUGH, None, "BLOOM: transpose [b, s, h] -> [s, b, h] (ours: already [s, b, h])")]
        kinds += [(TRANSFORMER, f"layers.{i}.", "") for i in range(n)]
        kinds += [(PASS_THROUGH, None, "BLOOM: transpose [s, b, h] -> [b, s, h] (ours: stays [s, b, h])"),
                  (FINAL_NORM, "final_layernorm.", "")]
        if config.mtp_num_layers:
            kinds += [(MTP_EMBEDDING, None, "the word embedding for the MTP depths (tied to the first stage's)"),
                      (MTP, "mtp.", "")]
        kinds += [(HEAD, head, "")]
    return [PipelineItem(i, kind, prefix, note) for i, (kind, prefix, note) in enumerate(kinds)]


def pipeline_item(index: int, config: ModelConfig, layout: str = LAYOUT) -> PipelineItem:
    """The pipeline layer ``index``; ValueError naming the valid range for any other index."""
    items = pipeline_items(config, layout)
    if not 0 <= index < len(items):
        described = ", ".join(f"{i.index} {i.kind}" for i in items if i.kind != TRANSFORMER)
        blocks = [i.index for i in items if i.kind == TRANSFORMER]
        raise ValueError(f"pipeline layer index {index} does not exist in a model of {config.num_layers} layers "
                         f"({described}; transformer layers {blocks[0]}..{blocks[-1]})")
    return items[index]


def _swap_prefix(name: str, layout: str, to_file: bool) -> str:
    _check_layout(layout)
    for ours, theirs in _FILE_KEY_PREFIXES[layout]:
        old, new = (ours, theirs) if to_file else (theirs, ours)
        if name.startswith(old):
            return new + name[len(old):]
    return name


def file_key(local_name: str, layout: str = LAYOUT) -> str:
    """The key of a parameter (by its name inside its pipeline layer) in a ``layout`` layer file."""
    return _swap_prefix(local_name, layout, to_file=True)


def local_name_of_file_key(key: str, layout: str = LAYOUT) -> str:
    """The inverse of :func:`file_key`."""
    return _swap_prefix(key, layout, to_file=False)


def _layer_kinds(config: ModelConfig) -> tuple[bool, ...]:
    """The kinds of transformer layer the model has, in the stand-in's order: (False,) dense only; with MoE
    (True,) or (False, True) (True: an MoE MLP)."""
    if config.moe is None:
        return (False,)
    pattern = config.moe.layer_pattern  # the last layer's kind last: the stand-in's MTP layers take its kind
    return tuple(sorted(set(pattern), key=lambda kind: (kind == pattern[-1], kind)))


def _structure(config: ModelConfig) -> ModelConfig:
    """A stand-in with the same structure and tiny sizes, one layer of each kind (``_layer_kinds``): its
    modules carry the same tags and names as the real ones, and it builds in milliseconds whatever the
    real model's size."""
    heads, kinds = config.num_attention_heads, _layer_kinds(config)
    moe = config.moe
    if moe is not None:
        shared = None if moe.shared_expert_intermediate_size is None else 4
        moe = dataclasses.replace(moe, layer_pattern=kinds, ffn_hidden_size=4, shared_expert_intermediate_size=shared)
    kv_channels = None if config.kv_channels is None else 4  # hn != h / heads stays so: the dense's input is 4 x heads
    return dataclasses.replace(config, num_layers=len(kinds), hidden_size=2 * heads, ffn_hidden_size=4,
                               kv_channels=kv_channels,
                               padded_vocab_size=8, original_vocab_size=None, seq_length=4, max_position_embeddings=4,
                               params_dtype="fp32", moe=moe).validate()


@functools.lru_cache(maxsize=32)
def _tags(structure: ModelConfig) -> tuple[tuple[str, Optional[int], bool, bool], ...]:
    """(GPTModel name, partition dim or None, vocab-parallel, expert-parallel) of every parameter of the
    stand-in."""
    from megatron.model.gpt import GPTModel  # noqa: PLC0415 (a cycle: gpt.py reads this module's layout)

    out = []
    for name, param in GPTModel(structure).named_parameters():
        split = getattr(param, "tensor_model_parallel", False)
        out.append((name, param.partition_dim if split else None, bool(getattr(param, "vocab_parallel", False)),
                    bool(getattr(param, "expert_parallel", False))))
    return tuple(out)


def _layer_template(structure: ModelConfig) -> list[tuple[str, Optional[int], bool, bool]]:
    """The stand-in's layer-0 parameters, named inside the layer."""
    return [(name[len("layers.0."):], *tags) for name, *tags in _tags(structure) if name.startswith("layers.0.")]


def parameter_layout(config: ModelConfig, layout: str = LAYOUT) -> dict[str, ParameterLayout]:
    """Every parameter of ``GPTModel(config)``, by name, in ``named_parameters`` order, placed in
    ``layout``'s pipeline numbering. An MoE layer's experts are all listed ([E, ...]: every expert)."""
    items = pipeline_items(config, layout)
    by_prefix = {item.prefix: item for item in items if item.prefix is not None}
    template = _tags(_structure(config))
    params: dict[str, ParameterLayout] = {}

    def add(item: PipelineItem, local: str, dim: Optional[int], vocab: bool, expert: bool) -> None:
        name = item.prefix + local
        tied = config.embedding_on_last_stage and item.kind == EMBEDDING
        params[name] = ParameterLayout(name, item.index, local, dim, vocab, tied_to_head=vocab and tied,
                                       file_key=file_key(local, layout), in_tied_module=tied, expert_parallel=expert)

    kinds = _layer_kinds(config)
    layer_params = {kind: [(name[len(f"layers.{i}."):], *tags) for name, *tags in template
                           if name.startswith(f"layers.{i}.")] for i, kind in enumerate(kinds)}
    for name, *tags in template:
        if name.startswith("embedding."):
            add(by_prefix["embedding."], name[len("embedding."):], *tags)
    for item in items:
        if item.kind == TRANSFORMER:
            kind = config.moe is not None and config.moe.is_moe_layer(item.layer_number)
            for local, *tags in layer_params[kind]:
                add(item, local, *tags)
    for prefix in ("final_layernorm.", "mtp.", "output_layer."):
        for name, *tags in template:
            if name.startswith(prefix):
                add(by_prefix[prefix], name[len(prefix):], *tags)
    return params


def model_name(name: str, config: ModelConfig) -> str:
    """GPTModel name of a pipeline module's parameter or state-dict key (``3.mlp...``,
    ``tied_modules.embed.word_embeddings.weight``, ``tied_modules.embed.word_embeddings.norm.bias``)."""
    if name.startswith(TIED_MODULE_PREFIX):
        return "embedding." + local_name_of_file_key(name[len(TIED_MODULE_PREFIX):])
    head, _, local = name.partition(".")
    if not head.isdigit():
        raise ValueError(f"{name!r} is not a pipeline module parameter name (INDEX.NAME or {TIED_MODULE_PREFIX}NAME)")
    item = pipeline_item(int(head), config)
    if item.prefix is None:
        raise ValueError(f"{name!r}: pipeline layer {item.index} ({item.kind}) owns no parameters")
    return item.prefix + local_name_of_file_key(local)


def pipeline_name(param: ParameterLayout) -> str:
    """The parameter's name in a pipeline module: the tied embedding's under DeepSpeed's tied-module
    prefix, every other one under its layer index."""
    if param.in_tied_module:
        return TIED_MODULE_PREFIX + param.local_name
    return f"{param.pipeline_index}.{param.local_name}"
