"""Tensor-parallel causal self-attention with a fused QKV projection laid out per query group.

    qkv = x @ W_qkv (column-parallel: each TP rank holds np = heads / tp query heads and
                     ng = kv_heads / tp whole query groups)
    attention per head with causal masking and ALiBi / rotary / no position information
    out = context @ W_dense (row-parallel: partial sums all-reduced over the TP group)

Grouped-query attention (Ainslie et al. 2023): the kv_heads key / value heads each serve a group of
heads / kv_heads consecutive query heads (kv_heads = heads is multi-head attention, 1 multi-query).
The fused weight's rows are ordered [kv_heads, heads / kv_heads + 2, hn]: per group its query
heads, then its key head, then its value head (Megatron-LM's layout). So rank r's rows are
exactly its groups' q, k and v: TP slicing, DeepSpeed's universal-checkpoint dim-0 merging and the
transformers mappings all agree. With one query head per group this is [heads, 3, hn], BLOOM's
and transformers' Bloom layout.

DeepSpeed-Ulysses (a ``SequenceExchange`` given at construction): each of sp ranks holds s / sp tokens
of every sample. The projections, rotary (at the tokens' GLOBAL positions) and the dense layer run on
those; an all-to-all (megatron.engine.ulysses builds it from ParallelState, this package knows no
deepspeed) hands the core attention the whole sequence for np / sp heads, [s/sp, b, np, hn] ->
[s, b, np/sp, hn], and back. The query heads are ordered group by group, so rank j's np / sp query heads
are exactly those of its ng / sp key / value heads; ALiBi takes the slopes of those heads.

Context parallelism (a CP group given at construction): each of cp ranks holds the load-balanced s / cp tokens
of every sample (chunks i and 2cp-1-i of 2cp); rotary takes their global positions, and the core attention is
ring attention (megatron.model.ring_attention), which passes the key / value blocks around the group.

Packed documents (--reset-attention-mask): ``forward``'s ``document_ids`` [b, s] (this rank's load-balanced
tokens' under CP; the whole sample's otherwise, Ulysses included) keep each query inside its document, in
every kernel (``megatron.model.attention_core.document_causal_mask`` and its flex / ring forms).

Shape letters: s sequence (sq queries, sk keys incl. cached ones), b micro-batch, h hidden,
np heads per partition, ng query groups (key / value heads) per partition, hn head dim,
hp = np * hn, v / vp vocabulary (per partition).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.model.attention_core import (
    document_causal_mask,
    flash_core_attention,
    flex_core_attention,
    resolve_attention_backend,
    runs_per_document,
    sdpa_per_document,
    unfused_core_attention,
)
from megatron.model.initialization import normal_init, output_layer_std
from megatron.model.kv_cache import BatchKVCache
from megatron.model.norm import Norm
from megatron.model.positional import alibi_bias, alibi_slopes_for_rank, apply_rotary, rotary_cos_sin, rotary_scaling
from megatron.model.ring_attention import ring_attention
from megatron.parallel.context_parallel import load_balanced_positions
from megatron.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.parallel.random import tracked_checkpoint_func
from megatron.parallel.state import LayerGroups, group_rank, group_size

__all__ = ["KVCache", "SelfAttention", "SequenceExchange"]


# torch.compiler.disable in torch's lazy form (torch._disable_dynamo, which torch uses for the same reason): it
# imports torch's compiler stack at the first call, not when this module is imported (~1.2 s of every process's
# start, which runs without --torch-compile never use).
@torch._disable_dynamo  # under --torch-compile: a cached tensor, not something to trace
@functools.lru_cache(maxsize=8)
def shared_alibi_bias(slopes: tuple[float, ...], offset: int, sq: int, sk: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """The ALiBi bias [1, np, sq, sk] for queries at positions offset .. offset + sq - 1.

    One tensor for every layer and micro-batch of a stage (all layers of a TP rank share the slopes):
    SDPA keeps its mask for the backward pass, so a bias rebuilt per layer would be held once per
    layer and per micro-batch in flight (128 MiB per layer at s = 2048 with 16 heads in bf16). Nothing
    writes to it. 4-D, because with a 3-D bias torch's CPU SDPA falls back to its unfused path. Built outside
    inference mode even when first asked for inside it (generation, an evaluation), so that training can save it for
    backward later in the same process.
    """
    with torch.inference_mode(False):
        query_positions = torch.arange(offset, offset + sq, device=device)  # [sq]
        key_positions = torch.arange(sk, device=device)  # [sk]
        slopes_t = torch.tensor(slopes, dtype=torch.float32, device=device)  # [np]
        return alibi_bias(slopes_t, query_positions, key_positions).to(dtype)[None]  # [1, np, sq, sk]


@torch._disable_dynamo  # (lazy: see shared_alibi_bias)
@functools.lru_cache(maxsize=8)
def rows_attention_mask(slopes: Optional[tuple[float, ...]], row_lengths: tuple[int, ...], sq: int, sk: int,
                        dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The mask of rows at different positions (a ``BatchKVCache``): row r's queries sit at row_lengths[r] ..
    row_lengths[r] + sq - 1 and see no key after their own. With ALiBi slopes the bias [b, np, sq, sk],
    else a boolean mask [b, 1, sq, sk] (True = attend).

    Keyed on the lengths, so every layer of one decode step shares one tensor instead of building its own
    (a step's layers all see the same lengths). Nothing writes to it.
    """
    query_positions = torch.tensor(row_lengths, device=device)[:, None] + torch.arange(sq, device=device)  # [b, sq]
    key_positions = torch.arange(sk, device=device)  # [sk]
    if slopes is not None:
        slopes_t = torch.tensor(slopes, dtype=torch.float32, device=device)  # [np]
        return alibi_bias(slopes_t, query_positions, key_positions).to(dtype)  # [b, np, sq, sk]
    return (key_positions[None, None, :] <= query_positions[:, :, None])[:, None]  # [b, 1, sq, sk]


