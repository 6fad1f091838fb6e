"""The pre-norm transformer layer (attention + MLP), its MLP, its norms, and the final norm.

    x = x + dropout(attention(N1(x)))
    x = x + dropout(MLP(N2(x)))         MLP(y) = gelu_tanh(y @ W1 + b1) @ W2 + b2          (GPT, BLOOM)
                                        MLP(y) = (silu(y @ W_gate) * (y @ W_up)) @ W2      (--swiglu, Llama)
    N = LayerNorm, or RMSNorm (--normalization rmsnorm); biases only with add_bias_linear.

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
from megatron.model.norm import Norm
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
    """h -> f (column-parallel) -> GeLU (tanh approximation) or SwiGLU -> h (row-parallel, all-reduced).

    The tanh GeLU is what BLOOM (bias_gelu) and transformers' Bloom / gpt2 (gelu_new) compute.
    With ``config.swiglu`` the first projection is fused, 2f rows interleaved [f, 2] (gate row,
    then up row, per unit of the MLP): TP slicing along dim 0 then hands each rank whole
    (gate, up) pairs, so DeepSpeed's universal dim-0 merge of the shards is exactly the full
    weight. (A [gate; up] stack, Megatron's per-rank layout, would merge wrongly.)
    """

    def __init__(self, config: ModelConfig, tp_group=None, layer_number: int = 0):
        super().__init__()
        prefix = f"layers.{layer_number}.mlp"
        self.swiglu = config.swiglu
        width = 2 * config.ffn_size if config.swiglu else config.ffn_size
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, width, tp_group=tp_group, bias=config.add_bias_linear, gather_output=False,
            init_method=normal_init(config.init_method_std, config.seed, f"{prefix}.dense_h_to_4h.weight"))
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_size, config.hidden_size, tp_group=tp_group, bias=config.add_bias_linear, input_is_parallel=True,
            init_method=normal_init(output_layer_std(config), config.seed, f"{prefix}.dense_4h_to_h.weight"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, h] -> [s, b, h]."""
        intermediate, _ = self.dense_h_to_4h(hidden)  # [s, b, fp] (swiglu: [s, b, 2 fp])
        if self.swiglu:
            gate, up = intermediate.unflatten(-1, (-1, 2)).unbind(-1)  # 2 x [s, b, fp]
            intermediate = F.silu(gate) * up  # [s, b, fp]
        else:
            intermediate = F.gelu(intermediate, approximate="tanh")
        output, _ = self.dense_4h_to_h(intermediate)  # [s, b, h]
        return output


class TransformerLayer(nn.Module):
    """One pre-norm decoder layer, tensor-parallel over ``tp_group``.

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
        self.input_layernorm = Norm(config)
        self.self_attention = SelfAttention(config, tp_group, layer_number, rng_tracker)
        self.post_attention_layernorm = Norm(config)
        self.mlp = ParallelMLP(config, tp_group, layer_number)
        zero_biases(self)
        self.to(params_torch_dtype(config))

    def forward(self, hidden: torch.Tensor, kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        """hidden [s, b, h] -> [s, b, h]. ``kv_cache``: this layer's cache when decoding incrementally."""
        attention = self.self_attention(self.input_layernorm(hidden), kv_cache)  # [s, b, h]
        hidden = hidden + F.dropout(attention, p=self.hidden_dropout, training=self.training)
        mlp = self.mlp(self.post_attention_layernorm(hidden))  # [s, b, h]
        return hidden + F.dropout(mlp, p=self.hidden_dropout, training=self.training)


class FinalLayerNorm(Norm):
    """The norm after the last transformer layer (LayerNorm or RMSNorm): [s, b, h] -> [s, b, h]."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.to(params_torch_dtype(config))
