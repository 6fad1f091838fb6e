"""The attention core, softmax(Q K^T / sqrt(hn) + position bias, causal) V, by one of several kernels.

    sdpa   torch's scaled_dot_product_attention (the default path, see attention.py): ALiBi as a materialized
           bias [1, np, sq, sk] shared by a stage's layers, causality by is_causal or a boolean [sq, sk] mask.
    flex   torch.nn.attention.flex_attention, compiled: ALiBi as a score_mod (slope * (key - query) added to
           each score), causality as a block mask; no [np, s, s] tensor exists. No dropout. torch 2.13 has no
           flex backward on CPU: there the forward is flex and the backward recomputes the attention per block
           of FLEX_CPU_BACKWARD_BLOCK queries with SDPA autograd ([np, block, sk] at a time, never [np, s, s]).
           Where inductor cannot compile flex for the CPU (its template needs AVX2 kernels: a CPU without AVX2,
           or ATEN_CPU_CAPABILITY=default), the forward runs by the same blocks too (one warning says so).
    unfused  Megatron-LM's name: Q K^T, the bias or mask added, softmax in fp32, dropout, times V, as plain
           matmuls. It keeps the [b, np, sq, sk] probabilities for backward (s^2 memory, like transformers'
           eager Bloom attention), but under --torch-compile inductor fuses the scale, bias, mask and softmax
           around two matmuls, which on the CPU beats SDPA's fused kernel at short sequences (measured in
           benchmarks/bench_train_vs_transformers.py).
    flash  FlashAttention-2's flash_attn_func (the optional ``flash-attn`` package; CUDA, bf16 / fp16) with
           its alibi_slopes and causal=True: -slope * |i - j| on visible keys is exactly our bias. It cannot
           run here (no GPU, no package): written to its documented interface, untested.
    decode   one new token per row (incremental decoding, sq = 1) in fp32 on CPU: the unfused path (two batched
           products, the query heads of a group in one product). SDPA's CPU kernel, tiled for long query blocks,
           took 65 / 55 us where this takes 55 / 50 (boolean mask / bias) at 16 rows x 8 heads x 40 keys
           (about 15% of a decode step in benchmarks/bench_serving.py).

``resolve_attention_backend`` turns --attention-backend (auto or a name) into the kernel of one call;
``auto`` picks, on CPU, unfused while torch.compile traces the layer (--torch-compile) and sq x sk is at most
UNFUSED_AUTO_MAX_SCORES, else sdpa (eager SDPA was measured faster than flex at every length,
docs/performance.md); on CUDA flash where the package is importable and the dtype allows, else flex for ALiBi
(SDPA's bias rules out its flash kernels), else sdpa (is_causal reaches the flash kernels). Incremental
decoding with a KV cache is decode for one fp32 token per row on CPU, else sdpa.

Document masks (Megatron's --reset-attention-mask): ``document_ids`` [b, s], the document of every token of a
packed sample; a query sees the keys before it in its own document only. What each kernel pays for it:

    sdpa     one SDPA call per document on its own queries and keys (``sdpa_per_document``: is_causal, with ALiBi
             the document's own bias): the work and memory of the visible pairs, sum d^2, and no [s, s] tensor.
             With dropout, or traced by torch.compile, a dense boolean mask [b, 1, s, s] (with ALiBi an additive
             bias [b, np, s, s]) built per layer call and kept for the backward: O(b s^2) memory, all s^2 pairs
             computed (torch's CPU SDPA has no varlen form; the whole sample's dropout draw needs the one call).
    unfused  the same mask, applied to the [b, np, s, s] scores it holds anyway: nothing of a new order.
    flex     a document mask_mod in a block mask ([b, 1, s/128, s/128] block indices, no [s, s] tensor kept;
             create_block_mask evaluates the mask_mod over the [b, s, s] grid once per call while building it);
             the CPU backward's blocks build [b, 1, c, s] masks (c = FLEX_CPU_BACKWARD_BLOCK).
    flash    refused with document masks (flash_attn_varlen_func with cu_seqlens is the kernel for it; this
             package cannot be run here to test it); auto does not pick it then.
    ring     (context parallelism, ring_attention.py) masks its [c, c] blocks from the gathered document ids.

Shape letters: s sequence (sq queries, sk keys), b micro-batch, np heads per partition, ng key / value heads
per partition, hn head dim (queries and keys), dv the value head dim (hn; multi-head latent attention's
v-head-dim differs: sdpa, flex and unfused take it).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.config.hardware import flex_compiles_on_this_cpu
from megatron.model.positional import alibi_bias

logger = logging.getLogger(__name__)

__all__ = ["FLEX_CPU_BACKWARD_BLOCK", "UNFUSED_AUTO_MAX_SCORES", "flash_attn_available", "resolve_attention_backend",
           "document_causal_mask", "document_runs", "runs_per_document", "sdpa_per_document", "flex_core_attention",
           "flash_core_attention", "unfused_core_attention"]

FLEX_CPU_BACKWARD_BLOCK = 256  # queries per recomputed block in flex's CPU backward
UNFUSED_AUTO_MAX_SCORES = 1024 * 1024  # auto's unfused path on CPU: sq x sk at most this (s <= 1024)


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention_backend(requested: str, query: torch.Tensor, *, alibi: bool, dropout_p: float,
                              decoding: bool, documents: bool = False) -> str:
    """The kernel for one attention call: ``requested`` unless it is auto; ValueError where it cannot run.
    (flex with attention dropout is refused by ModelConfig.validate.) ``documents``: a document mask applies."""
    if documents and requested == "flash":
        raise ValueError("--attention-backend flash has no document mask here (--reset-attention-mask): "
                         "flash_attn_varlen_func would take the documents as cu_seqlens, but it cannot be run "
                         "here to test it; use sdpa, flex or unfused")
    if decoding:  # cached keys before the queries: an explicit mask handles any offset
        one_fp32_token_on_cpu = query.shape[2] == 1 and query.dtype == torch.float32 and query.device.type == "cpu"
        return "decode" if one_fp32_token_on_cpu else "sdpa"
    cuda = query.device.type == "cuda"
    half = query.dtype in (torch.bfloat16, torch.float16)
    if requested == "auto":
        if cuda and half and flash_attn_available() and not documents:
            return "flash"
        if not cuda:
            compiling = torch.compiler.is_compiling()
            return "unfused" if compiling and query.shape[2] ** 2 <= UNFUSED_AUTO_MAX_SCORES else "sdpa"
        return "flex" if (alibi or documents) and dropout_p == 0.0 else "sdpa"
    if requested == "flash" and not (cuda and half and flash_attn_available()):
        raise ValueError(f"--attention-backend flash needs the flash-attn package, a CUDA device and bf16 / fp16 "
                         f"(here: flash-attn {'importable' if flash_attn_available() else 'not installed'}, "
                         f"{query.device.type}, {query.dtype}); use flex or sdpa")
    return requested


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention():
    # Imported here: flex_attention pulls in torch's compiler stack, which only this backend needs.
    from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415 (flex attention: only when that backend runs)

    return torch.compile(flex_attention, dynamic=False)


def _causal(batch, head, query_index, key_index):
    return query_index >= key_index


@functools.lru_cache(maxsize=8)
def _causal_block_mask(sq: int, sk: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415 (flex attention: only when that backend runs)

    with torch.inference_mode(False):  # cached: usable by training after an inference-mode first use
        return create_block_mask(_causal, None, None, sq, sk, device=device)


@functools.lru_cache(maxsize=8)
def _alibi_score_mod(slopes: tuple[float, ...], device: torch.device):
    """score + slope[head] * (key - query): one function per slope set, so every layer of a rank shares it
    (and torch.compile's cache entry)."""
    with torch.inference_mode(False):  # cached: usable by training after an inference-mode first use
        slopes_t = torch.tensor(slopes, dtype=torch.float32, device=device)  # [np]

    def alibi(score, batch, head, query_index, key_index):
        return score + slopes_t[head] * (key_index - query_index)

    return alibi


def document_causal_mask(document_ids: torch.Tensor, slopes: Optional[torch.Tensor], dtype: torch.dtype,
                         rows: slice = slice(None)) -> torch.Tensor:
    """The mask of packed documents: query i sees key j <= i of its own document.

    document_ids [b, s] -> a boolean mask [b, 1, sq, s] (True = attend) for the queries ``rows`` (sq of them;
    all by default); with ALiBi ``slopes`` (fp32 [np]) the additive bias [b, np, sq, s] in ``dtype``
    (slope * (j - i) where visible, -inf elsewhere).
    """
    s = document_ids.shape[1]
    key_positions = torch.arange(s, device=document_ids.device)  # [s]
    query_positions = key_positions[rows]  # [sq]
    same = document_ids[:, rows, None] == document_ids[:, None, :]  # [b, sq, s]
    visible = same & (key_positions[None, :] <= query_positions[:, None])  # [b, sq, s]
    if slopes is None:
        return visible[:, None]  # [b, 1, sq, s]
    bias = alibi_bias(slopes.to(document_ids.device), query_positions, key_positions)[None]  # [1, np, sq, s] fp32
    return bias.masked_fill(~visible[:, None], float("-inf")).to(dtype)  # [b, np, sq, s]


def document_runs(document_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Each row's documents as (start, stop) runs of equal ids (document_ids [b, s], whose ids run in blocks, as
    packed samples' are: ``megatron.training.batches``, ``ring_attention.document_ids``). One host read."""
    ids = document_ids.cpu()
    b, s = ids.shape
    starts = (ids[:, 1:] != ids[:, :-1]).nonzero().tolist()  # [(row, position before a new document)]
    bounds = [[0] for _ in range(b)]
    for row, before in starts:
        bounds[row].append(before + 1)
    return [list(zip(row, row[1:] + [s])) for row in bounds]


def runs_per_document(backend: str, dropout_p: float) -> bool:
    """Whether a call with document ids takes ``sdpa_per_document``: sdpa without dropout (the dense mask's one call
    draws the whole sample's dropout mask) and not traced by torch.compile (the documents' bounds are a host read)."""
    return backend == "sdpa" and dropout_p == 0.0 and not torch.compiler.is_compiling()


def sdpa_per_document(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, document_ids: torch.Tensor,
                      slopes: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Per-document causal attention by SDPA on each document's own queries and keys: is_causal (the fused kernel
    skips the future), with ALiBi (``slopes``, fp32 [np]) the document's own [1, np, d, d] bias. The work and the
    memory of the pairs a document mask leaves visible (sum d^2 over the documents) instead of a dense
    [b, 1, s, s] mask over all s^2 pairs, which SDPA's CPU kernel computes in full and keeps for backward (16k tokens
    in 8 documents: 2.6x the causal time, 1 GiB kept; benchmarks/bench_document_attention.py). The same function as
    ``document_causal_mask``'s; no dropout (the dense path draws the whole sample's mask).

    query [b, np, s, hn], key [b, ng, s, hn], value [b, ng, s, dv], document_ids [b, s] -> context [b, np, s, dv].
    """
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    rows = []
    for row, runs in enumerate(document_runs(document_ids)):
        parts = []
        for start, stop in runs:
            q, k, v = (t[row:row + 1, :, start:stop] for t in (query, key, value))  # [1, heads, d, .]
            bias = None
            if slopes is not None:
                positions = torch.arange(stop - start, device=query.device)
                bias = alibi_bias(slopes.to(query.device), positions, positions).to(query.dtype)[None]  # [1, np, d, d]
            parts.append(F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None, scale=scale,
                                                        **gqa))  # [1, np, d, dv]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)  # [b, np, s, dv]


def _document_block_mask(document_ids: torch.Tensor):
    """flex's block mask of ``document_causal_mask`` (document_ids [b, s])."""
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415 (flex attention: only when that backend runs)

    def document_causal(batch, head, query_index, key_index):
        same = document_ids[batch, query_index] == document_ids[batch, key_index]
        return (query_index >= key_index) & same

    b, s = document_ids.shape
    return create_block_mask(document_causal, b, None, s, s, device=document_ids.device)


