"""Which parameters are sharded how across tensor-parallel ranks, and keeping the replicated ones equal.

The regex lists name parameters by their names in ``GPTModel`` (``layers.3.mlp...``) or in a
pipeline module that stages the same layers (``3.mlp...``, ``tied_modules.embed.word_embeddings...``,
a bare FinalLayerNorm as ``5.weight``). They are written for ``re.match`` (anchored at both ends),
which is what DeepSpeed's universal-checkpoint converter uses:

- TP_REPLICATED_PARAMETER_PATTERNS: identical on every TP rank (LayerNorms, row-parallel biases,
  learned positions); the converter keeps one copy.
- ROW_PARALLEL_PARAMETER_PATTERNS: sharded along dim 1 (the input of a RowParallelLinear).
- VOCABULARY_PARAMETER_PATTERNS: sharded along the (padded) vocabulary, dim 0.
Everything else is column-parallel: sharded along dim 0 (including the per-head interleaved QKV).

Shape letters: s sequence, b micro-batch, h hidden, np heads per partition, hn head dim,
hp = np * hn, v / vp vocabulary (per partition).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from megatron.parallel.state import group_size

__all__ = ["TP_REPLICATED_PARAMETER_PATTERNS", "ROW_PARALLEL_PARAMETER_PATTERNS",
           "VOCABULARY_PARAMETER_PATTERNS", "tp_duplicated_parameters", "matches_any",
           "sync_tp_duplicated_parameters"]

_ANY_PREFIX = r"^(?:.*\.)?"

TP_REPLICATED_PARAMETER_PATTERNS = [
    _ANY_PREFIX + r"position_embeddings\.weight$",
    _ANY_PREFIX + r"embed_layernorm\.(?:weight|bias)$",
    _ANY_PREFIX + r"input_layernorm\.(?:weight|bias)$",
    _ANY_PREFIX + r"post_attention_layernorm\.(?:weight|bias)$",
    _ANY_PREFIX + r"self_attention\.dense\.bias$",
    _ANY_PREFIX + r"mlp\.dense_4h_to_h\.bias$",
    _ANY_PREFIX + r"final_layernorm\.(?:weight|bias)$",
    _ANY_PREFIX + r"\d+\.(?:weight|bias)$",  # FinalLayerNorm staged directly as pipeline layer N
]

ROW_PARALLEL_PARAMETER_PATTERNS = [
    _ANY_PREFIX + r"self_attention\.dense\.weight$",
    _ANY_PREFIX + r"mlp\.dense_4h_to_h\.weight$",
]

VOCABULARY_PARAMETER_PATTERNS = [
    _ANY_PREFIX + r"word_embeddings\.weight$",
]


def matches_any(name: str, patterns: list[str]) -> bool:
    """True if ``re.match(pattern, name)`` for one of ``patterns``."""
    return any(re.match(pattern, name) for pattern in patterns)


def tp_duplicated_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter replicated across TP ranks, i.e. not tagged
    ``tensor_model_parallel`` by the parallel layers. In ``named_parameters`` order."""
    return [(name, param) for name, param in module.named_parameters()
            if not getattr(param, "tensor_model_parallel", False)]


def sync_tp_duplicated_parameters(module: nn.Module, tp_group) -> int:
    """Average every TP-replicated parameter of ``module`` across ``tp_group`` in place.

    Replicated parameters receive identical gradients, but non-deterministic kernels or bf16
    rounding can still let them drift apart; DeepSpeed's universal-checkpoint converter then
    refuses the checkpoint. (--sync-tp-duplicated-parameters.) Collective: every rank of the group
    must call it with the same module structure. One fp32 all-reduce for all of them. Returns the
    number of parameters averaged (0 and no communication when the group has one rank).
    """
    tp_size = group_size(tp_group)
    params = [param for _, param in tp_duplicated_parameters(module)]
    if tp_size == 1 or not params:
        return 0
    with torch.no_grad():
        flat = torch.cat([param.detach().float().reshape(-1) for param in params])  # [sum of numels]
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=tp_group)
        flat /= tp_size
        offset = 0
        for param in params:
            numel = param.numel()
            param.copy_(flat[offset:offset + numel].view_as(param))
            offset += numel
    return len(params)
