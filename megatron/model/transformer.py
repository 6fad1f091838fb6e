"""The pre-norm transformer layer (attention + MLP), its MLP, its norms, and the final norm.

    x = x + dropout(attention(N1(x)))
    x = x + dropout(MLP(N2(x)))         MLP(y) = gelu_tanh(y @ W1 + b1) @ W2 + b2          (GPT, BLOOM)
                                        MLP(y) = (silu(y @ W_gate) * (y @ W_up)) @ W2      (--swiglu, Llama)
    N = LayerNorm, or RMSNorm (--normalization rmsnorm); biases only with add_bias_linear.

Every module here takes and returns one tensor [s, b, h] so that a pipeline engine can stage the
layers one by one. Hidden dropout sits outside the tensor-parallel region and uses the default
RNG, which must be the same on every TP rank (identical masks on identical activations).

With ``config.sequence_parallel`` (Megatron's --sequence-parallel) the tensor is this TP rank's
[s/tp, b, h] shard of the sequence: the norms, dropout and residual adds see only its tokens, the
column-parallel layers (QKV, h -> 4h) all-gather it along s and the row-parallel ones (dense,
4h -> h) reduce-scatter back to [s/tp, b, h]. Dropout then runs in the RNG tracker's
model-parallel stream, different on every TP rank (each holds other tokens).

Shape letters: s sequence, b micro-batch, h hidden, np heads per partition, hn head dim,
hp = np * hn, f ffn hidden size, fp = f / tp, v / vp vocabulary (per partition).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.model.attention import KVCache, SelfAttention
from megatron.model.initialization import normal_init, output_layer_std, params_torch_dtype
from megatron.model.latent_attention import MultiLatentAttention
from megatron.model.moe.layer import MoELayer
from megatron.model.norm import Norm
from megatron.parallel.fp8_linear import enable_fp8, match_fp8_state
from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.parallel.random import sequence_parallel_dropout, tracked_checkpoint_func
from megatron.parallel.recompute import OutputDiscardingCheckpoint, recompute_enabled
from megatron.parallel.state import LayerGroups, group_size

__all__ = ["ParallelMLP", "TransformerLayer", "FinalLayerNorm", "zero_biases", "sequence_parallel_dropout"]


def zero_biases(module: nn.Module) -> None:
    """Set every parameter named ``bias`` below ``module`` to zero (Megatron's bias init)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name == "bias" or name.endswith(".bias"):
                param.zero_()


def _check_dropout_stream(config: ModelConfig, tp_group, rng_tracker) -> None:
    if config.sequence_parallel and group_size(tp_group) > 1 and config.hidden_dropout > 0 and rng_tracker is None:
        raise ValueError(f"sequence parallelism with --hidden-dropout {config.hidden_dropout} needs an RNG tracker "
                         f"(megatron.parallel.random) so that every TP rank draws its own dropout mask; pass "
                         f"rng_tracker, or set the dropout to 0")


class ParallelMLP(nn.Module):
    """h -> f (column-parallel) -> GeLU (tanh approximation) or SwiGLU -> h (row-parallel, all-reduced).

    The tanh GeLU is what BLOOM (bias_gelu) and transformers' Bloom / gpt2 (gelu_new) compute.
    With ``config.swiglu`` the first projection is fused, 2f rows interleaved [f, 2] (gate row,
    then up row, per unit of the MLP): TP slicing along dim 0 then hands each rank whole
    (gate, up) pairs, so DeepSpeed's universal dim-0 merge of the shards is exactly the full
    weight. (A [gate; up] stack, Megatron's per-rank layout, would merge wrongly.)
    """

    def __init__(self, config: ModelConfig, tp_group=None, layer_number: int = 0, init_prefix: Optional[str] = None):
        super().__init__()
        prefix = init_prefix or f"layers.{layer_number}.mlp"  # the weights' names: their init streams
        self.swiglu = config.swiglu
        width = 2 * config.ffn_size if config.swiglu else config.ffn_size
        sequence_parallel = config.sequence_parallel and group_size(tp_group) > 1
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, width, tp_group=tp_group, bias=config.add_bias_linear, gather_output=False,
            sequence_parallel=sequence_parallel,
            init_method=normal_init(config.init_method_std, config.seed, f"{prefix}.dense_h_to_4h.weight"))
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_size, config.hidden_size, tp_group=tp_group, bias=config.add_bias_linear, input_is_parallel=True,
            sequence_parallel=sequence_parallel,
            init_method=normal_init(output_layer_std(config), config.seed, f"{prefix}.dense_4h_to_h.weight"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, h] -> [s, b, h] (sequence parallel: [s/tp, b, h] -> [s/tp, b, h])."""
        intermediate, _ = self.dense_h_to_4h(hidden)  # [s, b, fp] (swiglu: [s, b, 2 fp])
        if self.swiglu:
            gate, up = intermediate.unflatten(-1, (-1, 2)).unbind(-1)  # 2 x [s, b, fp]
            intermediate = F.silu(gate) * up  # [s, b, fp]
        else:
            intermediate = F.gelu(intermediate, approximate="tanh")
        output, _ = self.dense_4h_to_h(intermediate)  # [s, b, h] (sequence parallel: [s/tp, b, h])
        return output


def _mlp(config: ModelConfig, groups: LayerGroups, layer_number: int) -> nn.Module:
    moe, tp_group = config.moe, groups.tp
    if moe is None or not moe.is_moe_layer(layer_number):
        return ParallelMLP(config, tp_group, layer_number)
    shared = None
    if moe.shared_expert_intermediate_size is not None:
        shared_config = dataclasses.replace(config, ffn_hidden_size=moe.shared_expert_intermediate_size)
        shared = ParallelMLP(shared_config, tp_group, layer_number, init_prefix=f"layers.{layer_number}.mlp.shared_expert")
    return MoELayer(config, groups, layer_number, shared_expert=shared)


class TransformerLayer(nn.Module):
    """One pre-norm decoder layer, tensor-parallel over ``groups.tp``.

    Args:
        config: the model configuration.
        groups: the groups the layer works over (``megatron.parallel.state.LayerGroups``; None: one rank on
            every axis): ``tp`` the tensor-parallel group, ``cp`` the context-parallel group (ring attention over
            this rank's load-balanced tokens), ``ep`` the expert-model-parallel group of an MoE layer's experts,
            ``sequence_exchange`` DeepSpeed-Ulysses' ``SequenceExchange`` for the attention.
        layer_number: 0-based index of this layer in the WHOLE model. The initial weights depend
            only on (config.seed, layer_number), so a pipeline stage holding layers 3..5 starts
            exactly as layers 3..5 of the full model do.
        rng_tracker: optional ``RNGStatesTracker`` for attention dropout (see SelfAttention) and, with
            sequence parallelism, the hidden dropout (required then if the dropout is not 0).

    The MLP is ``ParallelMLP``, or ``MoELayer`` in the layers ``config.moe`` marks (its shared expert, if any, a
    ParallelMLP of width ``moe.shared_expert_intermediate_size`` named ``mlp.shared_expert``). The attention is
    ``SelfAttention``, or ``MultiLatentAttention`` with ``config.mla`` (--multi-latent-attention).

    Parameters are created in fp32, initialized, then cast to ``config.params_dtype``.
    """

    def __init__(self, config: ModelConfig, groups: Optional[LayerGroups] = None, layer_number: int = 0,
                 rng_tracker=None):
        super().__init__()
        groups = groups if groups is not None else LayerGroups()
        tp_group = groups.tp
        config.validate(group_size(tp_group))
        if not isinstance(layer_number, int) or not 0 <= layer_number < config.total_layers:
            raise ValueError(f"layer_number {layer_number!r} is not a 0-based layer index of a model "
                             f"with num_layers {config.num_layers} (and {config.mtp_num_layers} MTP layers after them)")
        _check_dropout_stream(config, tp_group, rng_tracker)
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel and group_size(tp_group) > 1
        self.rng_tracker = rng_tracker
        self.recompute_modules = config.recompute_modules  # --recompute-modules (core_attn is the attention's)
        self.input_layernorm = Norm(config, tp_group)
        attention = SelfAttention if config.mla is None else MultiLatentAttention  # --multi-latent-attention
        self.self_attention = attention(config, groups, layer_number, rng_tracker)
        self.post_attention_layernorm = Norm(config, tp_group)
        self.mlp = _mlp(config, groups, layer_number)
        zero_biases(self)
        self.to(params_torch_dtype(config))
        if config.fp8 is not None and layer_number not in config.fp8.bf16_layers(config.num_layers):
            enable_fp8(self, config.fp8)  # --fp8-format: the linear layers' and experts' GEMMs
        # checkpoints load across runs with and without FP8 (its scaling state dropped or started afresh)
        self._register_load_state_dict_pre_hook(lambda state_dict, prefix, *_: match_fp8_state(self, state_dict,
                                                                                               prefix))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return sequence_parallel_dropout(x, self.hidden_dropout, self.training, self.rng_tracker)
        return F.dropout(x, p=self.hidden_dropout, training=self.training)

    def forward(self, hidden: torch.Tensor, kv_cache: Optional[KVCache] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden [s, b, h] -> [s, b, h] (sequence parallel: [s/tp, b, h] -> [s/tp, b, h]).
        ``kv_cache``: this layer's cache when decoding incrementally (not with sequence parallelism).
        ``document_ids``: [b, s] the document of every token (--reset-attention-mask), for the attention.

        As a pipeline layer (``megatron.engine.pipeline``) with document masks, ``hidden`` is the stage activation
        (hidden, document_ids) and the output (output, document_ids): the ids travel between stages with it."""
        if isinstance(hidden, tuple):  # the pipeline's (hidden, document_ids)
            hidden, document_ids = hidden
            return self.forward(hidden, kv_cache, document_ids), document_ids
        if self.recompute_modules and recompute_enabled(self):
            return self._recomputing_forward(hidden, document_ids)
        if document_ids is None:
            attention = self.self_attention(self.input_layernorm(hidden), kv_cache)  # [s, b, h]
        else:
            attention = self.self_attention(self.input_layernorm(hidden), kv_cache, document_ids)  # [s, b, h]
        hidden = hidden + self._dropout(attention)
        mlp = self.mlp(self.post_attention_layernorm(hidden))  # [s, b, h]
        return hidden + self._dropout(mlp)

    def _recomputing_forward(self, hidden: torch.Tensor, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The training forward with --recompute-modules: layernorm (both norms' outputs freed once their consumer
        ran, rebuilt in backward: megatron.parallel.recompute), mlp (a dense MLP kept as its input only, through
        the RNG-tracked checkpoint); moe, moe_act, shared_experts and mla_up_proj are the MoE layer's and the
        attention's own."""
        # Each norm's output is rebuilt when the gradient of the residual sum after its branch is complete: before
        # the branch's backward, and before any rebuild inside the branch that reads it (mla_up_proj's).
        norms = "layernorm" in self.recompute_modules
        first = OutputDiscardingCheckpoint() if norms else None
        normed = first(self.input_layernorm, hidden) if norms else self.input_layernorm(hidden)
        attention = self.self_attention(normed) if document_ids is None else self.self_attention(normed, None,
                                                                                                 document_ids)
        hidden = hidden + self._dropout(attention)  # [s, b, h]
        second = OutputDiscardingCheckpoint() if norms else None
        normed = second(self.post_attention_layernorm, hidden) if norms else self.post_attention_layernorm(hidden)
        if "mlp" in self.recompute_modules and isinstance(self.mlp, ParallelMLP):
            mlp = tracked_checkpoint_func(self.rng_tracker)(self.mlp, normed)  # [s, b, h]
        else:
            mlp = self.mlp(normed)  # [s, b, h]
        output = hidden + self._dropout(mlp)
        if norms:
            first.discard(hidden)
            second.discard(output)
        return output


class FinalLayerNorm(Norm):
    """The norm after the last transformer layer (LayerNorm or RMSNorm): [s, b, h] -> [s, b, h]
    (sequence parallel: this rank's [s/tp, b, h]; the output head gathers the sequence)."""

    def __init__(self, config: ModelConfig, tp_group=None):
        super().__init__(config, tp_group)
        self.to(params_torch_dtype(config))