def _blockwise_mask(query, sk, start, stop, slopes, document_ids):
    """The mask of queries start..stop against all sk keys: with documents a boolean [b, 1, c, sk] (with ALiBi an
    fp32 bias [b, np, c, sk]); else causal [c, sk], with ALiBi the fp32 bias [1, np, c, sk]."""
    if document_ids is not None:
        return document_causal_mask(document_ids, slopes, torch.float32, slice(start, stop))
    key_positions = torch.arange(sk, device=query.device)  # [sk]
    query_positions = torch.arange(start, stop, device=query.device)  # [c]
    if slopes is None:
        return key_positions[None, :] <= query_positions[:, None]  # [c, sk]
    return alibi_bias(slopes, query_positions, key_positions)[None]  # [1, np, c, sk] fp32


def _blockwise_sdpa(query_block, key, value, start, slopes, scale, document_ids):
    """SDPA of one block of queries (query_block [b, np, c, hn], its first row ``start``) over all keys, masked as
    flex masks them: [b, np, c, hn]. ``slopes``: fp32 [np] or None."""
    mask = _blockwise_mask(query_block, key.shape[2], start, start + query_block.shape[2], slopes, document_ids)
    return F.scaled_dot_product_attention(
        query_block, key, value, attn_mask=mask.to(query_block.dtype) if slopes is not None else mask,
        scale=scale, enable_gqa=query_block.shape[1] != key.shape[1])


