"""What the MoE layers did in one iteration, for the training log and tensorboard.

Each MoELayer sums, over its training forwards (micro-batches; twice each under activation recomputation, which
leaves every ratio below unchanged), its aux and z losses (coefficients applied: what the objective adds), the
choices it dropped for capacity and the choices each expert got. ``iteration_stats`` sums those over the
data-parallel and sequence (CP, Ulysses) ranks (other tokens; a sequence rank counts 1 / n of a forward and its
parts of the losses) and the pipeline stages (other layers) and returns, under stable tags:

    moe/layer{i}/load-max-over-mean    the busiest expert's choices over the mean (1 = balanced), layer i (0-based)
    moe/aux-loss, moe/z-loss           per micro-batch, summed over the MoE layers
    moe/dropped-fraction               dropped choices over all choices, all MoE layers

Shape letters: L layers, E experts.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.config.moe import MoEConfig
from megatron.model.moe.layer import STATS_FIELDS, moe_layers
from megatron.parallel.state import all_reduce_on_host

__all__ = ["iteration_stats"]


def iteration_stats(module: nn.Module, config: MoEConfig, num_layers: int, data_group=None,
                    pipeline_group=None) -> dict[str, float]:
    """{tag: value} for the forwards since the last call (every MoE layer's statistics are reset). Collective over
    ``data_group`` and ``pipeline_group``: every rank calls it, with MoE layers on its stage or not."""
    table = torch.zeros(num_layers, STATS_FIELDS + config.num_experts, dtype=torch.float64)  # [L, 5 + E]
    for layer in moe_layers(module):
        table[layer.layer_number] = layer.take_stats()
    table = all_reduce_on_host(table, data_group, pipeline_group)
    ran = table[:, 0] > 0
    if not ran.any():
        return {}
    forwards, aux, z, dropped, choices = table[ran, :STATS_FIELDS].unbind(1)
    load = table[ran, STATS_FIELDS:]  # [L', E]
    out = {f"moe/layer{i}/load-max-over-mean": float(row.max() / row.mean().clamp(min=1e-12))
           for i, row in zip(ran.nonzero().flatten().tolist(), load)}
    out["moe/aux-loss"] = float((aux / forwards).sum())
    out["moe/z-loss"] = float((z / forwards).sum())
    out["moe/dropped-fraction"] = float(dropped.sum() / choices.sum())
    return out
