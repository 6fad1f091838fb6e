"""Ring attention: causal attention over a sequence whose tokens are spread over a context-parallel group.

Each of the c ranks holds the load-balanced slice of every sequence (chunks i and 2c-1-i of 2c,
``megatron.parallel.context_parallel``) of the queries, keys and values. The key / value blocks go around
the ring: at step t rank r attends to the block of rank (r - t) % c while the next block is on its way, and
the partial results are merged with the online softmax (Milakov & Gimelshein 2018; Liu et al. 2023):

    o = (e^(lse_a) o_a + e^(lse_b) o_b) / (e^(lse_a) + e^(lse_b)),   lse = log(e^(lse_a) + e^(lse_b))

Masks come from GLOBAL token indices: key j is visible to query i if j <= i (and, with document ids, both
lie in the same document); a half-block whose keys all lie after its queries is skipped. ALiBi adds
slope * (j - i) from the same global indices. The backward recomputes each block's probabilities from the
saved log-sum-exp (as FlashAttention does) and sends the key / value blocks around the ring once more,
their gradients travelling with them and arriving back at their owner after c hops.

Bytes sent per rank and layer: forward (c-1) x (K + V blocks); backward (c-1) x (K + V) + c x (dK + dV in fp32).

Shape letters: b micro-batch, np query heads, ng key / value heads, sl = s / c tokens per rank, hn head dim (of
queries and keys), dv the value head dim (hn, or MLA's v-head-dim).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.parallel.context_parallel import RingExchange, load_balanced_positions

__all__ = ["ring_attention", "document_ids"]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document index of every token [b, s] from position ids that restart at 0 with each document."""
    return (position_ids == 0).long().cumsum(dim=-1)  # [b, s]