@functools.lru_cache(maxsize=1)
def _warn_flex_by_blocks():
    logger.warning("--attention-backend flex: torch compiles flex attention for the CPU only with AVX2 kernels "
                   "(this process: %s); its forward runs by blocks of %d queries with SDPA, as its CPU backward "
                   "does: the same attention, [np, block, s] at a time",
                   "ATEN_CPU_CAPABILITY=default" if torch.cpu._is_avx2_supported() else "a CPU without AVX2",
                   FLEX_CPU_BACKWARD_BLOCK)


def _flex_forward(query, key, value, slopes, scale, document_ids=None):
    if query.device.type == "cpu" and not flex_compiles_on_this_cpu():
        _warn_flex_by_blocks()
        slopes_t = None if slopes is None else torch.tensor(slopes, dtype=torch.float32, device=query.device)
        return torch.cat([_blockwise_sdpa(query[:, :, start:start + FLEX_CPU_BACKWARD_BLOCK], key, value, start,
                                          slopes_t, scale, document_ids)
                          for start in range(0, query.shape[2], FLEX_CPU_BACKWARD_BLOCK)], dim=2)  # [b, np, sq, hn]
    score_mod = _alibi_score_mod(slopes, query.device) if slopes is not None else None
    if document_ids is None:
        block_mask = _causal_block_mask(query.shape[2], key.shape[2], query.device)
    else:
        block_mask = _document_block_mask(document_ids)
    return _compiled_flex_attention()(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                      enable_gqa=query.shape[1] != key.shape[1])  # [b, np, sq, hn]


