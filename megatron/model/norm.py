"""``Norm``: the LayerNorm or RMSNorm every block, the final norm and BLOOM's embedding norm use.

Which one is ``ModelConfig.normalization``; both act on the last (hidden) dimension of [s, b, h].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig

__all__ = ["Norm"]


class Norm(nn.Module):
    """The norm ``config.normalization`` names, over the hidden dimension: [..., h] -> [..., h].

    layernorm: (x - mean) / sqrt(var + eps) * weight + bias (parameters ``weight``, ``bias``: the
    same names, values and kernel as ``nn.LayerNorm``). rmsnorm (Zhang & Sennrich 2019):
    x / sqrt(mean(x^2) + eps) * weight, parameter ``weight`` only; normalized in fp32 and cast back
    before the weight, as Llama computes it (bf16 squares lose the small components).
    Replicated on every TP rank.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.normalized_shape, self.eps = (config.hidden_size,), config.layernorm_epsilon
        self.weight = nn.Parameter(torch.ones(config.hidden_size))
        if config.normalization == "layernorm":
            self.bias = nn.Parameter(torch.zeros(config.hidden_size))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps).to(x.dtype)
        return normed * self.weight

    def extra_repr(self) -> str:
        kind = "layernorm" if self.bias is not None else "rmsnorm"
        return f"{kind}, {self.normalized_shape[0]}, eps={self.eps}"