class KVCache:
    """Keys and values one attention layer has seen, for incremental (token by token) decoding.

    Create one per layer (``GPTModel.new_kv_caches()``) and pass it to every forward of that layer.
    ``length`` is the number of positions already cached, i.e. the absolute position of the next
    token; ALiBi and rotary use it so that decoding step by step equals one full forward.
    """

    def __init__(self) -> None:
        self.key: Optional[torch.Tensor] = None    # [sk, b, ng, hn]
        self.value: Optional[torch.Tensor] = None  # [sk, b, ng, hn]

    @property
    def length(self) -> int:
        return 0 if self.key is None else self.key.shape[0]

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's keys and values [sq, b, ng, hn]; return all of them [sk, b, ng, hn]."""
        if self.key is None:
            self.key, self.value = key, value
        else:
            if key.shape[1:] != self.key.shape[1:]:
                raise ValueError(f"KV cache holds [sk, b, ng, hn] = {list(self.key.shape)} but got keys "
                                 f"{list(key.shape)}; use a fresh cache for a new batch")
            self.key = torch.cat((self.key, key), dim=0)  # [sk, b, ng, hn]
            self.value = torch.cat((self.value, value), dim=0)  # [sk, b, ng, hn]
        return self.key, self.value


@dataclasses.dataclass(frozen=True)
class SequenceExchange:
    """What one rank's attention layers need for DeepSpeed-Ulysses; ``megatron.engine.ulysses.ulysses_exchange``
    builds it from ``ParallelState`` and the model builder hands it to every ``SelfAttention``, as it does the
    tensor-parallel group.

    sp_rank, sp_size: this rank holds the tokens sp_rank * s/sp .. (sp_rank + 1) * s/sp - 1 of every sample.
    wrap: ``wrap(local_attention)`` returns ``exchange(query, key, value, batch_dim_idx)``: q, k, v
        [s/sp, b, heads, hn] all-to-all'd into [s, b, heads/sp, hn], ``local_attention`` on those, the context
        all-to-all'd back to [s/sp, b, np, hn] (DeepSpeed's DistributedAttention has this call).
    """

    sp_rank: int
    sp_size: int
    wrap: Callable[[Callable], Callable]

    def __post_init__(self):
        if self.sp_size < 2 or not 0 <= self.sp_rank < self.sp_size:
            raise ValueError(f"sp_rank {self.sp_rank} of a sequence-parallel group of {self.sp_size}: a sequence "
                             f"exchange needs at least 2 ranks and a rank inside the group (SP = 1: pass none)")