class _FlexWithBlockwiseBackward(torch.autograd.Function):
    """flex forward; backward by SDPA autograd over blocks of queries (exact: each output row depends on its
    own query row only, so the blocks' gradients are the full gradient, up to summation order in dK, dV)."""

    @staticmethod
    def forward(ctx, query, key, value, slopes, scale, document_ids):
        ctx.save_for_backward(query, key, value)
        ctx.slopes, ctx.scale, ctx.document_ids = slopes, scale, document_ids
        return _flex_forward(query.detach(), key.detach(), value.detach(), slopes, scale, document_ids)

    @staticmethod
    def backward(ctx, grad_context):
        query, key, value = ctx.saved_tensors
        slopes = None if ctx.slopes is None else torch.tensor(ctx.slopes, dtype=torch.float32, device=query.device)
        with torch.enable_grad():
            key_ = key.detach().requires_grad_()
            value_ = value.detach().requires_grad_()
            grad_query = []
            for start in range(0, query.shape[2], FLEX_CPU_BACKWARD_BLOCK):
                stop = min(start + FLEX_CPU_BACKWARD_BLOCK, query.shape[2])
                query_block = query[:, :, start:stop].detach().requires_grad_()  # [b, np, c, hn]
                context = _blockwise_sdpa(query_block, key_, value_, start, slopes, ctx.scale,
                                          ctx.document_ids)  # [b, np, c, hn]
                context.backward(grad_context[:, :, start:stop])
                grad_query.append(query_block.grad)
        return torch.cat(grad_query, dim=2), key_.grad, value_.grad, None, None, None