class _Block:
    """The scores of one (query half, key half) pair: everything both passes need to recompute them."""

    def __init__(self, scale: float, slopes: Optional[torch.Tensor], groups: int):
        self.scale, self.slopes, self.groups = scale, slopes, groups

    def scores(self, query, key, q_pos, k_pos, q_doc, k_doc) -> Optional[torch.Tensor]:
        """fp32 scores [b, np, sq, sk] with -inf where masked, or None when every key lies after every query, or
        (document ids, which ascend with the positions) every key's document ends before every query's begins."""
        if k_pos[0] > q_pos[-1]:  # positions ascend within a half
            return None
        if q_doc is not None and bool((k_doc[:, -1] < q_doc[:, 0]).all()):  # no shared document in any row
            return None
        key = key.float().repeat_interleave(self.groups, dim=1)  # [b, np, sk, hn]
        scores = torch.matmul(query.float(), key.transpose(-1, -2)) * self.scale  # [b, np, sq, sk]
        relative = (k_pos[None, :] - q_pos[:, None]).float()  # [sq, sk]
        if self.slopes is not None:
            scores = scores + self.slopes.float()[:, None, None] * relative  # ALiBi: slope * (j - i)
        visible = relative <= 0  # [sq, sk]
        if q_doc is not None:
            visible = visible & (q_doc[:, :, None] == k_doc[:, None, :])[:, None]  # [b, 1, sq, sk]
        return scores.masked_fill(~visible, float("-inf"))

    def forward(self, scores, value, drop=None):
        """(o [b, np, sq, hn], lse [b, np, sq]) of one block; rows that see no key get lse = -inf, o = 0. ``drop``:
        attention dropout's kept / (1 - p) factors [b, np, sq, sk] on the probabilities (not on their sum, lse)."""
        row_max = scores.amax(dim=-1, keepdim=True)  # [b, np, sq, 1]
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        probs = torch.exp(scores - row_max)  # [b, np, sq, sk], unnormalized
        total = probs.sum(dim=-1, keepdim=True)  # [b, np, sq, 1]
        value = value.float().repeat_interleave(self.groups, dim=1)  # [b, np, sk, hn]
        kept = probs if drop is None else probs * drop
        out = torch.matmul(kept, value) / total.clamp_min(torch.finfo(torch.float32).tiny)
        return out, (row_max + torch.log(total)).squeeze(-1)

    def backward(self, scores, query, key, value, grad_out, lse, delta, drop=None):
        """(dq, dk, dv) of one block from the final lse and delta = rowsum(dO * O); dk, dv summed per kv head.
        With dropout's factors Z: dV = (P Z)^T dO, dP = (dO V^T) Z, dS = P (dP - delta)."""
        probs = torch.exp(scores - lse[..., None])  # [b, np, sq, sk], the final softmax's entries
        key = key.float().repeat_interleave(self.groups, dim=1)  # [b, np, sk, hn]
        value = value.float().repeat_interleave(self.groups, dim=1)  # [b, np, sk, hn]
        kept = probs if drop is None else probs * drop
        grad_value = torch.matmul(kept.transpose(-1, -2), grad_out)  # [b, np, sk, hn]
        grad_probs = torch.matmul(grad_out, value.transpose(-1, -2))  # [b, np, sq, sk]
        if drop is not None:
            grad_probs = grad_probs * drop
        grad_scores = probs * (grad_probs - delta[..., None])
        grad_query = torch.matmul(grad_scores, key) * self.scale  # [b, np, sq, hn]
        grad_key = torch.matmul(grad_scores.transpose(-1, -2), query.float()) * self.scale  # [b, np, sk, hn]
        return grad_query, self._per_kv_head(grad_key), self._per_kv_head(grad_value)

    def _per_kv_head(self, grad):
        b, np_, s, hn = grad.shape
        return grad.view(b, np_ // self.groups, self.groups, s, hn).sum(dim=2)  # [b, ng, sk, hn]


def _halves(length: int):
    half = length // 2
    return (slice(0, half), slice(half, length))


def _visible_pairs(block: _Block, query, key, positions, docs, rank: int, source: int):
    """(query rows, key rows, scores) of every pair of halves (this rank's queries, ``source``'s keys) in which
    some key is visible: a rank's slice is two chunks, each ascending, so a half is one run of positions."""
    for q_rows in _halves(query.shape[2]):
        for k_rows in _halves(key.shape[2]):
            scores = block.scores(query[:, :, q_rows], key[:, :, k_rows], positions[rank][q_rows],
                                  positions[source][k_rows], _rows(docs[rank], q_rows), _rows(docs[source], k_rows))
            if scores is not None:
                yield q_rows, k_rows, scores


def _merge(out, lse, rows, block_out, block_lse):
    """Fold one block's (o, lse) into the running ones for the query rows ``rows`` (in place)."""
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)  # [b, np, sq]
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(old_lse - safe)[..., None]
                       + block_out * torch.exp(block_lse - safe)[..., None])
    lse[:, :, rows] = new_lse