class SelfAttention(nn.Module):
    """Causal multi-head / grouped-query self-attention, query groups split across the tensor-parallel group.

    Args:
        config: the model configuration (sizes, position type, dropout, init std, seed).
        groups: ``LayerGroups`` (None: one rank on every axis): ``tp`` the tensor-parallel group; ``cp`` the
            context-parallel group (this rank then holds its load-balanced tokens); ``sequence_exchange``
            DeepSpeed-Ulysses' ``SequenceExchange`` for this rank (None: the whole sequence here).
        layer_number: this layer's 0-based index in the whole model (names its init streams).
        rng_tracker: a ``RNGStatesTracker``; attention dropout runs inside its
            'model-parallel-rng' fork so that it differs across TP ranks (each holds other heads).
    """

    def __init__(self, config: ModelConfig, groups: Optional[LayerGroups] = None, layer_number: int = 0,
                 rng_tracker=None):
        super().__init__()
        groups = groups if groups is not None else LayerGroups()
        tp_group, sequence_exchange = groups.tp, groups.sequence_exchange
        self.config = config
        self.tp_group = tp_group
        self.cp_group = groups.cp
        self.rng_tracker = rng_tracker
        tp_size = group_size(tp_group)
        self.num_heads_per_partition = config.num_attention_heads // tp_size  # np
        self.num_groups_per_partition = config.num_kv_heads // tp_size  # ng
        self.head_dim = config.head_dim  # hn
        prefix = f"layers.{layer_number}.self_attention"
        qkv_size = (config.num_attention_heads + 2 * config.num_kv_heads) * config.head_dim
        # --sequence-parallel: the input is this rank's [s/tp, b, h], gathered along s by the QKV projection;
        # the output is reduce-scattered back to [s/tp, b, h]
        sequence_parallel = config.sequence_parallel and tp_size > 1
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size, qkv_size, tp_group=tp_group, bias=config.qkv_bias, gather_output=False,
            sequence_parallel=sequence_parallel,
            init_method=normal_init(config.init_method_std, config.seed, f"{prefix}.query_key_value.weight"))
        self.dense = RowParallelLinear(  # [h, heads * hn]: the context's width is h unless --kv-channels
            config.query_hidden_size, config.hidden_size, tp_group=tp_group, bias=config.add_bias_linear,
            input_is_parallel=True, sequence_parallel=sequence_parallel,
            init_method=normal_init(output_layer_std(config), config.seed, f"{prefix}.dense.weight"))
        # --qk-layernorm (Qwen3, OLMo 2's per-head form): each query / key head normalized before the rotary
        self.q_layernorm = Norm(config, tp_group, per_head_size=config.head_dim) if config.qk_layernorm else None
        self.k_layernorm = Norm(config, tp_group, per_head_size=config.head_dim) if config.qk_layernorm else None
        self._rope_scaling = rotary_scaling(config)  # Llama 3.1's, YaRN's, or None
        sp_rank, sp_size = (0, 1) if sequence_exchange is None else (sequence_exchange.sp_rank,
                                                                      sequence_exchange.sp_size)
        if self.num_heads_per_partition % sp_size or self.num_groups_per_partition % sp_size:
            raise ValueError(f"{self.num_heads_per_partition} query heads and {self.num_groups_per_partition} key / "
                             f"value heads per tensor-parallel rank do not split over {sp_size} sequence-parallel "
                             f"ranks; the head counts must be divisible by TP x SP = {tp_size * sp_size}")
        self._sp_rank = sp_rank  # this rank's tokens start at sp_rank * s/sp of the whole sequence
        if config.position_embedding_type == "alibi":
            # Not a buffer: it must stay fp32 when the module is cast to bf16, and it is not state. With Ulysses,
            # after the all-to-all this rank holds heads tp_rank * np + sp_rank * np/sp + j of the model's.
            self._alibi_slopes = alibi_slopes_for_rank(config.num_attention_heads,
                                                       group_rank(tp_group) * sp_size + sp_rank, tp_size * sp_size)
            self._alibi_slope_values = tuple(self._alibi_slopes.tolist())  # the key of the shared bias
        # Ulysses' all-to-all attention around the core one. Not a submodule (DistributedAttention is an
        # nn.Module holding no state; ZeRO-3's hooks and state_dict need not see it).
        object.__setattr__(self, "_sequence_exchange", None if sequence_exchange is None
                           else sequence_exchange.wrap(self._ulysses_local_attention))

    @property
    def alibi_slopes(self) -> Optional[torch.Tensor]:
        """This rank's ALiBi slopes [np] (fp32), or None when ALiBi is not used."""
        return getattr(self, "_alibi_slopes", None)

    def forward(self, hidden: torch.Tensor, kv_cache: Optional[KVCache | BatchKVCache] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden [sq, b, h] (already layer-normed) -> attention output [sq, b, h] (bias added);
        with sequence parallelism [sq/tp, b, h] -> [sq/tp, b, h].

        kv_cache: a ``KVCache`` (every row at the same position), or a ``BatchKVCache`` whose rows
        are sequences of different lengths (each row's queries at its own positions, its own mask).
        document_ids: [b, s] the document of every token (--reset-attention-mask; the module docstring)."""
        np_, ng, hn = self.num_heads_per_partition, self.num_groups_per_partition, self.head_dim
        if (self._sequence_exchange is not None or self.cp_group is not None) and kv_cache is not None:
            raise ValueError("decoding with a KV cache runs without sequence or context parallelism (SP = CP = 1 "
                             "when serving)")
        if document_ids is not None and kv_cache is not None:
            raise ValueError("document masks (--reset-attention-mask) are for training; decode without them")
        mixed, _ = self.query_key_value(hidden)  # [sq, b, ng * (np/ng + 2) * hn]
        sq, b, _ = mixed.shape  # the whole sequence even where hidden is a sequence-parallel shard
        # Ulysses: this rank's tokens start at sp_rank * sq of the whole sequence
        offset = self._sp_rank * sq if kv_cache is None else kv_cache.length
        mixed = mixed.view(sq, b, ng, np_ // ng + 2, hn)  # [sq, b, ng, np/ng + 2, hn]
        query, key, value = mixed.split([np_ // ng, 1, 1], dim=3)
        query = query.reshape(sq, b, np_, hn)  # [sq, b, np, hn]: group 0's query heads first
        key, value = key.squeeze(3), value.squeeze(3)  # 2 x [sq, b, ng, hn]
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)  # over hn, per head

        row_lengths = None  # the rows' lengths before this step, for a BatchKVCache (the key of their mask)
        if isinstance(kv_cache, BatchKVCache):
            row_lengths = kv_cache.lengths
            positions = kv_cache.position_ids(sq, hidden.device)  # [b, sq]
        elif self.cp_group is not None:  # this rank's chunks i and 2cp-1-i of the sequence
            cp = group_size(self.cp_group)
            positions = load_balanced_positions(sq * cp, cp, group_rank(self.cp_group), hidden.device)  # [sq]
        else:
            positions = torch.arange(offset, offset + sq, device=hidden.device)  # [sq]
        if self.config.position_embedding_type == "rotary":
            cos, sin = rotary_cos_sin(positions.reshape(-1), hn, self.config.rotary_base,
                                      self._rope_scaling)  # 2 x [sq or b * sq, hn]
            if positions.dim() == 2:
                cos, sin = (t.view(b, sq, hn).transpose(0, 1) for t in (cos, sin))  # 2 x [sq, b, hn]
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        if kv_cache is not None:
            key, value = kv_cache.append(key, value)  # 2 x [sk, b, ng, hn]
        if self._sequence_exchange is not None:
            self._documents = document_ids  # the whole sample's, read by _ulysses_local_attention
            context = self._sequence_exchange(query, key, value, 1)  # [sq, b, np, hn]; batch is dim 1
            output, _ = self.dense(context.reshape(sq, b, np_ * hn))  # [sq, b, h]
            return output
        if self.cp_group is not None:
            dropout_p = self.config.attention_dropout if self.training else 0.0
            ring = (query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), self.cp_group,
                    1.0 / math.sqrt(hn), self.alibi_slopes, document_ids, dropout_p)
            with self._dropout_rng(dropout_p):  # the mask drawn from the stream one process's kernel draws from
                if self.config.recompute_core_attention and self.training and torch.is_grad_enabled():
                    # the ring's forward (its K / V sends included) runs again in backward, on every CP rank in the
                    # same order; only q, k, v are kept (not its output and log-sum-exp)
                    context = tracked_checkpoint_func(self.rng_tracker)(ring_attention, *ring)  # [b, np, sq, hn]
                else:
                    context = ring_attention(*ring)  # [b, np, sq, hn]
            output, _ = self.dense(context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn))  # [sq, b, h]
            return output

        # SDPA wants [b, np, s, hn]. Its fused kernels accumulate the softmax in fp32.
        query = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        key = key.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
        value = value.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
        if self.config.recompute_core_attention and self.training and torch.is_grad_enabled():
            # Recomputed in backward; the tracked checkpoint replays the attention dropout's TP-rank stream.
            context = tracked_checkpoint_func(self.rng_tracker)(
                self._core_attention, query, key, value, positions, offset, False, None, document_ids)  # [b, np, sq, hn]
        else:
            context = self._core_attention(query, key, value, positions, offset, kv_cache is not None, row_lengths,
                                           document_ids)
        context = context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)  # [sq, b, hp]
        output, _ = self.dense(context)  # [sq, b, h]
        return output

    def _ulysses_local_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The core attention on the whole sequence after the all-to-all: query [s, b, np/sp, hn], key / value
        [s, b, ng/sp, hn] -> context [s, b, np/sp, hn]; causal over all s positions (inside each document with the
        document ids ``forward`` set)."""
        s = query.shape[0]
        documents = getattr(self, "_documents", None)  # [b, s]
        positions = torch.arange(s, device=query.device)  # [s]
        query = query.permute(1, 2, 0, 3)  # [b, np/sp, s, hn]
        key = key.permute(1, 2, 0, 3)  # [b, ng/sp, s, hn]
        value = value.permute(1, 2, 0, 3)  # [b, ng/sp, s, hn]
        if self.config.recompute_core_attention and self.training and torch.is_grad_enabled():
            context = tracked_checkpoint_func(self.rng_tracker)(
                self._core_attention, query, key, value, positions, 0, False, None, documents)  # [b, np/sp, s, hn]
        else:
            context = self._core_attention(query, key, value, positions, 0, False, None, documents)  # [b, np/sp, s, hn]
        return context.permute(2, 0, 1, 3).contiguous()  # [s, b, np/sp, hn]

    def _core_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                        offset: int, decoding: bool, row_lengths: Optional[tuple[int, ...]] = None,
                        documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """softmax(Q K^T / sqrt(hn) + bias, causal) V by --attention-backend's kernel (attention_core.py).

        query [b, np, sq, hn], key / value [b, ng, sk, hn] -> context [b, np, sq, hn]. ``row_lengths``: the
        cached lengths of rows at different positions (``positions`` [b, sq] then starts at them).
        ``documents``: [b, s] document ids (sq = sk = s): each query sees its own document only.
        """
        dropout_p = self.config.attention_dropout if self.training else 0.0
        scale = 1.0 / math.sqrt(self.head_dim)
        backend = resolve_attention_backend(self.config.attention_backend, query, alibi=self.alibi_slopes is not None,
                                            dropout_p=dropout_p, decoding=decoding, documents=documents is not None)
        if backend == "flex":
            slopes = self._alibi_slope_values if self.alibi_slopes is not None else None
            if documents is None:
                return flex_core_attention(query, key, value, slopes, scale)
            return flex_core_attention(query, key, value, slopes, scale, document_ids=documents)
        if documents is not None:
            if runs_per_document(backend, dropout_p):
                return sdpa_per_document(query, key, value, documents, self.alibi_slopes, scale)  # [b, np, sq, hn]
            # else a dense [b, 1, s, s] mask (ALiBi: [b, np, s, s] bias), no is_causal
            with self._dropout_rng(dropout_p):
                if backend == "unfused":
                    mask = document_causal_mask(documents, self.alibi_slopes, torch.float32)
                    return unfused_core_attention(query, key, value, mask, dropout_p, scale)  # [b, np, sq, hn]
                mask = document_causal_mask(documents, self.alibi_slopes, query.dtype)
                gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
                return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p,
                                                      scale=scale, **gqa)  # [b, np, sq, hn]
        if backend == "decode":  # no dropout while decoding
            mask = self._attention_mask(positions, offset, key.shape[2], query.dtype, row_lengths)
            return unfused_core_attention(query, key, value, mask, 0.0, scale)  # [b, np, 1, hn]
        with self._dropout_rng(dropout_p):
            if backend == "flash":
                return flash_core_attention(query, key, value, self.alibi_slopes, dropout_p, scale)
            if backend == "unfused":  # an fp32 bias: added to the bf16 scores in fp32 (the sum is not rounded)
                mask = self._attention_mask(positions, offset, key.shape[2], torch.float32, row_lengths)
                return unfused_core_attention(query, key, value, mask, dropout_p, scale)  # [b, np, sq, hn]
            mask = self._attention_mask(positions, offset, key.shape[2], query.dtype, row_lengths)
            # enable_gqa: query head i attends with key / value head i // (np / ng), as the layout groups them.
            gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
            return F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout_p,
                is_causal=mask is None and query.shape[2] > 1, scale=scale, **gqa)  # [b, np, sq, hn]

    def _attention_mask(self, query_positions: torch.Tensor, offset: int, sk: int, dtype: torch.dtype,
                        row_lengths: Optional[tuple[int, ...]] = None) -> Optional[torch.Tensor]:
        """The additive bias [1, np, sq, sk], a boolean mask [sq, sk], or None for SDPA's is_causal; for
        rows at their own positions (``row_lengths``, positions [b, sq]): ``rows_attention_mask``'s.

        is_causal aligns queries with the FIRST keys, which is wrong once cached keys precede the
        queries; then (and for ALiBi, which needs a bias anyway) the mask is built explicitly.
        """
        sq = query_positions.shape[-1]
        if row_lengths is not None:  # shared by the layers of a step
            slopes = self._alibi_slope_values if self.alibi_slopes is not None else None
            return rows_attention_mask(slopes, row_lengths, sq, sk, dtype, query_positions.device)
        if self.alibi_slopes is not None:
            return shared_alibi_bias(self._alibi_slope_values, offset, sq, sk, dtype,
                                     query_positions.device)  # [1, np, sq, sk]
        if sq == sk or sq == 1:
            return None  # is_causal, or one new token that may see every cached key
        key_positions = torch.arange(sk, device=query_positions.device)  # [sk]
        return key_positions[None, :] <= query_positions[:, None]  # [sq, sk], True = attend

    def _dropout_rng(self, dropout_p: float):
        if dropout_p > 0.0 and self.rng_tracker is not None:
            return self.rng_tracker.fork()
        return contextlib.nullcontext()
