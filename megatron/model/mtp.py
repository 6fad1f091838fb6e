"""Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 section 2.2; Megatron-LM's ``--mtp-num-layers``).

After the decoder's final norm, depth k = 1..D predicts the token k + 1 places ahead:

    h_0 = the decoder's output after its final norm                 (what the next-token head reads)
    x_k = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_{k-1,i})])           [2h] -> [h], column-parallel, gathered
    h_k = final_layernorm_k(TransformerLayer_k(x_k))                  a layer of the decoder's last layer's kind
    P_k = softmax(Head(h_k))  predicts t_{i+k+1}

Emb and Head are the model's own (shared, so their gradients sum the main and the MTP terms). The concatenation
puts the embedding first, as DeepSeek's released weights and Megatron-LM do. Depth k's loss is the masked mean
cross-entropy over the positions that still have a target: the targets and the mask shift left one place per depth
(the last k positions of a sample drop out), and the embedded tokens of depth k are the inputs shifted by k with
0 in the vacated places (Megatron-LM's ``roll_tensor``; attention is causal, so those places only affect their own
masked outputs). The inputs shifted by one are the labels (``labels[i] = t_{i+1}``), which is how a pipeline's last
stage, which never sees the input ids, runs the same computation.

Training loss (:func:`add_mtp_loss`): L = L_main + (lambda / D) * sum_k L_k, lambda = ``--mtp-loss-scaling-factor``.
The value returned is L_main exactly (the MTP part enters as ``m - m.detach()``), so the reported LM loss stays
comparable with a run without MTP; its gradient is the whole L's. The depth losses are kept on the block
(``last_losses``; summed over an iteration's training forwards for :func:`iteration_losses`, which the training log
and tensorboard report as Megatron-LM's ``mtp_k loss``).

Parameter names: ``mtp.layers.{k-1}.enorm.*``, ``.hnorm.*``, ``.eh_proj.weight`` [h / tp, 2h] (column-parallel),
``.transformer_layer.*`` (a ``TransformerLayer`` numbered ``num_layers + k - 1``: its init streams and MoE kind),
``.final_layernorm.*``, Megatron-LM's names.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.model.initialization import normal_init, params_torch_dtype
from megatron.model.norm import Norm
from megatron.model.transformer import FinalLayerNorm, TransformerLayer
from megatron.parallel.layers import ColumnParallelLinear
from megatron.parallel.mappings import scatter_to_sequence_parallel_region
from megatron.parallel.state import LayerGroups, all_reduce_on_host, group_size

__all__ = ["MTPLayer", "MultiTokenPrediction", "shift_left", "mtp_depth_losses", "add_mtp_loss", "iteration_losses"]


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s]: x[:, i + 1] at i, 0 at the last place (Megatron-LM's roll_tensor without CP)."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


class MTPLayer(nn.Module):
    """One MTP depth (``depth`` 0-based): (h_{k-1} [s, b, h], Emb(t_{i+k}) [s, b, h]) -> h_k [s, b, h]
    (sequence parallel: [s/tp, b, h] shards in and out)."""

    def __init__(self, config: ModelConfig, groups: Optional[LayerGroups] = None, depth: int = 0, rng_tracker=None):
        super().__init__()
        groups = groups if groups is not None else LayerGroups()
        tp_group = groups.tp
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel and group_size(tp_group) > 1
        layer_number = config.num_layers + depth
        self.enorm = Norm(config, tp_group)
        self.hnorm = Norm(config, tp_group)
        self.eh_proj = ColumnParallelLinear(
            2 * config.hidden_size, config.hidden_size, tp_group=tp_group, bias=False, gather_output=True,
            sequence_parallel=self.sequence_parallel, params_dtype=params_torch_dtype(config),
            init_method=normal_init(config.init_method_std, config.seed, f"mtp.layers.{depth}.eh_proj.weight"))
        self.enorm.to(params_torch_dtype(config))
        self.hnorm.to(params_torch_dtype(config))
        self.transformer_layer = TransformerLayer(config, groups, layer_number, rng_tracker)
        self.final_layernorm = FinalLayerNorm(config, tp_group)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)  # [s, b, 2h] (SP: [s/tp, b, 2h])
        x, _ = self.eh_proj(x)  # [s, b, h]: gathered over TP (SP: the sequence gathered first)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h]
        return self.final_layernorm(self.transformer_layer(x))


class MultiTokenPrediction(nn.Module):
    """The D depths (``config.mtp_num_layers``) as ``layers``; :func:`mtp_depth_losses` runs them."""

    def __init__(self, config: ModelConfig, groups: Optional[LayerGroups] = None, rng_tracker=None):
        super().__init__()
        if config.mtp_num_layers < 1:
            raise ValueError("MultiTokenPrediction needs config.mtp_num_layers >= 1")
        self.scaling_factor = config.mtp_loss_scaling_factor
        self.layers = nn.ModuleList(MTPLayer(config, groups, k, rng_tracker) for k in range(config.mtp_num_layers))
        self.last_losses: Optional[torch.Tensor] = None  # [D], detached: the latest micro-batch's depth losses
        # [D losses, forwards] summed on the losses' device (no host sync per micro-batch); iteration_losses reads it
        self.iteration_sums: Optional[torch.Tensor] = None


def mtp_depth_losses(block: MultiTokenPrediction, hidden: torch.Tensor, labels: torch.Tensor,
                     loss_mask: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
                     depth_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                     sequence: Optional[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = None
                     ) -> torch.Tensor:
    """Each depth's loss, [D] (see the module docstring).

    hidden: h_0 [s, b, h] (SP: this rank's shard); labels, loss_mask [b, s] (the full sequence);
    embed(ids [b, s]) -> [s, b, h] (SP: scattered) the shared word embedding; depth_loss(hidden_k, targets [b, s],
    mask [b, s]) -> scalar: the shared head and the loss the main term uses, applied to depth k.

    sequence: with context parallelism, (gather, positions): labels and loss_mask are this rank's tokens [b, s/c],
    gather(x) puts every rank's back into the whole [b, s] and positions [s/c] are this rank's places in it; the
    shifts run on the whole sequence (a token's next one may live on another rank) and each rank keeps its places.
    """
    if sequence is not None:
        gather, positions = sequence
        labels, loss_mask = gather(labels), gather(loss_mask)
    ids = labels.clone()
    ids[:, -1] = 0  # = the inputs shifted left once (the labels are t_{i+1}); position s-1 has no next input
    targets, mask = labels, loss_mask
    mine = (lambda x: x) if sequence is None else (lambda x: x[:, positions])
    losses = []
    for layer in block.layers:
        targets, mask = shift_left(targets), shift_left(mask)
        hidden = layer(hidden, embed(mine(ids)))
        losses.append(depth_loss(hidden, mine(targets), mine(mask)))
        ids = shift_left(ids)
    return torch.stack(losses)


def add_mtp_loss(main: torch.Tensor, block: MultiTokenPrediction, depth_losses: torch.Tensor) -> torch.Tensor:
    """main + (lambda / D) * sum(depth_losses) for the gradient, with main's exact value (module docstring)."""
    block.last_losses = depth_losses.detach()
    if block.training:
        step = torch.cat([block.last_losses.double(), block.last_losses.new_ones(1, dtype=torch.float64)])
        block.iteration_sums = step if block.iteration_sums is None else block.iteration_sums + step
    mtp = block.scaling_factor * depth_losses.mean()
    return main + (mtp - mtp.detach())


def iteration_losses(module: nn.Module, num_depths: int, data_group=None, pipeline_group=None) -> dict[str, float]:
    """{"mtp_k loss": the mean of depth k's loss over the training forwards since the last call} (reset here),
    averaged over the data-parallel ranks; collective over ``data_group`` and ``pipeline_group`` (every rank calls
    it, the last stage's blocks hold the sums). {} when no depth ran."""
    sums = torch.zeros(num_depths + 1, dtype=torch.float64)
    for block in (m for m in module.modules() if isinstance(m, MultiTokenPrediction)):
        if block.iteration_sums is not None:
            sums += block.iteration_sums.cpu()
            block.iteration_sums = None
    sums = all_reduce_on_host(sums, data_group, pipeline_group)
    if sums[-1] == 0:
        return {}
    return {f"mtp_{k + 1} loss": float(sums[k] / sums[-1]) for k in range(num_depths)}
