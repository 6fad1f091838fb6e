"""GPTModel: embedding -> transformer layers -> final norm -> output head, on one pipeline stage.

The same modules (EmbeddingLayer, TransformerLayer, FinalLayerNorm, OutputLayer) are what a pipeline engine
stages one by one; this class only composes them for a single stage and adds the loss.

Shape letters: s sequence, b micro-batch, h hidden, np heads per partition, hn head dim,
hp = np * hn, v / vp vocabulary (per partition).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.model.attention import KVCache, SequenceExchange
from megatron.model.embedding import EmbeddingLayer, OutputLayer
from megatron.model.kv_cache import BatchKVCache
from megatron.model.mtp import MultiTokenPrediction, add_mtp_loss, mtp_depth_losses
from megatron.model.transformer import FinalLayerNorm, TransformerLayer
from megatron.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.parallel.state import ParallelState

__all__ = ["GPTModel", "gpt_loss", "per_token_loss"]


def per_token_loss(logits_parallel: torch.Tensor, labels: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Cross-entropy of each token: logits [s, b, vp] (vocab-parallel), labels [b, s] -> loss [b, s].

    The loss is fp32 whatever the logits' dtype: vocab_parallel_cross_entropy does its softmax in
    fp32 (over tens of thousands of entries bf16 would lose most of the precision).
    """
    if labels.shape != logits_parallel.shape[1::-1]:
        raise ValueError(f"labels must be [b, s] = {list(logits_parallel.shape[1::-1])} for logits "
                         f"[s, b, vp] = {list(logits_parallel.shape)}, got {list(labels.shape)}")
    target = labels.transpose(0, 1)  # [s, b]
    loss = vocab_parallel_cross_entropy(logits_parallel, target, tp_group)  # [s, b]
    return loss.transpose(0, 1)  # [b, s]


def gpt_loss(logits_parallel: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
             tp_group=None) -> torch.Tensor:
    """Megatron's language-model loss: sum(loss * mask) / sum(mask), a scalar (fp32).

    logits_parallel [s, b, vp] (vocab-parallel), labels [b, s], loss_mask [b, s] (1 = count the token).
    Usable as a pipeline loss_fn once ``tp_group`` is bound (e.g. with functools.partial).
    """
    loss = per_token_loss(logits_parallel, labels, tp_group)  # [b, s]
    if loss_mask.shape != loss.shape:
        raise ValueError(f"loss_mask must be [b, s] = {list(loss.shape)}, got {list(loss_mask.shape)}")
    mask = loss_mask.to(torch.float32)
    # clamp: a micro-batch with nothing to count gives 0, not NaN.
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


def _check_sequence_exchange(state: ParallelState, exchange: Optional[SequenceExchange]) -> None:
    """A model of a sequence-parallel rank attends through its group's exchange, and only then."""
    sp_rank, sp_size = (0, 1) if exchange is None else (exchange.sp_rank, exchange.sp_size)
    if (sp_rank, sp_size) != (state.sp_rank, state.sp_size):
        raise ValueError(f"the parallel state is sequence-parallel rank {state.sp_rank} of {state.sp_size} but the "
                         f"sequence exchange is rank {sp_rank} of {sp_size}; pass "
                         f"megatron.engine.ulysses.ulysses_exchange(parallel_state) (None when SP = 1)")