class RingAttention(torch.autograd.Function):
    """Forward: c steps of block attention merged by log-sum-exp, K/V passed on (c - 1 sends).
    Backward: c steps again, K/V passed on (c - 1 sends), their gradients passed with them (c sends)."""

    @staticmethod
    def forward(ctx, query, key, value, group, scale, slopes, doc_ids, dropout_p):
        ring = RingExchange(group)
        c, r, sl = ring.size, ring.rank, query.shape[2]
        positions = [load_balanced_positions(sl * c, c, j, query.device) for j in range(c)]
        drop = _dropout_factors(query, sl * c, dropout_p, positions[r])  # [b, np, sl, s] or None
        docs = [None] * c
        if doc_ids is not None and c == 1:
            docs = [doc_ids]
        elif doc_ids is not None:  # every rank's document ids [b, sl]: small, gathered once
            docs = [torch.empty_like(doc_ids) for _ in range(c)]
            dist.all_gather(docs, doc_ids.contiguous(), group=group)
        block = _Block(scale, slopes, query.shape[1] // key.shape[1])
        out = query.new_zeros(query.shape[:3] + value.shape[-1:], dtype=torch.float32)  # [b, np, sl, dv]
        lse = query.new_full(query.shape[:3], float("-inf"), dtype=torch.float32)  # [b, np, sl]
        kv = (key, value)
        for step in range(c):
            source = (r - step) % c
            if step < c - 1:
                ring.start(kv)  # the next block travels while this one is computed
            for q_rows, k_rows, scores in _visible_pairs(block, query, kv[0], positions, docs, r, source):
                factors = _block_factors(drop, q_rows, positions[source][k_rows])
                _merge(out, lse, q_rows, *block.forward(scores, kv[1][:, :, k_rows], factors))
            if step < c - 1:
                kv = tuple(ring.wait())
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.block, ctx.positions, ctx.docs, ctx.drop = group, block, positions, docs, drop
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        block, positions, docs = ctx.block, ctx.positions, ctx.docs
        kv_ring, grad_ring = RingExchange(ctx.group), RingExchange(ctx.group)
        c, r = kv_ring.size, kv_ring.rank
        grad_out = grad_out.float()
        delta = (grad_out * out.float()).sum(dim=-1)  # [b, np, sl]
        grad_query = torch.zeros_like(query, dtype=torch.float32)
        kv = (key, value)
        grad_kv = (torch.zeros_like(key, dtype=torch.float32), torch.zeros_like(value, dtype=torch.float32))
        for step in range(c):
            source = (r - step) % c
            if step < c - 1:
                kv_ring.start(kv)
            for q_rows, k_rows, scores in _visible_pairs(block, query, kv[0], positions, docs, r, source):
                dq, dk, dv = block.backward(scores, query[:, :, q_rows], kv[0][:, :, k_rows], kv[1][:, :, k_rows],
                                            grad_out[:, :, q_rows], lse[:, :, q_rows], delta[:, :, q_rows],
                                            _block_factors(ctx.drop, q_rows, positions[source][k_rows]))
                grad_query[:, :, q_rows] += dq
                grad_kv[0][:, :, k_rows] += dk
                grad_kv[1][:, :, k_rows] += dv
            if c > 1:  # the block's gradients follow it; after c hops they are back at their owner
                grad_ring.start(grad_kv)
                grad_kv = tuple(grad_ring.wait())
            if step < c - 1:
                kv = tuple(kv_ring.wait())
        return (grad_query.to(query.dtype), grad_kv[0].to(key.dtype), grad_kv[1].to(value.dtype),
                None, None, None, None, None)


def _rows(doc_ids: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    return None if doc_ids is None else doc_ids[:, rows]


def _dropout_factors(query: torch.Tensor, s: int, dropout_p: float, mine: torch.Tensor) -> Optional[torch.Tensor]:
    """Attention dropout's kept / (1 - p) factors of this rank's query rows [b, np, sl, s] (global key order), or
    None. The whole [b, np, s, s] draw is one process's: SDPA's dropout on CPU is ``bernoulli_(1 - p)`` over the
    probabilities' shape from the current generator (the caller's RNG-tracker fork), so every CP rank draws the
    same mask and keeps its rows. It costs O(s^2) memory for the draw (a fused kernel's counter-based RNG would not:
    FlashAttention's Philox offsets, CUDA only)."""
    if dropout_p == 0.0:
        return None
    b, np_ = query.shape[:2]
    keep = torch.empty(b, np_, s, s, dtype=query.dtype, device=query.device).bernoulli_(1 - dropout_p)
    return keep[:, :, mine].float() / (1 - dropout_p)  # [b, np, sl, s]


def _block_factors(drop: Optional[torch.Tensor], q_rows: slice, key_positions: torch.Tensor):
    return None if drop is None else drop[:, :, q_rows][..., key_positions]  # [b, np, sq, sk]


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp_group, scale: float,
                   slopes: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None,
                   dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's load-balanced slice against the whole sequence of the CP group.

    query [b, np, sl, hn], key [b, ng, sl, hn], value [b, ng, sl, dv] (this rank's tokens, in load-balanced
    order); slopes: ALiBi's fp32 [np] for these query heads, or None; doc_ids: [b, sl] document index of each token
    (attention stays inside a document), or None; dropout_p: attention dropout on the probabilities, the mask one
    process draws from the current generator (``_dropout_factors``) -> context [b, np, sl, dv].
    """
    return RingAttention.apply(query, key, value, cp_group, scale, slopes, doc_ids, dropout_p)
