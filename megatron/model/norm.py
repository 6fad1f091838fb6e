"""``Norm``: the LayerNorm or RMSNorm every block, the final norm and BLOOM's embedding norm use.

Which one is ``ModelConfig.normalization``; both act on the last (hidden) dimension of [s, b, h]
(with sequence parallelism, this TP rank's [s/tp, b, h]), or with ``--qk-layernorm`` on the head
dimension of the queries and keys [s, b, np, hn].
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.parallel.state import group_size

__all__ = ["Norm"]


class Norm(nn.Module):
    """The norm ``config.normalization`` names, over the hidden dimension: [..., h] -> [..., h].

    layernorm: (x - mean) / sqrt(var + eps) * weight + bias (parameters ``weight``, ``bias``: the
    same names, values and kernel as ``nn.LayerNorm``). rmsnorm (Zhang & Sennrich 2019):
    x / sqrt(mean(x^2) + eps) * weight, parameter ``weight`` only; normalized in fp32 and cast back
    before the weight, as Llama computes it (bf16 squares lose the small components).
    Replicated on every TP rank.

    With ``config.sequence_parallel`` and a ``tp_group`` of several ranks, each rank normalizes only
    its own tokens, so its weight (and bias) gradient is a partial sum over the group: the parameters
    pass through copy_to (forward identity, backward all-reduce over ``tp_group``) and are tagged
    ``sequence_parallel = True``. That works under any engine, recomputation and ZeRO-3.

    ``config.apply_layernorm_1p`` (Megatron-LM's zero-centred weights): ``weight`` starts at 0 and the norm scales
    by ``1 + weight`` (computed in the weight's dtype, as Megatron's ``weight + 1``); ``effective_norm_weights``
    turns a state dict of such weights into the usual ones (the Hugging Face export).

    ``per_head_size`` hn (``--qk-layernorm``): the norm of each query / key head, over [..., hn] instead of h.
    Each TP rank holds other heads, so its gradient is again a partial sum: it goes through copy_to over
    ``tp_group`` whatever the sequence parallelism (one all-reduce of hn values per step).
    """

    def __init__(self, config: ModelConfig, tp_group=None, per_head_size: Optional[int] = None):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel and group_size(tp_group) > 1
        partial_grads = self.sequence_parallel or (per_head_size is not None and group_size(tp_group) > 1)
        self.tp_group = tp_group if partial_grads else None
        size = config.hidden_size if per_head_size is None else per_head_size
        self.normalized_shape, self.eps = (size,), config.layernorm_epsilon
        self.zero_centred = config.apply_layernorm_1p
        self.weight = nn.Parameter(torch.zeros(size) if self.zero_centred else torch.ones(size))
        if config.normalization == "layernorm":
            self.bias = nn.Parameter(torch.zeros(size))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            param.sequence_parallel = self.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tp_group is None unless the gradients are partial sums (see above): copy_to is then the identity.
        weight = copy_to_tensor_model_parallel_region(self.weight, self.tp_group)
        if self.zero_centred:
            weight = weight + 1
        if self.bias is not None:
            bias = copy_to_tensor_model_parallel_region(self.bias, self.tp_group)
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps).to(x.dtype)
        return normed * weight

    def extra_repr(self) -> str:
        kind = "layernorm" if self.bias is not None else "rmsnorm"
        return f"{kind}, {self.normalized_shape[0]}, eps={self.eps}" + (", scale 1 + weight" if self.zero_centred else "")


# Every norm's weight in a state dict of ours ends so (input_layernorm, post_attention_layernorm, final_layernorm,
# embed_layernorm, q_layernorm, k_layernorm, kv_layernorm).
NORM_WEIGHT_SUFFIX = "layernorm.weight"


def effective_norm_weights(state_dict: dict, config: ModelConfig) -> dict:
    """``state_dict`` with every norm weight as the scale it applies: ``1 + w`` under ``apply_layernorm_1p``, else
    unchanged (the same dict)."""
    if not config.apply_layernorm_1p:
        return state_dict
    return {name: tensor + 1 if name.endswith(NORM_WEIGHT_SUFFIX) else tensor for name, tensor in state_dict.items()}
