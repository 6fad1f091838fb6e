"""Multi-head latent attention (MLA; DeepSeek-V2, Liu et al. 2024; DeepSeek-V3), heads split across the TP group.

    q        = W_qB norm(W_qA x)   (or W_q x without a query latent)       [s, b, np, dn + dr]
    c, k_r   = W_kvA x                                                      [s, b, dc], [s, b, dr]
    k_n, v   = W_kvB norm(c)                                                [s, b, np, dn], [s, b, np, dv]
    k        = [k_n, rope(k_r)] (k_r one head, shared by all), q = [q_n, rope(q_r)]
    out      = W_o softmax(q k^T / sqrt(dn + dr), causal) v

W_qA, W_kvA and the two latent norms are replicated on every TP rank: their input is the whole hidden state and
the column-parallel W_qB / W_kvB behind them all-reduce the latents' gradients (their ``copy_to``); the shared
rotary key k_r, which this rank's heads alone use, passes through a ``copy_to`` of its own (forward identity,
backward all-reduce over TP). So every rank computes the same full gradient for them, with no further
all-reduce. W_q, W_qB and W_kvB are column-parallel by heads (their rows are per head: [np, dn + dr] and
[np, dn + dv], transformers' layout), W_o row-parallel. The rotary part is laid out as DeepSeek's checkpoints
hold it, in interleaved pairs (x0, x1), (x2, x3), ...: it is de-interleaved to [x0, x2, ..; x1, x3, ..] before
the half-split rotary of ``megatron.model.positional`` (what Megatron-LM's MLA and transformers' rope_interleave
do), the same on queries and keys, so the scores are those of the interleaved rotation.

Megatron's sequence parallelism (Megatron-LM's order): the down-projections and latent norms run on this rank's
s/tp tokens, so their weight gradients are partial sums (their weights pass through ``copy_to`` over TP and are
tagged ``sequence_parallel``, ``Norm``'s pattern); the column-parallel up-projections gather the latents along s
(backward: reduce-scatter), k_r is gathered the same way, and W_o reduce-scatters its output back to s/tp tokens.
Context parallelism: this rank's load-balanced tokens, rotary at their global positions, the core is ring
attention (``megatron.model.ring_attention``, value heads of their own size). The core otherwise runs on
--attention-backend's kernel (sdpa, flex, unfused; ``attention_core``); flash is refused (FlashAttention-2 needs
dv = dn + dr). Under ZB-H1 the replicated down-projections defer their weight gradients as the parallel linears do
(not with sequence parallelism: their gradients' all-reduce belongs to the backward pass).

DeepSpeed-Ulysses (a ``SequenceExchange``, as ``SelfAttention``): the projections and rotary (at the global
positions) run on this rank's s/sp tokens; an all-to-all hands the core attention the whole sequence for np/sp
heads (the key's shared rotary part already expanded to every head; the values keep their own head size) and
hands the context back.

Not implemented: the inference server's batched KV cache; a plain ``KVCache`` (tools/generate.py) holds the
expanded keys and values.

Shape letters: s sequence (sq queries, sk keys incl. cached ones), b micro-batch, h hidden, np heads per partition,
dn / dr / dv the query-key position-free / rotary / value head dims (qk_head_dim, qk_pos_emb_head_dim, v_head_dim),
dq / dc the query / key-value latent ranks.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.model.attention import KVCache
from megatron.model.attention_core import (
    document_causal_mask,
    flex_core_attention,
    resolve_attention_backend,
    runs_per_document,
    sdpa_per_document,
    unfused_core_attention,
)
from megatron.model.initialization import normal_init, output_layer_std
from megatron.model.kv_cache import BatchKVCache
from megatron.model.norm import Norm
from megatron.model.positional import Yarn, apply_rotary, rotary_cos_sin, rotary_scaling
from megatron.model.ring_attention import ring_attention
from megatron.parallel.context_parallel import load_balanced_positions
from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region
from megatron.parallel.random import tracked_checkpoint_func
from megatron.parallel.recompute import OutputDiscardingCheckpoint, recompute_enabled
from megatron.parallel.state import LayerGroups, group_rank, group_size
from megatron.parallel.weight_grad_store import linear

__all__ = ["MultiLatentAttention", "ReplicatedLinear", "deinterleave"]


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., dr] in pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...] (each pair's two halves apart)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)  # [..., dr]


class ReplicatedLinear(nn.Module):
    """Y = X A^T, the full A [o, i] on every TP rank (no tensor-parallel tag: layouts read it as replicated).
    Under ZB-H1 its weight gradient is deferred like the parallel linears' (``weight_grad_store``).

    ``tp_group`` (sequence parallelism: each TP rank holds other tokens): the weight's gradient is then a partial
    sum over the group; the weight passes through ``copy_to`` (forward identity, backward all-reduce over
    ``tp_group``) and is tagged ``sequence_parallel`` (``Norm``'s pattern). Its weight gradient is then not
    deferred (the all-reduce belongs to the backward pass that computes it)."""

    def __init__(self, input_size: int, output_size: int, init_method, tp_group=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.float32))
        init_method(self.weight)
        self.tp_group = tp_group if group_size(tp_group) > 1 else None
        self.weight.sequence_parallel = self.tp_group is not None
        self.weight_grad_store = None  # ZB-H1: where the weight gradient is deferred (weight_grad_store.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            return F.linear(x, copy_to_tensor_model_parallel_region(self.weight, self.tp_group))
        return linear(x, self.weight, None, self.weight_grad_store)


class MultiLatentAttention(nn.Module):
    """Causal multi-head latent attention; the same constructor and forward as ``SelfAttention``.

    Args:
        config: the model configuration (``config.mla`` holds the latent sizes; ``config.sequence_parallel``:
            the input and output are this TP rank's [s/tp, b, h]).
        groups: ``LayerGroups`` (None: one rank on every axis): ``tp`` the tensor-parallel group; ``cp`` the
            context-parallel group (this rank then holds its load-balanced tokens; the core is ring attention);
            ``sequence_exchange`` DeepSpeed-Ulysses' ``SequenceExchange`` (None: the whole sequence here).
        layer_number: this layer's 0-based index in the whole model (names its init streams).
        rng_tracker: a ``RNGStatesTracker``; attention dropout runs in its model-parallel stream.
    """

    def __init__(self, config: ModelConfig, groups: Optional[LayerGroups] = None, layer_number: int = 0,
                 rng_tracker=None):
        super().__init__()
        groups = groups if groups is not None else LayerGroups()
        tp_group, sequence_exchange = groups.tp, groups.sequence_exchange
        mla = config.mla
        self.config, self.mla, self.rng_tracker, self.tp_group = config, mla, rng_tracker, tp_group
        self.cp_group = groups.cp
        self.num_heads_per_partition = config.num_attention_heads // group_size(tp_group)  # np
        sp_rank, sp_size = (0, 1) if sequence_exchange is None else (sequence_exchange.sp_rank,
                                                                      sequence_exchange.sp_size)
        if self.num_heads_per_partition % sp_size:
            raise ValueError(f"{self.num_heads_per_partition} heads per tensor-parallel rank do not split over "
                             f"{sp_size} sequence-parallel ranks; --num-attention-heads must be divisible by TP x SP "
                             f"= {group_size(tp_group) * sp_size}")
        self._sp_rank = sp_rank  # Ulysses: this rank's tokens start at sp_rank * s/sp of the whole sequence
        # Ulysses' all-to-all attention around the core one (not a submodule: it holds no state; SelfAttention's)
        object.__setattr__(self, "_sequence_exchange", None if sequence_exchange is None
                           else sequence_exchange.wrap(self._ulysses_local_attention))
        heads, h, std, seed = config.num_attention_heads, config.hidden_size, config.init_method_std, config.seed
        prefix = f"layers.{layer_number}.self_attention"
        # --sequence-parallel: the down-projections and latent norms run on this rank's s/tp tokens (partial
        # weight gradients, summed over TP); the column-parallel up-projections gather the latents along s
        sequence_parallel = config.sequence_parallel and group_size(tp_group) > 1
        self.sequence_parallel = sequence_parallel
        token_group = tp_group if sequence_parallel else None  # where the replicated weights' gradients are partial

        def column(inputs: int, per_head: int, name: str) -> ColumnParallelLinear:
            return ColumnParallelLinear(inputs, heads * per_head, tp_group=tp_group, bias=False, gather_output=False,
                                        sequence_parallel=sequence_parallel,
                                        init_method=normal_init(std, seed, f"{prefix}.{name}.weight"))

        def replicated(inputs: int, outputs: int, name: str) -> ReplicatedLinear:
            return ReplicatedLinear(inputs, outputs, normal_init(std, seed, f"{prefix}.{name}.weight"), token_group)

        if mla.q_lora_rank is None:
            self.linear_q_proj = column(h, mla.q_head_dim, "linear_q_proj")
        else:
            self.linear_q_down_proj = replicated(h, mla.q_lora_rank, "linear_q_down_proj")
            self.q_layernorm = (Norm(config, token_group, per_head_size=mla.q_lora_rank) if config.qk_layernorm
                                else None)
            self.linear_q_up_proj = column(mla.q_lora_rank, mla.q_head_dim, "linear_q_up_proj")
        self.linear_kv_down_proj = replicated(h, mla.kv_lora_rank + mla.qk_pos_emb_head_dim, "linear_kv_down_proj")
        self.kv_layernorm = Norm(config, token_group, per_head_size=mla.kv_lora_rank) if config.qk_layernorm else None
        self.linear_kv_up_proj = column(mla.kv_lora_rank, mla.qk_head_dim + mla.v_head_dim, "linear_kv_up_proj")
        self.dense = RowParallelLinear(
            heads * mla.v_head_dim, h, tp_group=tp_group, bias=False, input_is_parallel=True,
            sequence_parallel=sequence_parallel,
            init_method=normal_init(output_layer_std(config), seed, f"{prefix}.dense.weight"))
        self._rope_scaling = rotary_scaling(config)  # Llama 3.1's, YaRN's, or None

    def _query_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [sq, b, h] (SP: [sq/tp, b, h]) -> what the query's up-projection takes: the normed latent
        [sq, b, dq] (SP: [sq/tp, b, dq]), or hidden itself without a query latent (--q-lora-rank unset)."""
        if self.mla.q_lora_rank is None:
            return hidden
        latent = self.linear_q_down_proj(hidden)  # [sq, b, dq] (SP: [sq/tp, b, dq])
        return self.q_layernorm(latent) if self.q_layernorm is not None else latent

    def _query_key_value(self, q_input: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, offset: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The up-projections and RoPE (--recompute-modules mla_up_proj recomputes exactly this): the query input
        (``_query_input``), the normed key / value latent [sq, b, dc] and the rotary key part [sq, b, dr] (SP:
        sq/tp tokens each) -> query, key [sq, b, np, dn + dr], value [sq, b, np, dv] (the whole sequence)."""
        mla, np_ = self.mla, self.num_heads_per_partition
        dn, dr, dv = mla.qk_head_dim, mla.qk_pos_emb_head_dim, mla.v_head_dim
        up = self.linear_q_proj if mla.q_lora_rank is None else self.linear_q_up_proj
        query = up(q_input)[0]  # [sq, b, np * (dn + dr)] (SP: the input gathered along s first)
        sq, b, _ = query.shape  # the whole sequence even where the inputs are sequence-parallel shards
        query = query.view(sq, b, np_, dn + dr)  # [sq, b, np, dn + dr]
        q_nope, q_rope = query.split([dn, dr], dim=-1)
        kv, _ = self.linear_kv_up_proj(latent)  # [sq, b, np * (dn + dv)] (SP: the latent gathered along s first)
        k_nope, value = kv.view(sq, b, np_, dn + dv).split([dn, dv], dim=-1)  # [sq, b, np, dn], [sq, b, np, dv]
        if self.cp_group is not None:  # this rank's chunks i and 2cp-1-i of the sequence
            cp = group_size(self.cp_group)
            positions = load_balanced_positions(sq * cp, cp, group_rank(self.cp_group), q_input.device)  # [sq]
        else:
            positions = torch.arange(offset, offset + sq, device=q_input.device)  # [sq]
        cos, sin = rotary_cos_sin(positions, dr, self.config.rotary_base, self._rope_scaling)  # 2 x [sq, dr]
        q_rope = apply_rotary(deinterleave(q_rope), cos, sin)  # [sq, b, np, dr]
        # every head's gradient summed over TP (SP: and the gathered tokens' gradients scattered back)
        if self.sequence_parallel:
            k_rope = gather_from_sequence_parallel_region(k_rope, self.tp_group)  # [sq, b, dr]
        else:
            k_rope = copy_to_tensor_model_parallel_region(k_rope, self.tp_group)
        k_rope = apply_rotary(deinterleave(k_rope)[:, :, None, :], cos, sin)  # [sq, b, 1, dr]
        query = torch.cat((q_nope, q_rope), dim=-1)  # [sq, b, np, dn + dr]
        key = torch.cat((k_nope, k_rope.expand(sq, b, np_, dr)), dim=-1)  # [sq, b, np, dn + dr]
        return query, key, value

    def forward(self, hidden: torch.Tensor, kv_cache: Optional[KVCache] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden [sq, b, h] (already normed) -> attention output [sq, b, h]; with sequence parallelism
        [sq/tp, b, h] -> [sq/tp, b, h]. ``kv_cache``: a ``KVCache`` holding this layer's expanded keys
        [sk, b, np, dn + dr] and values [sk, b, np, dv]. ``document_ids``: [b, s] the document of every token
        (--reset-attention-mask; as ``SelfAttention``'s: this rank's load-balanced tokens' under CP).

        --recompute-modules mla_up_proj: the query, key and value (``_query_key_value``'s outputs) are freed once
        the attention core (or the ring, or Ulysses' exchange) has taken them, and rebuilt from the latents in
        backward (megatron.parallel.recompute)."""
        if isinstance(kv_cache, BatchKVCache):
            raise ValueError("--multi-latent-attention has no batched KV cache (the inference server's); decode "
                             "with tools/generate.py")
        if (self.cp_group is not None or self._sequence_exchange is not None) and kv_cache is not None:
            raise ValueError("decoding with a KV cache runs without sequence or context parallelism (SP = CP = 1 "
                             "when serving)")
        if document_ids is not None and kv_cache is not None:
            raise ValueError("document masks (--reset-attention-mask) are for training; decode without them")
        mla = self.mla
        q_input = self._query_input(hidden)
        # [sq, b, dc], [sq, b, dr] (SP: this rank's sq/tp tokens)
        latent, k_rope = self.linear_kv_down_proj(hidden).split([mla.kv_lora_rank, mla.qk_pos_emb_head_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        sq = hidden.shape[0] * (group_size(self.tp_group) if self.sequence_parallel else 1)
        offset = self._sp_rank * sq if kv_cache is None else kv_cache.length  # Ulysses: this rank's first token
        if "mla_up_proj" in self.config.recompute_modules and kv_cache is None and recompute_enabled(self):
            part = OutputDiscardingCheckpoint()
            query, key, value = part(lambda *x: self._query_key_value(*x, offset), q_input, latent, k_rope)
            output = self._attend(query, key, value, offset, kv_cache, document_ids)
            part.discard(output)
            return output
        return self._attend(*self._query_key_value(q_input, latent, k_rope, offset), offset, kv_cache, document_ids)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offset: int,
                kv_cache: Optional[KVCache], document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query, key [sq, b, np, dn + dr], value [sq, b, np, dv] -> the attention's output [sq, b, h] (SP:
        [sq/tp, b, h]), through the KV cache, Ulysses' exchange, the ring, or the core attention."""
        sq, b, np_, dv = value.shape
        if kv_cache is not None:
            key, value = kv_cache.append(key, value)  # [sk, b, np, dn + dr], [sk, b, np, dv]

        if self._sequence_exchange is not None:  # all-to-all: the whole sequence for np/sp heads, and back
            self._documents = document_ids  # the whole sample's, read by _ulysses_local_attention
            context = self._sequence_exchange(query, key, value, 1)  # [sq, b, np, dv]; batch is dim 1
            output, _ = self.dense(context.reshape(sq, b, np_ * dv))  # [sq, b, h]
            return output
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, d]
        recompute = self.config.recompute_core_attention and self.training and torch.is_grad_enabled()
        if self.cp_group is not None:  # attention.py's ring, dropout and recomputation alike
            dropout_p = self.config.attention_dropout if self.training else 0.0
            ring = (query, key, value, self.cp_group, self._scale, None, document_ids, dropout_p)
            fork = self.rng_tracker.fork() if dropout_p > 0 and self.rng_tracker is not None else contextlib.nullcontext()
            with fork:
                if recompute:
                    context = tracked_checkpoint_func(self.rng_tracker)(ring_attention, *ring)  # [b, np, sq, dv]
                else:
                    context = ring_attention(*ring)  # [b, np, sq, dv]
        elif recompute:
            context = tracked_checkpoint_func(self.rng_tracker)(self._core_attention, query, key, value, offset, False,
                                                                document_ids)
        else:
            context = self._core_attention(query, key, value, offset, kv_cache is not None,
                                           document_ids)  # [b, np, sq, dv]
        output, _ = self.dense(context.permute(2, 0, 1, 3).reshape(sq, b, np_ * dv))  # [sq, b, h] (SP: [sq/tp, ..])
        return output

    def _ulysses_local_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The core attention on the whole sequence after Ulysses' all-to-all: query / key [s, b, np/sp, dn + dr],
        value [s, b, np/sp, dv] -> context [s, b, np/sp, dv]; causal over all s positions."""
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np/sp, s, d]
        documents = getattr(self, "_documents", None)  # [b, s], set by _attend
        if self.config.recompute_core_attention and self.training and torch.is_grad_enabled():
            context = tracked_checkpoint_func(self.rng_tracker)(self._core_attention, query, key, value, 0, False,
                                                                documents)
        else:
            context = self._core_attention(query, key, value, 0, False, documents)  # [b, np/sp, s, dv]
        return context.permute(2, 0, 1, 3).contiguous()  # [s, b, np/sp, dv]

    @property
    def _scale(self) -> float:
        """1 / sqrt(dn + dr), times YaRN's mscale(factor, mscale_all_dim)^2 (Megatron-LM's and DeepSeek's MLA)."""
        scale = 1.0 / math.sqrt(self.mla.q_head_dim)
        if isinstance(self._rope_scaling, Yarn):
            scale *= self._rope_scaling.softmax_factor
        return scale

    def _core_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offset: int,
                        decoding: bool, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """softmax(Q K^T / sqrt(dn + dr), causal) V by --attention-backend's kernel (attention_core.py): query
        [b, np, sq, dn + dr], key [b, np, sk, dn + dr], value [b, np, sk, dv] -> [b, np, sq, dv]; queries at
        offset .. offset + sq - 1 (``decoding``: after the keys a KV cache holds); ``documents`` [b, s]: each
        query inside its own document (a [b, 1, s, s] boolean mask for sdpa and unfused)."""
        sq, sk = query.shape[2], key.shape[2]
        dropout_p = self.config.attention_dropout if self.training else 0.0
        backend = resolve_attention_backend(self.config.attention_backend, query, alibi=False, dropout_p=dropout_p,
                                            decoding=decoding, documents=documents is not None)
        if backend == "flex":
            if documents is None:
                return flex_core_attention(query, key, value, None, self._scale)
            return flex_core_attention(query, key, value, None, self._scale, document_ids=documents)
        if documents is not None and runs_per_document(backend, dropout_p):
            return sdpa_per_document(query, key, value, documents, None, self._scale)  # as attention.py's
        mask = None  # is_causal (sq == sk), or one new token seeing every cached key
        if documents is not None:
            mask = document_causal_mask(documents, None, query.dtype)  # [b, 1, s, s]
        elif sq != sk and sq > 1:
            positions = torch.arange(offset, offset + sq, device=query.device)  # [sq]
            mask = torch.arange(sk, device=query.device)[None, :] <= positions[:, None]  # [sq, sk], True = attend
        if backend == "decode":  # no dropout while decoding
            return unfused_core_attention(query, key, value, mask, 0.0, self._scale)
        fork = self.rng_tracker.fork() if dropout_p > 0 and self.rng_tracker is not None else contextlib.nullcontext()
        with fork:
            if backend == "unfused":
                return unfused_core_attention(query, key, value, mask, dropout_p, self._scale)
            if backend == "flash":  # refused before launch (megatron.config.combinations): FA2 needs dv = dn + dr
                raise ValueError("--multi-latent-attention does not run on --attention-backend flash")
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p,
                                                  is_causal=mask is None and sq > 1, scale=self._scale)