# the blockwise backward calls autograd itself; dynamo runs it as it is (torch.compiler.disable in its lazy form,
# which imports torch's compiler stack at the first call: attention.shared_alibi_bias says why)
@torch._disable_dynamo
def _flex_cpu_training(query, key, value, slopes, scale, document_ids=None):
    return _FlexWithBlockwiseBackward.apply(query, key, value, slopes, scale, document_ids)


def flex_core_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        slopes: Optional[tuple[float, ...]], scale: float,
                        document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention, ALiBi when ``slopes`` (this rank's, one per query head) are given; inside each
    document when ``document_ids`` [b, s] are given.

    query [b, np, sq, hn], key / value [b, ng, sk, hn] with sq = sk (no cache) -> context [b, np, sq, hn].
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if needs_grad and query.device.type == "cpu":
        return _flex_cpu_training(query, key, value, slopes, scale, document_ids)
    if not needs_grad:  # torch's CPU check looks at requires_grad, even under no_grad
        query, key, value = query.detach(), key.detach(), value.detach()
    return _flex_forward(query, key, value, slopes, scale, document_ids)


def flash_core_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         slopes: Optional[torch.Tensor], dropout_p: float, scale: float) -> torch.Tensor:
    """FlashAttention-2, causal, ALiBi when ``slopes`` (fp32 [np], this rank's) are given; GQA natively.

    query [b, np, sq, hn], key / value [b, ng, sk, hn] -> context [b, np, sq, hn].
    """
    from flash_attn import flash_attn_func  # noqa: PLC0415 (optional package (CUDA only); resolve_attention_backend checked it)

    context = flash_attn_func(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),  # [b, s, heads, hn]
        dropout_p=dropout_p, softmax_scale=scale, causal=True,
        alibi_slopes=None if slopes is None else slopes.to(query.device, torch.float32))  # [b, sq, np, hn]
    return context.transpose(1, 2)  # [b, np, sq, hn]


def unfused_core_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                           dropout_p: float, scale: float) -> torch.Tensor:
    """softmax(Q K^T * scale + bias) V as plain matmuls; the probabilities in fp32, then the input dtype.

    query [b, np, sq, hn], key [b, ng, sk, hn], value [b, ng, sk, dv]; mask: an additive bias [1 or b, np, sq, sk],
    a boolean mask [sq, sk] or [b, 1, sq, sk] (True = attend), or None for causal with sq = sk -> context
    [b, np, sq, dv].
    Dropout (on the probabilities, as SDPA's) draws from the caller's RNG state.

    As Megatron's: the scale is applied inside the QK^T product (baddbmm's alpha: one rounding, no pass over
    the scores), the bias added and the softmax taken in fp32 in one kernel each (the sum promotes to fp32;
    softmax's dtype casts as it reads): three passes over the [b, np, sq, sk] scores fewer, forward and
    backward, than a cast, a scale and an add.
    """
    b, np_, sq, hn = query.shape
    ng, sk, dv = key.shape[1], key.shape[2], value.shape[-1]
    # Query head i uses key / value head i // (np / ng): a group's query heads side by side in one product, with
    # no copies of the keys and values (views of a KV cache merge b and ng without a copy).
    grouped = query.reshape(b * ng, np_ // ng * sq, hn)  # [b ng, np/ng * sq, hn]
    unused = query.new_empty((1, 1, 1))  # beta = 0: baddbmm never reads it
    scores = torch.baddbmm(unused, grouped, key.reshape(b * ng, sk, hn).transpose(1, 2), beta=0.0,
                           alpha=scale).view(b, np_, sq, sk)  # [b, np, sq, sk], the input dtype
    if mask is None:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril_(sk - sq)  # [sq, sk] causal
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask  # an fp32 bias promotes the sum to fp32
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # [b, np, sq, sk]
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    context = torch.bmm(probs.view(b * ng, np_ // ng * sq, sk), value.reshape(b * ng, sk, dv))
    return context.view(b, np_, sq, dv)  # [b, np, sq, dv]
