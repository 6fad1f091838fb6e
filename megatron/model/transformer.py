"""The pre-LayerNorm transformer layer (attention + MLP), its MLP, and the final LayerNorm.

    x = x + dropout(attention(LN1(x)))
    x = x + dropout(MLP(LN2(x)))        MLP(y) = gelu_tanh(y @ W1 + b1) @ W2 + b2

Every module here takes and returns one tensor [s, b, h] so that a pipeline engine can stage the
layers one by one. Hidden dropout sits outside the tensor-parallel region and uses the default
RNG, which must be the same on every TP rank (identical masks on identical activations).

Shape letters: s sequence, b micro-batch, h hidden, np heads per partition, hn head dim,
hp = np * hn, f ffn hidden size, fp = f / tp, v / vp vocabulary (per partition).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.model.attention import KVCache, SelfAttention
from megatron.model.initialization import normal_init, output_layer_std, params_torch_dtype
from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.parallel.state import group_size

__all__ = ["ParallelMLP", "TransformerLayer", "FinalLayerNorm", "zero_biases"]


def zero_biases(module: nn.Module) -> None:
    """Set every parameter named ``bias`` below ``module`` to zero (Megatron's bias init)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name == "bias" or name.endswith(".bias"):
                param.zero_()


class ParallelMLP(nn.Module):
    """h -> f (column-parallel) -> GeLU (tanh approximation) -> h (row-parallel, all-reduced).

    The tanh GeLU is what BLOOM (bias_gelu) and transformers' Bloom / gpt2 (gelu_new) compute.
    """

    def __init__(self, config: ModelConfig, tp_group=None, layer_number: int = 0):
        super().__init__()
        prefix = f"layers.{layer_number}.mlp"
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, config.ffn_size, tp_group=tp_group, bias=True, gather_output=False,
            init_method=normal_init(config.init_method_std, config.seed, f"{prefix}.dense_h_to_4h.weight"))
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_size, config.hidden_size, tp_group=tp_group, bias=True, input_is_parallel=True,
            init_method=normal_init(output_layer_std(config), config.seed, f"{prefix}.dense_4h_to_h.weight"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, h] -> [s, b, h]."""
        intermediate, _ = self.dense_h_to_4h(hidden)  # [s, b, fp]
        intermediate = F.gelu(intermediate, approximate="tanh")
        output, _ = self.dense_4h_to_h(intermediate)  # [s, b, h]
        return output


class TransformerLayer(nn.Module):
    """One pre-LayerNorm decoder layer, tensor-parallel over ``tp_group``.

    Args:
        config: the model configuration.
        tp_group: the tensor-parallel process group (None: one rank).
        layer_number: 0-based index of this layer in the WHOLE model. The initial weights depend
            only on (config.seed, layer_number), so a pipeline stage holding layers 3..5 starts
            exactly as layers 3..5 of the full model do.
        rng_tracker: optional ``RNGStatesTracker`` for attention dropout (see SelfAttention).

    Parameters are created in fp32, initialized, then cast to ``config.params_dtype``.
    """

    def __init__(self, config: ModelConfig, tp_group=None, layer_number: int = 0, rng_tracker=None):
        super().__init__()
        config.validate(group_size(tp_group))
        if not isinstance(layer_number, int) or not 0 <= layer_number < config.num_layers:
            raise ValueError(f"layer_number {layer_number!r} is not a 0-based layer index of a model "
                             f"with num_layers {config.num_layers}")
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = SelfAttention(config, tp_group, layer_number, rng_tracker)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = ParallelMLP(config, tp_group, layer_number)
        zero_biases(self)
        self.to(params_torch_dtype(config))

    def forward(self, hidden: torch.Tensor, kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        """hidden [s, b, h] -> [s, b, h]. ``kv_cache``: this layer's cache when decoding incrementally."""
        attention = self.self_attention(self.input_layernorm(hidden), kv_cache)  # [s, b, h]
        hidden = hidden + F.dropout(attention, p=self.hidden_dropout, training=self.training)
        mlp = self.mlp(self.post_attention_layernorm(hidden))  # [s, b, h]
        return hidden + F.dropout(mlp, p=self.hidden_dropout, training=self.training)


class FinalLayerNorm(nn.LayerNorm):
    """The LayerNorm after the last transformer layer: [s, b, h] -> [s, b, h].

    A plain ``nn.LayerNorm`` (parameters ``weight`` and ``bias``), replicated on every TP rank.
    """

    def __init__(self, config: ModelConfig):
        super().__init__(config.hidden_size, eps=config.layernorm_epsilon)
        self.to(params_torch_dtype(config))