class GPTModel(nn.Module):
    """A GPT / BLOOM / Llama-style decoder on a single pipeline stage, tensor-parallel over ``parallel_state.tp_group``.

    Args:
        config: the model configuration.
        parallel_state: this rank's groups (``ParallelState.single()`` for one process). Only the
            layer groups are used (``ParallelState.layer_groups``: TP, CP (ring attention; the inputs are then this
            rank's load-balanced tokens), EP); pipeline parallelism stages the same modules elsewhere.
        rng_tracker: optional ``RNGStatesTracker`` for attention dropout inside the TP region (and, with
            ``config.sequence_parallel``, the dropout of the sequence shards).
        sequence_exchange: with DeepSpeed-Ulysses (``parallel_state.sp_size`` > 1, required then), every
            attention layer's ``SequenceExchange`` (``megatron.engine.ulysses.ulysses_exchange(parallel_state)``).

    Parameter names: ``embedding.word_embeddings.weight``, ``embedding.position_embeddings.weight``,
    ``embedding.embed_layernorm.*``, ``layers.{i}.input_layernorm.*``,
    ``layers.{i}.self_attention.query_key_value.*``, ``layers.{i}.self_attention.dense.*``,
    ``layers.{i}.post_attention_layernorm.*``, ``layers.{i}.mlp.dense_h_to_4h.*``,
    ``layers.{i}.mlp.dense_4h_to_h.*``, ``final_layernorm.*``, and with untied embeddings
    ``output_layer.weight``.
    """

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, rng_tracker=None,
                 sequence_exchange: Optional[SequenceExchange] = None):
        super().__init__()
        parallel_state = parallel_state if parallel_state is not None else ParallelState.single()
        config.validate(parallel_state.tp_size)
        _check_sequence_exchange(parallel_state, sequence_exchange)
        self.config = config
        self.tp_group = parallel_state.tp_group
        self.embedding = EmbeddingLayer(config, self.tp_group, rng_tracker)
        groups = parallel_state.layer_groups(sequence_exchange)
        self.layers = nn.ModuleList(TransformerLayer(config, groups, i, rng_tracker) for i in range(config.num_layers))
        self.final_layernorm = FinalLayerNorm(config, self.tp_group)
        self.output_layer = None if config.tied_embeddings else OutputLayer(config, self.tp_group)
        self.mtp = MultiTokenPrediction(config, groups, rng_tracker) if config.mtp_num_layers else None
        self._recompute: Optional[tuple[Callable, int]] = None

    def recompute_activations(self, checkpoint_fn: Callable, num_layers: int = 1) -> None:
        """While training, keep only the input of each run of ``num_layers`` transformer layers and recompute
        the rest in backward, through ``checkpoint_fn(function, hidden)`` (e.g. the RNG-tracking one of
        ``megatron.engine.pipeline``); the layers are called as modules, so their hooks (ZeRO-3's gathers)
        run again for the recomputation. Decoding with KV caches never recomputes."""
        if num_layers < 1:
            raise ValueError(f"--checkpoint-num-layers must be >= 1, got {num_layers}")
        self._recompute = (checkpoint_fn, num_layers)

    def _run_layers(self, hidden: torch.Tensor, kv_caches, document_ids: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
        extra = () if document_ids is None else (document_ids,)  # the layers' call as before without documents
        if self._recompute is None or not self.training or kv_caches is not None:
            for i, layer in enumerate(self.layers):
                hidden = layer(hidden, None if kv_caches is None else kv_caches[i], *extra)  # [s, b, h]
            return hidden
        checkpoint_fn, size = self._recompute
        for start in range(0, len(self.layers), size):
            chunk = self.layers[start:start + size]

            def run(x, chunk=chunk):
                for layer in chunk:
                    x = layer(x, None, *extra)
                return x

            hidden = checkpoint_fn(run, hidden)  # [s, b, h]
        return hidden

    def new_kv_caches(self) -> list[KVCache]:
        """One empty KV cache per layer, for :meth:`forward`'s ``kv_caches``."""
        return [KVCache() for _ in self.layers]

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None,
                kv_caches: Optional[Sequence[KVCache]] = None, document_ids: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """input_ids [b, s] -> logits [s, b, vp] (vocab-parallel) when ``labels`` is None;
        with labels [b, s]: the per-token loss [b, s], or with loss_mask [b, s] too, gpt_loss (scalar).

        kv_caches: from :meth:`new_kv_caches`, reused across calls to decode incrementally; the
        positions of the new tokens then continue after the cached ones (position_ids, if None,
        too). ``BatchKVCache`` s (one per layer) decode rows of different lengths together, each
        continuing after its own cached positions.

        document_ids: [b, s] the document of every token of packed samples (Megatron's --reset-attention-mask,
        ``megatron.training.batches.document_ids``): attention stays inside each document.
        """
        if kv_caches is not None and self.embedding.sequence_parallel:
            raise ValueError("decoding with KV caches needs a model built without sequence parallelism (it splits "
                             "the sequence, one token while decoding); build it from a config with "
                             "sequence_parallel=False (the checkpoint is the same)")
        if kv_caches is not None and len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        if position_ids is None and kv_caches is not None and isinstance(kv_caches[0], BatchKVCache):
            position_ids = kv_caches[0].position_ids(input_ids.shape[1], input_ids.device)  # [b, s]
        elif position_ids is None and kv_caches is not None and kv_caches[0].length > 0:
            start = kv_caches[0].length
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None, :]
        hidden = self.embedding(input_ids, position_ids)  # [s, b, h]
        hidden = self._run_layers(hidden, kv_caches, document_ids)  # [s, b, h]
        hidden = self.final_layernorm(hidden)  # [s, b, h]
        logits = self._head(hidden)  # [s, b, vp]
        if labels is None:
            if loss_mask is not None:
                raise ValueError("loss_mask was given without labels")
            return logits
        if loss_mask is None:
            return per_token_loss(logits, labels, self.tp_group)
        loss = gpt_loss(logits, labels, loss_mask, self.tp_group)
        if self.mtp is None or kv_caches is not None:
            return loss
        depth_losses = mtp_depth_losses(
            self.mtp, hidden, labels, loss_mask, self.embedding,
            lambda h, target, mask: gpt_loss(self._head(h), target, mask, self.tp_group))
        return add_mtp_loss(loss, self.mtp, depth_losses)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, h] -> vocab-parallel logits [s, b, vp], through the output layer or the tied embedding."""
        if self.output_layer is not None:
            return self.output_layer(hidden)
        return self.embedding.lm_logits(hidden)
